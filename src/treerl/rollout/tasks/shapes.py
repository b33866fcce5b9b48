"""Built-in vision-language task: count the shapes in a generated image, answer with digits.

Step 1 (docs/architecture.md): a built-in task whose prompts show images.

Each prompt is one image drawn on the fly (coloured squares and discs on black, each in a 16 x 16 pixel cell of its
own: 2 x 2 placeholder tokens of a Qwen-VL tower that merges 2 x 2 patches of 4 x 4 pixels) and the question "How
many shapes?". The reward is arithmetic's: 1 for exactly the count's digits, format credit otherwise, so a
random-init policy first learns to answer with a digit and stop, then the most common count (a reward of 0.47 with
1-3 shapes), then to read the count off the image (configs/shapes.yaml: 0.975 after 600 steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image, ImageDraw

from treerl.rollout.tasks.arithmetic import reward
from treerl.rollout.tasks.base import Prompt
from treerl.rollout.tasks.heldout import EVAL_FRACTION, Generated, ItemSplit

CELL = 16  # pixels a side of the cell each shape is drawn in
COLOURS = ((230, 40, 40), (40, 200, 60), (50, 90, 240), (240, 220, 40), (240, 240, 240))
QUESTION = "How many shapes?"
IMAGE_SIZE = 32  # pixels a side of the task's image
MAX_SHAPES = (IMAGE_SIZE // CELL) ** 2  # one shape a cell at most (rollout.max_shapes)


@dataclass
class Shapes(Generated):
    """An image of 1..max_shapes shapes; the reply is their count. Evaluation shows held-out pictures."""

    max_shapes: int = 3
    image_size: int = IMAGE_SIZE  # pixels a side; (image_size / 16)^2 cells, each with at most one shape
    seed: int = 0
    name: str = "shapes"
    eval_fraction: float = EVAL_FRACTION  # share of the pictures (layouts) held out for evaluation
    reward_fn = staticmethod(reward)
    what = "pictures"

    def __post_init__(self) -> None:
        if self.image_size < CELL or self.image_size % CELL:
            raise ValueError(f"shapes: image_size must be a multiple of {CELL}, got {self.image_size}")
        if not 1 <= self.max_shapes <= (self.image_size // CELL) ** 2:
            raise ValueError(f"shapes: max_shapes must be in [1, {(self.image_size // CELL) ** 2}] (one shape a "
                             f"{CELL}x{CELL} cell of a {self.image_size}-pixel image), got {self.max_shapes}")

    @property
    def max_new_tokens(self) -> int:
        """The count's digits, its stop token, and one spare."""
        return len(str(self.max_shapes)) + 2

    @property
    def split(self) -> ItemSplit:
        """The pictures, by layout (a seeded hash of each: its shapes in cell order)."""
        return ItemSplit(self.name, self.seed, self.eval_fraction)

    def item(self, rng) -> tuple[str, Prompt]:
        """One picture: its layout drawn from `rng`, then drawn."""
        shapes = rng.randint(1, self.max_shapes)
        layout = self.layout(rng, shapes)
        content = [{"type": "image", "image": self.draw(layout)}, {"type": "text", "text": QUESTION}]
        return repr(sorted(layout)), Prompt("", [{"role": "user", "content": content}], answer=shapes)  # a picture,
        # whichever order its shapes were drawn in

    def layout(self, rng, shapes: int) -> tuple[tuple[int, tuple[int, int, int], bool], ...]:
        """`shapes` shapes, each (a random free cell, a random colour, square or not)."""
        side = self.image_size // CELL
        return tuple((cell, rng.choice(COLOURS), rng.random() < 0.5) for cell in rng.sample(range(side * side), shapes))

    def draw(self, layout: tuple[tuple[int, tuple[int, int, int], bool], ...]) -> Image.Image:
        """The picture of a layout: each shape in its 16 x 16 cell."""
        image = Image.new("RGB", (self.image_size, self.image_size))
        pen = ImageDraw.Draw(image)
        side = self.image_size // CELL
        for cell, colour, square in layout:
            x, y = CELL * (cell % side), CELL * (cell // side)
            box = (x + 1, y + 1, x + CELL - 2, y + CELL - 2)
            (pen.rectangle if square else pen.ellipse)(box, fill=colour)
        return image

"""A user's prompts (+ optional reference answers) from local files, scored by the user's reward function.

Step 1 (docs/architecture.md): your prompts and your reward.

Accepted data (local only; nothing is downloaded):
- a `.jsonl` file, one JSON object per line;
- a directory written by `datasets.Dataset.save_to_disk` (its "train" split if it is a DatasetDict);
- a `.parquet`, `.csv` or `.json` file, read with `datasets.load_dataset`.

Each row's `prompt_key` holds the prompt: a string (sent as one user message) or a list of chat messages
`{"role": ..., "content": ...}` (roles: system, user, assistant, tool); rollout.system_prompt comes first in either
(a row whose messages have a system message of their own is refused with it: which would win is not treerl's to
guess). `answer_key`, if the row has it, is passed to the reward function as `answer`.

Images (a vision-language model): a message's content may be a list of parts, `{"type": "text", "text": ...}` and
`{"type": "image", "image": ...}` (or OpenAI's `image_url`); or the row's `image_key` field holds an image or a list
of them (a local path, bytes, a datasets `Image` value, a data URL), shown in the last user message: at its `<image>`
markers in order, as verl's multimodal data writes them, else before its text. Every image is read once when the
data is loaded, so a missing or unreadable one fails before training starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treerl.errors import DataError, UserError
from treerl.rollout.conversations.chat import Message
from treerl.rollout.conversations.images import IMAGE_PARTS, image_parts, load_image, part_image
from treerl.rollout.conversations.tokenizer import ROLES
from treerl.rollout.rewards.functions import RewardFn, check_reward_fn
from treerl.rollout.tasks.base import Prompt, rng_for
from treerl.rollout.tasks.heldout import EVAL_FRACTION, HeldOut, content_key, split_rows
from treerl.tree.io import MAX_LINE_BYTES, json_lines

DATASETS_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json"}
MARKER = "<image>"  # where a row's image goes in its prompt's text (verl's multimodal data)


def read_rows(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES,
              limit_option: str = "rollout.max_line_bytes") -> list[dict[str, Any]]:
    """The rows of a local JSONL file (streamed, each line at most `max_line_bytes`) or `datasets` dataset, as dicts."""
    return [row for _, row in located_rows(path, max_line_bytes, limit_option)]


def located_rows(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES,
                 limit_option: str = "rollout.max_line_bytes") -> list[tuple[str, dict[str, Any]]]:
    """`read_rows` with where each row is, for messages: "file.jsonl:LINE", or "file row INDEX" (0-based)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data path {str(path)!r} does not exist (treerl only reads local data)")
    if path.suffix == ".jsonl":
        return [(f"{path}:{line}", row) for line, row in json_lines(path, max_line_bytes, limit_option)]
    if not path.is_dir() and path.suffix not in DATASETS_FORMATS:
        raise DataError(f"{path}: unknown data format; use .jsonl, .json, .parquet, .csv or a save_to_disk directory")
    import datasets

    try:
        if path.is_dir():
            data = datasets.load_from_disk(str(path))
        else:
            data = datasets.load_dataset(DATASETS_FORMATS[path.suffix], data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001 (datasets and its readers (pyarrow, pandas) raise many types)
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"{path}: cannot read it as a dataset ({type(e).__name__}: {text})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(data)})")
        data = data["train"]
    return [(f"{path} row {i}", dict(row)) for i, row in enumerate(data)]


def row_messages(row: dict[str, Any], where: str, prompt_key: str, system_prompt: str | None,
                 image_key: str | None = None, vision: bool = True) -> list[Message]:
    """The chat messages of one row's prompt (with its images, if it shows any), checked; `vision`: whether the
    model reads images (a row that shows one to a text model fails here, not at its first rollout)."""
    if prompt_key not in row:
        raise DataError(f"{where}: no field {prompt_key!r} (fields: {', '.join(row)})")
    value = row[prompt_key]
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and is_content(m.get("content")) for m in value
    ):
        check_roles(value, where, prompt_key)
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        if system_prompt and any(m["role"] == "system" for m in messages):
            raise DataError(f"{where}: field {prompt_key!r} has a system message of its own and rollout.system_prompt "
                            "is set: remove one of the two (treerl does not pick which wins)")
    else:
        raise DataError(f"{where}: field {prompt_key!r} must be a string or a list of {{'role', 'content'}} messages "
                        "(content: a string, or a list of text and image parts)")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages
    return shown_images(messages, row, where, image_key, vision)


def shown_images(messages: list[Message], row: dict[str, Any], where: str, image_key: str | None,
                 vision: bool) -> list[Message]:
    """`messages` with the row's `image_key` images placed, and every image the prompt shows read now (decoded and
    its size checked): a bad one, or one shown to a text model, fails before training, not at its first rollout."""
    images = row.get(image_key) if image_key else None
    if images is not None:
        messages = with_images(messages, images if isinstance(images, list) else [images], where, image_key)
    elif image_key and not image_parts(messages) and (markers := sum(t.count(MARKER) for t in texts(messages))):
        raise DataError(f"{where}: the prompt has {markers} {MARKER} marker(s) but no image: the row's field "
                        f"{image_key!r} holds none (rollout.image_key; null trains the marker as text)")
    if image_parts(messages) and not vision:
        raise DataError(f"{where}: the prompt shows an image, but the model is not a vision-language model whose "
                        "images treerl feeds (treerl.engine.images.VISION_LANGUAGE)")
    for k, part in enumerate(image_parts(messages)):
        try:
            load_image(part_image(part), f"{where}: image {k}")
        except UserError as e:
            raise DataError(str(e)) from None
    return messages


def is_content(content: Any) -> bool:
    """A message's content: a string, or a list of text and image parts."""
    return isinstance(content, str) or isinstance(content, list) and all(
        isinstance(p, dict) and (p.get("type") == "text" and isinstance(p.get("text"), str) or p.get("type") in IMAGE_PARTS)
        for p in content)


def with_images(messages: list[Message], images: list[Any], where: str, image_key: str) -> list[Message]:
    """`messages` with the row's images shown in its last user message: at its `<image>` markers, else before its text."""
    users = [k for k, m in enumerate(messages) if m["role"] == "user"]
    if not users or not isinstance(messages[users[-1]]["content"], str):
        raise DataError(f"{where}: field {image_key!r} holds images, but the prompt has no user message of plain "
                        "text to show them in")
    text = messages[users[-1]]["content"]
    pieces = text.split(MARKER)
    if len(pieces) == 1:  # no marker: every image before the text
        pieces = [""] * len(images) + [text]
    if len(pieces) - 1 != len(images):
        raise DataError(f"{where}: the prompt has {len(pieces) - 1} <image> markers but field {image_key!r} holds "
                        f"{len(images)} images")
    content: list[dict[str, Any]] = []
    for k, piece in enumerate(pieces):
        if k:
            content.append({"type": "image", "image": images[k - 1]})
        if piece:
            content.append({"type": "text", "text": piece})
    return [*messages[: users[-1]], {"role": "user", "content": content}, *messages[users[-1] + 1 :]]


def texts(messages: list[Message]) -> list[str]:
    """The text of every message: its string content, or its text parts."""
    out: list[str] = []
    for message in messages:
        content = message["content"]
        out += [content] if isinstance(content, str) else [p["text"] for p in content if p.get("type") == "text"]
    return out


def check_roles(messages: list[dict[str, Any]], where: str, prompt_key: str) -> None:
    """Every message's role is one a chat template renders: an unknown one ('robot') would be sent as it is."""
    for k, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise DataError(f"{where}: field {prompt_key!r} message {k} has role {message['role']!r}; a role is one "
                            f"of {', '.join(ROLES)}")


@dataclass
class DatasetTask:
    """Single-turn task over a user's rows, in a seeded shuffled order, epoch after epoch; evaluation asks its held-out
    rows (`held_out_data`), which training never does."""

    prompts_data: list[tuple[list[Message], Any]]  # (messages, answer) per training row
    reward_fn: RewardFn
    max_new_tokens: int = 256
    seed: int = 0
    shuffle: bool = True
    name: str = "dataset"
    held_out_data: list[tuple[list[Message], Any]] = field(default_factory=list)  # evaluation's rows; none: it asks
    # training's (nothing was held out)
    held_out: HeldOut = field(default_factory=lambda: HeldOut(False, "rows training also asks (not held out)"))
    _orders: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def load(
        cls, path: str | Path, reward_fn: RewardFn, prompt_key: str = "prompt", answer_key: str = "answer",
        system_prompt: str | None = None, max_line_bytes: int = MAX_LINE_BYTES, image_key: str | None = "image",
        vision: bool = True, eval_path: str | Path | None = None, eval_fraction: float = EVAL_FRACTION,
        **kwargs: Any,
    ) -> DatasetTask:
        """Read and check every row up front, so a bad row fails before training starts (`vision`: whether the model
        reads images); hold out `eval_path`'s rows, or a seeded `eval_fraction` of the distinct prompts."""
        check_reward_fn(reward_fn, getattr(reward_fn, "__name__", "reward_fn"))

        def rows_of(source: str | Path) -> list[tuple[list[Message], Any]]:
            rows = located_rows(source, max_line_bytes)
            if not rows:
                raise DataError(f"{source}: no rows")
            return [(row_messages(row, where, prompt_key, system_prompt, image_key, vision), row.get(answer_key))
                    for where, row in rows]

        data = rows_of(path)
        if eval_path is None:
            return cls.split(data, reward_fn, eval_fraction, **kwargs)
        return cls.with_eval_rows(data, rows_of(eval_path), str(eval_path), reward_fn, **kwargs)

    @classmethod
    def split(cls, data: list[tuple[list[Message], Any]], reward_fn: RewardFn, eval_fraction: float = EVAL_FRACTION,
              by_answer: bool = False, **kwargs: Any) -> DatasetTask:
        """The rows with a seeded `eval_fraction` of their distinct prompts held out for evaluation (`by_answer`: rows
        are the same when their answers are, as an agent's tasks, whose answer is the whole row)."""
        name, seed = kwargs.get("name", "dataset"), kwargs.get("seed", 0)
        keys = [content_key(answer if by_answer else messages) for messages, answer in data]
        train, held = split_rows(keys, eval_fraction, seed, name)
        distinct = len(set(keys))
        if held:
            shown = len({keys[i] for i in held})
            note = HeldOut(True, f"{shown} of the {distinct} distinct prompts ({len(held)} of {len(data)} rows), never "
                                 f"trained on (rollout.eval_fraction={eval_fraction:g})", shown, distinct)
        else:
            why = "rollout.eval_fraction=0" if eval_fraction == 0 else "the data has a single distinct prompt"
            note = HeldOut(False, f"rows training also asks (not held out: {why})", 0, distinct)
        return cls([data[i] for i in train], reward_fn, held_out_data=[data[i] for i in held], held_out=note,
                   **kwargs)

    @classmethod
    def with_eval_rows(cls, data: list[tuple[list[Message], Any]], rows: list[tuple[list[Message], Any]],
                       source: str, reward_fn: RewardFn, by_answer: bool = False, **kwargs: Any) -> DatasetTask:
        """Every row trained on; evaluation asks `rows` (rollout.eval_data_path), less those whose prompt training
        also has (`by_answer`: as `split`)."""
        trained = {content_key(answer if by_answer else messages) for messages, answer in data}
        held = [row for row in rows if content_key(row[1] if by_answer else row[0]) not in trained]
        if not held:
            raise DataError(f"rollout.eval_data_path={source!r}: every one of its {len(rows)} rows asks a prompt that "
                            "rollout.data_path also has: nothing is held out")
        skipped = f"; {len(rows) - len(held)} of its rows left out: training has their prompt" if len(held) < len(rows) else ""
        note = HeldOut(True, f"the {len(held)} rows of {source} (rollout.eval_data_path){skipped}", len(held),
                       len(held))
        return cls(data, reward_fn, held_out_data=held, held_out=note, **kwargs)

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """Rows step*count ... step*count + count - 1 of the endless shuffled stream (stateless: exact resume)."""
        out = []
        for i in range(count):
            index = step * count + i
            epoch, position = divmod(index, len(self.prompts_data))
            row = self._order(epoch)[position]
            messages, answer = self.prompts_data[row]
            out.append(Prompt(f"s{step}/p{i}/row{row}", messages, answer))
        return out

    def held_out_prompts(self, count: int) -> list[Prompt]:
        """The evaluation set: `count` prompts of the held-out rows in a fixed seeded order, again from the first when
        there are fewer rows (training's rows when none is held out)."""
        rows = self.held_out_data or self.prompts_data
        order = list(range(len(rows)))
        rng_for("held_out", self.name, self.seed).shuffle(order)
        return [Prompt(f"eval/p{i}/row{order[i % len(rows)]}", *rows[order[i % len(rows)]]) for i in range(count)]

    def _order(self, epoch: int) -> list[int]:
        """The row order of one epoch (cached: a step reads one or two epochs)."""
        if epoch not in self._orders:
            order = list(range(len(self.prompts_data)))
            if self.shuffle:
                rng_for("dataset", self.seed, epoch).shuffle(order)
            self._orders = {epoch: order, **{e: o for e, o in self._orders.items() if e == epoch - 1}}
        return self._orders[epoch]


class FromRows:
    """What tasks whose items are the rows of a DatasetTask (`rows`: TRL rows, verifiers tasks) share: its training
    stream of rows, its held-out rows and what it says of them."""

    rows: DatasetTask

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """Rows step*count ... of the seeded endless stream of training rows; each answer is its row."""
        return self.rows.prompts(step, count)

    def held_out_prompts(self, count: int) -> list[Prompt]:
        """The evaluation set: the held-out rows (rollout.eval_fraction of them), which training never asks."""
        return self.rows.held_out_prompts(count)

    @property
    def held_out(self) -> HeldOut:
        return self.rows.held_out


def agent_rows(path: str | Path) -> list[tuple[list[Message], Any]]:
    """The tasks of an agent (`rollout.task=agent`): every row, a JSON object, is passed whole to the episode.

    A row's `prompt` (a string) or `messages` (chat messages), if it has one, is only shown in reports
    of dropped episodes; the agent decides what to send to the model.
    """
    rows = read_rows(path)
    if not rows:
        raise DataError(f"{path}: no rows")
    data = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {i}: an agent task must be a JSON object, got {type(row).__name__}")
        shown = row.get("prompt") if isinstance(row.get("prompt"), str) else json.dumps(row, default=str)[:500]
        data.append(([{"role": "user", "content": shown}], row))
    return data


def load_agent_tasks(path: str | Path, seed: int = 0, shuffle: bool = True, max_new_tokens: int = 512,
                     eval_fraction: float = EVAL_FRACTION, eval_path: str | Path | None = None) -> DatasetTask:
    """The tasks of an agent (`rollout.task=agent`), a seeded `eval_fraction` of them (or `eval_path`'s) held out."""
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "seed": seed, "shuffle": shuffle, "name": "agent"}
    if eval_path is None:
        return DatasetTask.split(agent_rows(path), None, eval_fraction, by_answer=True, **kwargs)  # type: ignore[arg-type]
    return DatasetTask.with_eval_rows(agent_rows(path), agent_rows(eval_path), str(eval_path), None, by_answer=True,  # type: ignore[arg-type]
                                      **kwargs)

"""reasoning-gym's procedural datasets as single-turn tasks: its questions, scored by the dataset's own scorer.

Step 1 (docs/architecture.md): prompts and rewards from `rollout.env=reasoning_gym:<name>`.

    rollout.env=reasoning_gym:leg_counting rollout.env_args={min_animals: 1, max_animals: 2}

`create_dataset(name, size=, seed=, **env_args)` builds the dataset (`size` defaults to reasoning-gym's 500, `seed`
to rollout.seed); prompt n of the run (step x prompts_per_step + i) is item n mod size, shown as reasoning-gym's
training scripts show it: its system prompt (`rollout.system_prompt`: text, or the name of one of reasoning-gym's
SYSTEM_PROMPTS; default "default", which asks for the answer in <answer></answer> tags) and the item's question.
The reward is `dataset.score_answer(extract_answer(reply), entry)`: the answer between the reply's last answer tags,
scored by the dataset itself (None when the reply has no tags). Logged per environment: `answered` (the reply had
answer tags) and, for `composite` (env_args {datasets: [{name, weight, config}], size, seed}), `reward/<dataset>`
for each of its datasets. An unknown name lists reasoning-gym's datasets; an env_args key its config does not have
is refused with the keys it has, before any sampling.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treerl.errors import UserError
from treerl.rollout.environments.extras import import_library
from treerl.rollout.rewards.functions import Scored
from treerl.rollout.tasks.base import Prompt
from treerl.rollout.tasks.heldout import HeldOut

if TYPE_CHECKING:
    from treerl.rollout.config import RolloutConfig

HELD_OUT_CANDIDATES = 4  # items drawn per evaluation prompt, at most, to find held-out ones no training item matches
MAX_NEW_TOKENS = 256  # reply budget unless rollout.max_new_tokens says otherwise: room for a short reasoning
DEFAULT_PROMPT = "default"  # reasoning-gym's own system prompt that asks for <answer> tags


@dataclass
class ReasoningGymTask:
    """One reasoning-gym dataset: its items as prompts, its scorer as the reward."""

    dataset: Any  # a reasoning_gym ProceduralDataset
    system_prompt: str | None
    extract_answer: Any  # reasoning_gym.utils.extract_answer
    name: str = "reasoning_gym"
    max_new_tokens: int = MAX_NEW_TOKENS
    held_out_dataset: Any = None  # (seed, size) -> the dataset of the same config with that seed and size; None:
    # nothing is held out (rollout.eval_fraction=0): evaluation asks the first training items
    _held_out: dict[int, list[Prompt]] = field(default_factory=dict, init=False, repr=False)
    _skipped: int = field(default=0, init=False, repr=False)

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """Items step*count ... step*count + count - 1 (mod the dataset's size): the same for the same step."""
        return [self.prompt(f"s{step}/p{i}", (step * count + i) % self.dataset.size, self.dataset)
                for i in range(count)]

    def prompt(self, prompt_id: str, index: int, dataset: Any) -> Prompt:
        """Item `index` of `dataset` as a prompt: the system prompt, then the item's question."""
        entry = dataset[index]
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return Prompt(f"{prompt_id}/item{index}", [*system, {"role": "user", "content": entry["question"]}], answer=entry)

    def held_out_prompts(self, count: int) -> list[Prompt]:
        """The evaluation set: the first `count` items of the same config drawn with seed + size (the seeds after
        training's, as the library seeds item i with seed + i) whose question no training item asks."""
        if self.held_out_dataset is None:
            return [self.prompt(f"eval/p{i}", i % self.dataset.size, self.dataset) for i in range(count)]
        if count not in self._held_out:
            trained = {self.dataset[i]["question"] for i in range(self.dataset.size)}
            candidates = self.held_out_dataset(self.dataset.seed + self.dataset.size, HELD_OUT_CANDIDATES * count + 64)
            out: list[Prompt] = []
            skipped = 0
            for index in range(candidates.size):
                if len(out) == count:
                    break
                if candidates[index]["question"] in trained:
                    skipped += 1
                    continue
                out.append(self.prompt(f"eval/p{len(out)}", index, candidates))
            if len(out) < count:
                raise UserError(f"rollout.env={self.name!r}: only {len(out)} of {candidates.size} held-out items ask a "
                                f"question none of the {self.dataset.size} training items asks; its item space is too "
                                f"small for trainer.eval_prompts={count}: lower it, or the dataset's size (env_args.size)")
            self._skipped = skipped
            self._held_out[count] = out
        return self._held_out[count]

    @property
    def held_out(self) -> HeldOut:
        if self.held_out_dataset is None:
            return HeldOut(False, "the first training items (not held out: rollout.eval_fraction=0)")
        skipped = f"; {self._skipped} skipped: a training item asks their question" if self._skipped else ""
        return HeldOut(True, f"items of seeds {self.dataset.seed + self.dataset.size} on (training's: "
                             f"{self.dataset.seed} to {self.dataset.seed + self.dataset.size - 1}){skipped}")

    def reward_fn(self, prompt: str, completion: str, answer: dict[str, Any]) -> Scored:
        """The dataset's own score of the answer the reply gives between answer tags."""
        given = self.extract_answer(completion)
        score = self.dataset.score_answer(given, answer)
        metrics = {"answered": float(given is not None)}
        source = answer.get("metadata", {}).get("source_dataset")
        if getattr(self.dataset, "datasets", None) and source is not None:  # a composite: each dataset's own reward
            metrics[f"reward/{source}"] = score
        return Scored(score, metrics)


def build(target: str, env_args: dict[str, Any], config: RolloutConfig) -> ReasoningGymTask:
    """The task of `reasoning_gym:<target>` with `env_args` for its dataset config (checked before anything runs)."""
    spec = f"reasoning_gym:{target}"
    rg = import_library("reasoning_gym", "reasoning-gym", spec)
    utils = import_library("reasoning_gym.utils", "reasoning-gym", spec)
    args = {"seed": config.seed, **env_args}
    check_args(rg.factory.DATASETS, target, args, spec)
    if target == "composite":
        args["datasets"] = [rg.composite.DatasetSpec(name=d["name"], weight=d.get("weight", 1.0),
                                                     config=d.get("config") or {}) for d in args["datasets"]]
    try:
        dataset = rg.create_dataset(target, **args)
    except Exception as e:  # noqa: BLE001 (a config's validate() raises AssertionError, ValueError, ...)
        message = " ".join(str(e).split()) or type(e).__name__
        raise UserError(f"rollout.env={spec!r}: reasoning-gym refused env_args {env_args}: {message}") from None

    def held_out_dataset(seed: int, size: int) -> Any:
        return rg.create_dataset(target, **{**args, "seed": seed, "size": size})

    return ReasoningGymTask(dataset, system_prompt(utils.SYSTEM_PROMPTS, config.system_prompt),
                            utils.extract_answer, name=spec,
                            held_out_dataset=held_out_dataset if config.eval_fraction > 0 else None)


def system_prompt(prompts: dict[str, str], chosen: str | None) -> str | None:
    """rollout.system_prompt: the name of one of reasoning-gym's SYSTEM_PROMPTS, or text of its own (unset: the
    "default" one, which asks for answer tags; an empty string: none)."""
    chosen = DEFAULT_PROMPT if chosen is None else chosen
    return prompts.get(chosen, chosen) or None


def check_args(registry: dict[str, tuple[type, type]], target: str, args: dict[str, Any], spec: str) -> None:
    """An unknown dataset or a key its config has not: one line naming what exists (a composite's datasets too)."""
    if target not in registry:
        close = difflib.get_close_matches(target, registry, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UserError(f"rollout.env={spec!r}: reasoning-gym has no dataset {target!r}; {hint}its datasets: "
                        f"{', '.join(sorted(registry))}")
    keys = [f.name for f in dataclasses.fields(registry[target][1])]
    if unknown := sorted(set(args) - set(keys)):
        raise UserError(f"rollout.env_args: {unknown[0]!r} is not an option of reasoning-gym's {target} (its "
                        f"options: {', '.join(keys)})")
    if target != "composite":
        return
    datasets = args.get("datasets")
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) and "name" in d for d in datasets):
        raise UserError("rollout.env_args.datasets: reasoning-gym's composite needs a list of {name, weight, config} "
                        "entries, e.g. [{name: leg_counting, weight: 1, config: {max_animals: 3}}]")
    for d in datasets:
        if unknown := sorted(set(d) - {"name", "weight", "config"}):
            raise UserError(f"rollout.env_args.datasets: entry {d['name']!r} has key {unknown[0]!r}; an entry has "
                            "name, weight, config")
        check_args(registry, d["name"], d.get("config") or {}, f"reasoning_gym:{d['name']}")

"""TRL's GRPOTrainer on a workload `treerl bench --against trl` wrote: run by the TRL venv's Python, not imported.

Beside the steps (docs/architecture.md): the other trainer of the head-to-head, steps 1-6 as TRL 1.16 does them.

TRL lives in a venv of its own (tools/trl-venv.sh); this script is that venv's side of `treerl/bench/against_trl.py`.
It imports nothing of treerl (treerl is not installed there) and talks JSON lines:

    argv[1]  the workload (a JSON file): model directory, rows (prompt messages and reset kwargs, in training order),
             matched settings, the learning rate of each step, the environment file and class (multi-turn) or none
    stdout   {"error": "one line"}  (before any training: the model, the environment or a setting TRL refuses)
             {"ready": true, "trl": version, "transformers": version, "settings": {GRPOConfig fields that matter}}
             {"score": [[prompt text, completion text, row index], ...]}: a single-turn step's completions, to be
              scored by treerl's own reward function (one function for both trainers); stdin answers {"rewards": [..]}
             {"step": k, "seconds": wall, "cpu_seconds": ..., "generate": s, "reward": s, "logprobs": s,
              "update": s, "optimizer": s, "reward_mean": r, "trained_tokens": n, "computed_tokens": n}
             {"done": true}
The time split is measured here around TRL's own methods (`_generate`, `_calculate_rewards`, the no-grad
`_get_per_token_logps_and_entropies` passes, `training_step`): TRL's own profiling reports only to W&B and MLflow.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Any

OUT = sys.stdout  # the protocol's channel; anything else printed goes to stderr
sys.stdout = sys.stderr
# Run as a script, this file's folder is first on the path, and its neighbours would shadow the standard library's
# modules of the same name (treerl/bench/profile.py for `profile`, which torch imports): it goes.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def emit(message: dict[str, Any]) -> None:
    """One protocol line to treerl."""
    OUT.write(json.dumps(message) + "\n")
    OUT.flush()


def fail(what: str, error: BaseException) -> None:
    """The one line treerl shows, then exit 2: nothing has trained."""
    text = " ".join(str(error).split())[:600]
    emit({"error": f"{what}: {type(error).__name__}: {text}"})
    sys.exit(2)


def cpu_seconds() -> float:
    """This process's user + system CPU time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load_environment(spec: dict[str, Any]) -> type:
    """The environment class from its file (a module of treerl that imports nothing), as TRL's factory."""
    import importlib.util

    module_spec = importlib.util.spec_from_file_location(spec["module"], spec["file"])
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[spec["module"]] = module
    module_spec.loader.exec_module(module)
    return getattr(module, spec["class"])


def bench_reward(prompts: list, completions: list, row: list[int], **_: Any) -> list[float]:
    """TRL's reward function: the completions sent to treerl, which scores them with the task's own function."""
    def text(value: Any) -> str:
        return value if isinstance(value, str) else value[-1]["content"]

    emit({"score": [[text(p), text(c), r] for p, c, r in zip(prompts, completions, row)]})
    answer = json.loads(sys.stdin.readline())
    return [float(r) for r in answer["rewards"]]


def grpo_config(work: dict[str, Any], output_dir: str) -> Any:
    """GRPOConfig with every setting the head-to-head matches (docs/benchmarks.md, "Against TRL")."""
    from trl import GRPOConfig

    s = work["settings"]
    batch = s["prompts_per_step"] * s["group_size"]
    micro = s["micro_batch"]
    return GRPOConfig(
        output_dir=output_dir, use_cpu=True, seed=s["seed"], data_seed=s["seed"], max_steps=s["steps"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,  # one optimizer step a batch
        num_generations=s["group_size"], max_completion_length=s["max_completion_length"],
        temperature=s["temperature"], top_p=1.0, top_k=0, learning_rate=s["lr"], weight_decay=s["weight_decay"],
        adam_beta1=s["betas"][0], adam_beta2=s["betas"][1], adam_epsilon=s["adam_eps"],
        max_grad_norm=s["max_grad_norm"], beta=0.0, entropy_coef=s["entropy_coef"], num_iterations=1, epsilon=s["clip_eps"],
        epsilon_high=s["clip_eps_high"],
        loss_type=s["loss_type"], scale_rewards="group", mask_truncated_completions=False,
        gradient_checkpointing=s["gradient_checkpointing"], bf16=False, fp16=False,
        shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, max_tool_calling_iterations=s.get("max_tool_calling_iterations"),
        generation_kwargs=s.get("generation_kwargs"),
    )


def build_trainer(work: dict[str, Any], timers: dict[str, float], shapes: dict[str, int]) -> Any:
    """The GRPOTrainer, its methods timed; the model and every setting checked before the first step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose generation, reward, no-grad log-prob and update times add up per step."""

        def _timed(self, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[key] += time.perf_counter() - started

        def _generate(self, prompts: list) -> Any:
            return self._timed("generate", super()._generate, prompts)

        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("reward", super()._calculate_rewards, *args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():  # the update's own forward: counted in update
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            return self._timed("logprobs", super()._get_per_token_logps_and_entropies, *args, **kwargs)

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            batch = self._timed("rollout", super()._generate_and_score_completions, inputs)
            mask = batch["completion_mask"] * batch.get("tool_mask", 1)
            shapes["trained_tokens"] += int(mask.sum())
            shapes["computed_tokens"] += batch["prompt_ids"].numel() + batch["completion_ids"].numel()
            return batch

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("training_step", super().training_step, *args, **kwargs)

    s = work["settings"]
    try:
        model = AutoModelForCausalLM.from_pretrained(work["model"], dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(work["model"])
    except Exception as e:  # noqa: BLE001 (one line: TRL cannot load what it was given)
        fail(f"the model {work['model']}", e)
    rows = work["rows"]
    dataset = Dataset.from_list([{**row, "row": i} for i, row in enumerate(rows)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=tuple(s["betas"]), eps=s["adam_eps"],
                                  weight_decay=s["weight_decay"])
    lrs = [lr / s["lr"] for lr in work["lr_by_step"]]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lrs[min(k, len(lrs) - 1)])  # treerl's, per step
    env = work.get("environment")
    try:
        factory = load_environment(env) if env else None
        return TimedGRPOTrainer(
            model=model, processing_class=tokenizer, args=grpo_config(work, work["output_dir"]),
            reward_funcs=[] if env else [bench_reward], train_dataset=dataset, optimizers=(optimizer, schedule),
            environment_factory=factory)
    except Exception as e:  # noqa: BLE001 (one line: a setting TRL refuses, before any step)
        fail("GRPOTrainer", e)


def main() -> None:
    """Build, say ready, train; one line per optimizer step."""
    with open(sys.argv[1]) as f:
        work = json.load(f)
    try:
        import torch
        import transformers
        import trl
        from transformers import TrainerCallback
    except ImportError as e:
        fail("TRL's venv", e)
    torch.set_num_threads(work["settings"]["threads"])
    timers = dict.fromkeys(("generate", "reward", "logprobs", "rollout", "training_step"), 0.0)
    shapes = {"trained_tokens": 0, "computed_tokens": 0}
    trainer = build_trainer(work, timers, shapes)
    args = trainer.args
    emit({"ready": True, "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
          "threads": torch.get_num_threads(),
          "settings": {k: getattr(args, k) for k in (
              "loss_type", "beta", "epsilon", "epsilon_high", "scale_rewards", "num_generations",
              "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
              "max_completion_length", "temperature", "top_p", "top_k", "gradient_checkpointing", "bf16",
              "num_iterations", "max_grad_norm", "max_tool_calling_iterations", "entropy_coef",
              "generation_kwargs")}})

    class StepLog(TrainerCallback):
        """At each optimizer step's end: its times, reward and tokens, and the counters start again."""

        def __init__(self) -> None:
            self.row: dict[str, Any] | None = None
            self.mark()

        def mark(self) -> None:
            self.wall, self.cpu = time.perf_counter(), cpu_seconds()

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.mark()

        def on_step_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            seconds = time.perf_counter() - self.wall
            rollout = timers["rollout"]
            self.row = {"step": state.global_step - 1, "seconds": seconds, "cpu_seconds": cpu_seconds() - self.cpu,
                        "generate": timers["generate"], "reward": timers["reward"], "logprobs": timers["logprobs"],
                        "rollout_other": rollout - timers["generate"] - timers["reward"] - timers["logprobs"],
                        "update": timers["training_step"] - rollout,
                        "optimizer": seconds - timers["training_step"], **shapes}
            for key in timers:
                timers[key] = 0.0
            for key in shapes:
                shapes[key] = 0

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None,
                   **__: Any) -> None:
            if self.row is not None and logs and "reward" in logs:
                reward = logs["reward"]
                emit({**self.row, "reward_mean": reward if math.isfinite(reward) else None})
                self.row = None
                self.mark()  # logging is TRL's, between steps: the next step is timed from here

    trainer.add_callback(StepLog())
    trainer.train()
    emit({"done": True})


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()

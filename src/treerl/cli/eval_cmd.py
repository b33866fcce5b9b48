"""`treerl eval`: a model's held-out evaluation (mean reward, mean@n, pass@k), alone or against another model.

Beside the steps (docs/architecture.md): the command that evaluates a model without training it.
"""

from __future__ import annotations

import logging

import typer

from treerl.trainer.core.config import packaged_configs

EVAL_ARGS_HELP = ("CONFIG, then key=value overrides: CONFIG is a run's output_dir or checkpoint (its own config, and "
                  "its newest checkpoint as model.path), a YAML file or a packaged config "
                  f"({', '.join(sorted(packaged_configs()))}); e.g. runs/smollm2_reasoning, or smollm2 "
                  "model.path=runs/smollm2/checkpoints/step_000060 eval.samples=16 'eval.k=[1,4,16]'")


def evaluate(
    args: list[str] = typer.Argument(None, help=EVAL_ARGS_HELP, show_default=False),
    compare: str = typer.Option(None, "--compare", metavar="RUN_DIR_OR_MODEL", help="also evaluate this model (a "
                                "run's output_dir or checkpoint, a transformers directory, a GGUF file, a packaged "
                                "model) on the same prompts with the same seeds, and print the difference with its "
                                "standard error"),
    print_config: bool = typer.Option(False, "--print-config", help="print the resolved config and exit"),
) -> None:
    """Evaluate a model on the task's held-out items (trainer.eval_prompts prompts, eval.samples samples each): mean
    reward, mean@n and pass@k per environment and named metric; a table on stdout, eval.json and eval_samples.jsonl
    in trainer.output_dir."""
    from treerl.cli.train_cmd import _split
    from treerl.trainer.core.config import load_config, to_yaml
    from treerl.trainer.evaluation import config_of_run
    from treerl.trainer.evaluation import evaluate as run_evaluation

    path, overrides = _split(args)
    config = (config_of_run(path, overrides) if path is not None else None) or load_config(path, overrides)
    if print_config:
        typer.echo(to_yaml(config), nl=False)
        return
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run_evaluation(config, compare)

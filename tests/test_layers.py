"""The layer rule of docs/design.md: a module imports only from its own layer and the layers below it.

    tree < attention < engine < algo < distributed < rollout < trainer < bench < cli

Beside the layers: `errors` (imports nothing from treerl), `models` and `gguf_checkpoint` (import `errors` only;
any layer may use them) and `testing` (checks for users' losses: imports `engine`, `tree`, `errors`, `models`;
no module of the package imports it). Every import counts, also one inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "treerl"
LAYERS = ["tree", "attention", "engine", "algo", "distributed", "rollout", "trainer", "bench", "cli"]
ANYONE_MAY_IMPORT = {"errors", "models", "gguf_checkpoint"}
BESIDE = {"errors": set(), "models": {"errors"}, "gguf_checkpoint": {"errors"}, "testing": {"tree", "attention", "engine", "errors", "models"}}


def part_of(module: str) -> str:
    """`treerl.engine.dfs` -> `engine`; `treerl.models` -> `models`; `treerl` -> `` (the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every treerl import in `path`, relative ones resolved."""
    name = ".".join(("treerl", *path.relative_to(package).with_suffix("").parts))  # engine/__init__.py: one deeper
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: -node.level]
                out.append((node.lineno, ".".join([*base, node.module] if node.module else base)))
            else:
                out.append((node.lineno, node.module or ""))
    return [(line, module) for line, module in out if module == "treerl" or module.startswith("treerl.")]


def allowed(importer: str, imported: str) -> bool:
    """May a module of part `importer` import from part `imported`?"""
    if importer == imported:
        return True
    if importer in BESIDE:
        return imported in BESIDE[importer]
    if imported in ANYONE_MAY_IMPORT:
        return True
    return imported in LAYERS and LAYERS.index(imported) < LAYERS.index(importer)


def violations(package: Path = PACKAGE) -> list[str]:
    """Every import that points up a layer (or into `testing`), as `file:line imports module`."""
    out = []
    for path in sorted(package.rglob("*.py")):
        importer = path.relative_to(package).parts[0].removesuffix(".py")
        if importer == "__init__":
            continue  # the package's own __init__ re-exports
        assert importer in LAYERS or importer in BESIDE, f"{path}: {importer!r} is in no layer of docs/design.md"
        for line, module in imports(path, package):
            if not allowed(importer, part_of(module)):
                out.append(f"{path.relative_to(package.parent)}:{line} imports {module}")
    return out


def test_no_module_imports_from_a_higher_layer():
    assert violations() == []


def test_the_check_sees_an_upward_import(tmp_path):
    """The control: an engine module importing the trainer (even inside a function) is reported."""
    engine = tmp_path / "treerl" / "engine"
    engine.mkdir(parents=True)
    (engine / "bad.py").write_text("def f():\n    from treerl.trainer import train\n")
    (engine / "relative.py").write_text("from ..rollout import Rollout\nfrom .base import StepStats\n")
    found = violations(tmp_path / "treerl")
    assert found == ["treerl/engine/bad.py:2 imports treerl.trainer",
                     "treerl/engine/relative.py:1 imports treerl.rollout"], found


# Inside the trainer: `core` below `rl.learn`, which the three loops build on; no loop imports another.
TRAINER_PARTS = {"core": {"core"}, "rl.learn": {"core"}, "rl.sync": {"core", "rl.learn"},
                 "asynchronous": {"core", "rl.learn", "asynchronous"}, "sft": {"core", "sft"},
                 "evaluation": {"core"}}


def trainer_part(module: str) -> str | None:
    """`treerl.trainer.rl.sync` -> `rl.sync`; `treerl.trainer.core.run` -> `core`; the package itself -> None."""
    parts = module.split(".")[2:]
    if not parts or parts[0] == "__init__":
        return None
    return ".".join(parts[:2]) if parts[0] == "rl" else parts[0]


def trainer_violations(package: Path = PACKAGE) -> list[str]:
    """Every import inside the trainer that crosses its parts the wrong way, as `file:line imports module`."""
    out = []
    for path in sorted((package / "trainer").rglob("*.py")):
        name = ".".join(("treerl", *path.relative_to(package).with_suffix("").parts))
        importer = trainer_part(name)
        if importer is None or importer == "rl.__init__":
            continue
        for line, module in imports(path, package):
            imported = trainer_part(module) if module.startswith("treerl.trainer.") else None
            if imported is not None and imported not in TRAINER_PARTS[importer]:
                out.append(f"{path.relative_to(package.parent)}:{line} imports {module}")
    return out


def test_the_trainer_loops_import_only_what_they_share():
    assert sorted(trainer_part(f"treerl.trainer.{p}") for p in ("core.run", "rl.learn", "rl.sync", "sft.data")) == [
        "core", "rl.learn", "rl.sync", "sft"]
    assert trainer_violations() == []


def test_the_trainer_check_sees_a_loop_importing_another(tmp_path):
    """The control: the synchronous loop importing the asynchronous one (the old cycle) is reported."""
    rl = tmp_path / "treerl" / "trainer" / "rl"
    rl.mkdir(parents=True)
    (rl / "sync.py").write_text("def f():\n    from treerl.trainer.asynchronous.loop import train_async\n")
    (rl / "learn.py").write_text("from treerl.trainer.core.run import Run\n")
    assert trainer_violations(tmp_path / "treerl") == [
        "treerl/trainer/rl/sync.py:2 imports treerl.trainer.asynchronous.loop"]


def drawn_layers(text: str) -> list[str]:
    """The layer names of the first code block in `text`, top to bottom (the first word of each row)."""
    block = text.split("```\n", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line and not line[0].isspace()]


def test_the_docs_draw_the_layers_the_code_has():
    docs = PACKAGE.parents[1] / "docs"
    architecture = (docs / "architecture.md").read_text()
    design = (docs / "design.md").read_text().split("## Layers", 1)[1]
    assert drawn_layers(architecture) == LAYERS[::-1], drawn_layers(architecture)
    assert drawn_layers(design) == LAYERS[::-1], drawn_layers(design)


# Modules without the line, on purpose: the built-in agent is a user's file, shown unchanged in the README (it
# imports nothing from treerl and knows nothing of the training step).
NOT_PLACED = {"rollout/tasks/agent_tools_agent.py"}


def test_every_module_docstring_says_where_it_sits_in_a_training_step():
    """Each module's docstring points to its step of docs/architecture.md's picture ("Step 3 (docs/architecture.md):
    ...", or "Beside the steps ..."), so a reader opening any file knows where it is."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in NOT_PLACED:
            continue
        if "docs/architecture.md" not in (ast.get_docstring(ast.parse(path.read_text())) or ""):
            missing.append(name)
    assert not missing, f"no line placing them in docs/architecture.md's training step: {missing}"


# Inside rollout: its rooms, lowest first (docs/architecture.md draws them); a room imports only the rooms below it.
# `config.py` and `collect.py` (one step's rollout) sit above every room. Two imports reach up, by design: a room's
# builder names `RolloutConfig`, the section it is built from, and `tasks.build_task` loads `environments` (inside the
# function) when `rollout.env` names a library.
ROLLOUT_ROOMS = ["conversations", "rewards", "tasks", "sampling", "serving", "workflows", "agents", "environments"]
ROLLOUT_UP = {("tasks", "config"), ("environments", "config"), ("tasks", "environments")}


def rollout_room(module: str) -> str:
    """`treerl.rollout.sampling.client` -> `sampling`; `treerl.rollout.config` -> `config`; `treerl.rollout` -> ``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def rollout_violations(package: Path = PACKAGE) -> list[str]:
    """Every import of a room of rollout that reaches a room above its own (or the package), as `file:line imports module`."""
    out = []
    for path in sorted((package / "rollout").rglob("*.py")):
        importer = rollout_room(".".join(("treerl", *path.relative_to(package).with_suffix("").parts)))
        if importer not in ROLLOUT_ROOMS:
            continue
        for line, module in imports(path, package):
            imported = rollout_room(module)
            if not (module == "treerl.rollout" or module.startswith("treerl.rollout.")) or imported == importer:
                continue
            below = imported in ROLLOUT_ROOMS and ROLLOUT_ROOMS.index(imported) < ROLLOUT_ROOMS.index(importer)
            if not below and (importer, imported) not in ROLLOUT_UP:
                out.append(f"{path.relative_to(package.parent)}:{line} imports {module}")
    return out


def test_rollout_rooms_import_only_the_rooms_below_them():
    assert {p.name for p in (PACKAGE / "rollout").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        ROLLOUT_ROOMS)
    assert rollout_violations() == []


def test_the_rollout_check_sees_a_room_importing_one_above_it(tmp_path):
    """The control: the sampler importing the agent proxy, or the package's front door, is reported."""
    sampling = tmp_path / "treerl" / "rollout" / "sampling"
    sampling.mkdir(parents=True)
    (sampling / "client.py").write_text("def f():\n    from treerl.rollout.agents.proxy import ChatProxy\n"
                                        "from treerl.rollout.sampling.sampler import Completion\n"
                                        "from treerl.rollout.tasks.base import rng_for\n")
    (sampling / "embedded.py").write_text("from treerl.rollout import Rollout\n")
    assert rollout_violations(tmp_path / "treerl") == [
        "treerl/rollout/sampling/client.py:2 imports treerl.rollout.agents.proxy",
        "treerl/rollout/sampling/embedded.py:1 imports treerl.rollout"]

"""An environment library that is not installed: one line naming the pip extra that installs it; and what an
adapter says once at the start of a run (a bound of treerl's own that may cut episodes, branching turned off).

Step 1 (docs/architecture.md): the optional libraries environments come from.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from treerl.errors import UserError

log = logging.getLogger("treerl.rollout")
SAID: set[str] = set()  # the lines said in this process (a run builds its rollout more than once: training, evaluation)


def say_once(line: str) -> None:
    """Warn `line` in the run's log, once per process."""
    if line not in SAID:
        SAID.add(line)
        log.warning(line)


def import_library(module: str, extra: str, spec: str) -> ModuleType:
    """The library `module`, imported for the environment `spec`; a UserError naming the extra if it is missing."""
    install = (f"pip install 'treerl[{extra}]' (from a checkout: pip install -e '.[{extra}]'; the extra 'envs' "
               "installs every environment library)")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if e.name is not None and (e.name == top or e.name.startswith(f"{top}.")):
            raise UserError(f"rollout.env={spec!r} needs the {top} package: {install}") from None
        raise UserError(f"rollout.env={spec!r}: importing {module} failed ({type(e).__name__}: {e}); its "
                        f"dependencies are incomplete: {install}") from None

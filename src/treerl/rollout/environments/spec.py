"""How a run names an environment: `library:target` strings (or dicts) in `rollout.env`, parsed and checked.

Step 1 (docs/architecture.md): which ecosystem environment the prompts, rewards and episodes come from.

    rollout.env=reasoning_gym:leg_counting                  a library and what it calls the environment
    rollout.env=openenv+http://127.0.0.1:8000               a running server of that library
    rollout.env=[reasoning_gym:leg_counting@2,textarena:GuessTheNumber-v0]     mixed, weights after '@'
    rollout.env: [{env: reasoning_gym:leg_counting, weight: 2, env_args: {max_animals: 3}, name: legs}]   (YAML)

`rollout.env_args` is given to every environment of the list (an item's own `env_args` win key by key). Only the
syntax is checked here (at the config check, before anything is built); whether the library knows the target and
takes those arguments is checked when the environment is built, still before any sampling.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

# library prefix -> (adapter module in this package, pip extra that installs the library)
LIBRARIES = {
    "reasoning_gym": ("reasoning_gym_env", "reasoning-gym"),
    "textarena": ("textarena_env", "textarena"),
    "openenv": ("openenv_env", "openenv"),
    "trl": ("trl_env", "trl"),
    "verifiers": ("verifiers_env", "verifiers"),
}
PROXIED = ("trl", "verifiers")  # libraries whose episodes call the model through the recording proxy, tools offered
ALIASES = {"reasoning-gym": "reasoning_gym"}  # the PyPI spelling works too
ITEM_KEYS = ("env", "weight", "env_args", "name")
SERVED = re.compile(r"^([\w-]+)\+(https?://\S+)$")  # openenv+http://host:port: a running server
EXAMPLE = "e.g. reasoning_gym:leg_counting or textarena:GuessTheNumber-v0"


class EnvSpecError(ValueError):
    """`rollout.env` or `rollout.env_args` is not written as an environment spec (the config check's error)."""


@dataclass(frozen=True)
class EnvSpec:
    """One environment of `rollout.env`: which library, what it calls the environment, its share and arguments."""

    library: str  # a key of LIBRARIES
    target: str  # the library's name for it: a dataset, a game id, "module:Class", a server URL
    weight: float = 1.0  # its share of the prompts when several are mixed
    env_args: dict[str, Any] = field(default_factory=dict)  # passed to the library's constructor
    name: str = ""  # its label in metrics (env/<name>/...) and in each sequence's info["env"]

    @property
    def module(self) -> str:
        """The adapter module (in treerl.rollout.environments) that builds it."""
        return LIBRARIES[self.library][0]

    @property
    def extra(self) -> str:
        """The pip extra that installs its library."""
        return LIBRARIES[self.library][1]


def parse_env_specs(env: Any, env_args: Any = None) -> list[EnvSpec]:
    """`rollout.env` (a string, a dict, or a list of them) and `rollout.env_args` as EnvSpecs; a ValueError naming
    the key and what is wrong (one line) otherwise."""
    if env_args is None:
        env_args = {}
    if not isinstance(env_args, dict):
        raise EnvSpecError(f"rollout.env_args must be a mapping of argument names to values, got {env_args!r}")
    items = env if isinstance(env, list) else [env]
    if not items:
        raise EnvSpecError(f"rollout.env is an empty list: name an environment, {EXAMPLE}")
    key = "rollout.env" if not isinstance(env, list) else None
    specs = [parse_item(item, key or f"rollout.env[{k}]", env_args) for k, item in enumerate(items)]
    names = [spec.name for spec in specs]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise EnvSpecError(f"rollout.env names {twice[0]!r} twice: give each a name of its own ({{env: ..., name: ...}})")
    return specs


def parse_item(item: Any, key: str, env_args: dict[str, Any]) -> EnvSpec:
    """One entry of `rollout.env`: "library:target[@weight]" or {env, weight, env_args, name}."""
    if isinstance(item, str):
        text, weight = split_weight(item, key)
        return spec_of(text, key, weight, dict(env_args), None)
    if not isinstance(item, dict):
        raise EnvSpecError(f"{key}={item!r} must be a string such as 'library:name' ({EXAMPLE}) or a mapping "
                         f"with keys {', '.join(ITEM_KEYS)}")
    if len(item) == 1 and ALIASES.get(str(next(iter(item))), next(iter(item))) in LIBRARIES:  # YAML read "lib:" or
        library, value = next(iter(item.items()))  # "lib: name" as a mapping
        if value is None:
            raise EnvSpecError(f"{key}='{library}:' names no environment after the colon: write {library}:NAME "
                               f"({EXAMPLE})")
        raise EnvSpecError(f"{key}: '{library}: {value}' reads as a mapping (YAML): write {library}:{value}, with no "
                           "space after the colon")
    if unknown := [k for k in item if k not in ITEM_KEYS]:
        raise EnvSpecError(f"{key}: unknown key {unknown[0]!r}; an environment entry has {', '.join(ITEM_KEYS)}")
    if not isinstance(item.get("env"), str):
        raise EnvSpecError(f"{key} needs 'env': the environment as 'library:name', {EXAMPLE}")
    own = item.get("env_args") or {}
    if not isinstance(own, dict):
        raise EnvSpecError(f"{key}.env_args must be a mapping of argument names to values, got {own!r}")
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise EnvSpecError(f"{key}.weight={weight!r} must be a number > 0")
    name = item.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise EnvSpecError(f"{key}.name={name!r} must be a non-empty string")
    return spec_of(item["env"], key, float(weight), {**env_args, **own}, name)


def split_weight(text: str, key: str) -> tuple[str, float]:
    """"library:target@2" -> ("library:target", 2.0); an '@' followed by no number belongs to the target."""
    head, at, tail = text.rpartition("@")
    if not at:
        return text, 1.0
    try:
        return head, float(tail)
    except ValueError:
        return text, 1.0


def spec_of(text: str, key: str, weight: float, env_args: dict[str, Any], name: str | None) -> EnvSpec:
    """The EnvSpec of "library:target" or "library+URL", checked: a known library, a target, a weight > 0."""
    text = text.strip()
    served = SERVED.match(text)
    library, sep, target = (served.group(1), "+", served.group(2)) if served else text.partition(":")
    library = ALIASES.get(library, library)
    if not sep or not target.strip():
        raise EnvSpecError(f"{key}={text!r}: expected 'library:name', {EXAMPLE} (libraries: {', '.join(LIBRARIES)})")
    if library not in LIBRARIES:
        raise EnvSpecError(f"{key}={text!r}: unknown environment library {library!r}; known: {', '.join(LIBRARIES)}")
    if not (weight > 0 and math.isfinite(weight)):
        raise EnvSpecError(f"{key}={text!r}: its weight {weight:g} must be a finite number > 0")
    name = metric_safe(name.strip()) if name else label(library, target.strip())
    return EnvSpec(library, target.strip(), weight, env_args, name)


def label(library: str, target: str) -> str:
    """The name an environment's metrics are logged under: "reasoning_gym:leg_counting", "openenv+127.0.0.1:8000"
    (a URL without its scheme; characters a metric name should not hold become '_')."""
    url = re.match(r"^https?://(.+?)/*$", target)
    text = f"{library}+{url.group(1)}" if url else f"{library}:{target}"
    return metric_safe(text)


def metric_safe(text: str) -> str:
    """`text` with every character a metric name (env/<name>/...) should not hold, '/' first of all, as '_'."""
    return re.sub(r"[^\w.:+-]", "_", text)

"""docs/config.md, generated from the config dataclasses: the comment next to each field is its documentation.

Beside the steps (docs/architecture.md): the configuration's reference page.

    python -m treerl.trainer.core.config_docs > docs/config.md     (a test checks the file is up to date)
"""

from __future__ import annotations

import inspect
import re
from dataclasses import fields, is_dataclass

import yaml
from omegaconf import OmegaConf

from treerl.trainer.core.config import Config

FIELD = re.compile(r"^    (\w+)\s*:[^=]+=.*?\s#\s?(.*)$")
DOC_REFERENCE = re.compile(r"\bdocs/([\w-]+\.md)(#[\w-]+)?")

HEADER = """# Configuration reference

Generated from the config dataclasses (`python -m treerl.trainer.core.config_docs > docs/config.md`);
the comment next to each field in the source is its documentation here.

`treerl train [CONFIG] [key=value ...]` and `treerl sft [CONFIG] [key=value ...]` read one tree
with the sections below. Later layers win: the defaults (which are the built-in CPU demo,
`configs/arithmetic.yaml`), the YAML file, then the overrides (OmegaConf dotlist syntax:
`rollout.branch_at=[1,2]`, `model.path=null`). An unknown key, a value of the wrong type or an
out-of-range value stops the run before anything is built, naming the key (and the closest known
key for a typo). `--print-config` prints the resolved tree. CONFIG is a YAML file or the name of
a packaged config: `arithmetic`, `guess_number`, `sft_example`.

`treerl sft` applies its own defaults under your file: `algo.loss=sft`, `algo.entropy_coef=0.0`,
`trainer.output_dir=runs/sft`, `trainer.eval_prompts=0`.
"""


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment at the end of its line in the class source."""
    comments: dict[str, str] = {}
    for line in inspect.getsource(cls).splitlines():
        if match := FIELD.match(line):
            comments[match.group(1)] = match.group(2).strip()
    return comments


def _value(value: object) -> str:
    """A default as one table cell: YAML on one line (a list in flow style: `[0.9, 0.999]`), `|` escaped."""
    if isinstance(value, (list, tuple, dict)):
        plain = list(value) if isinstance(value, tuple) else value
        text = yaml.safe_dump(plain, default_flow_style=True, width=1000).strip()
    else:
        text = OmegaConf.to_yaml({"v": value}).strip().removeprefix("v:").strip()
    return "`" + (text or "''").replace("|", "\\|") + "`"


def _linked(text: str) -> str:
    """A `docs/<file>.md#<anchor>` in a source comment becomes a link that works from docs/config.md."""
    return DOC_REFERENCE.sub(lambda m: f"[{m.group(1)}]({m.group(1)}{m.group(2) or ''})", text)


def section_table(name: str, section: object) -> list[str]:
    """One markdown table: key, default, meaning."""
    doc = (inspect.getdoc(type(section)) or "").splitlines()[0]
    lines = [f"## `{name}`", "", doc, "", "| key | default | meaning |", "| --- | --- | --- |"]
    return lines + section_rows(name, section) + [""]


def section_rows(name: str, section: object) -> list[str]:
    """A row per key; a nested section (model.lora) gives its keys' rows in its place."""
    comments = field_comments(type(section))
    rows = []
    for f in fields(type(section)):
        value = getattr(section, f.name)
        if is_dataclass(value):
            rows += section_rows(f"{name}.{f.name}", value)
            continue
        meaning = comments.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{name}.{f.name}` | {_value(value)} | {meaning} |")
    return rows


def render() -> str:
    config = Config()
    parts = [HEADER]
    for f in fields(Config):
        section = getattr(config, f.name)
        assert is_dataclass(section)
        parts.append(_linked("\n".join(section_table(f.name, section))))
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")

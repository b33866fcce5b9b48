"""Bench output: JSON rows, a markdown table, and a plot of measured against FLOP-ideal speedup.

Beside the steps (docs/architecture.md): the benchmark's output files.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def markdown(rows: list[dict]) -> str:
    """One line per (workload, engine): sizes, ideal, time, speedup over flat and over dta, share of ideal, peak
    memory beside the memory contract's figure (flagged where above it)."""
    cpu = any(r.get("cpu_seconds") is not None for r in rows)  # a CPU run: the process's CPU time beside wall time
    lines = [
        "| workload | T | U | T/U | FLOP-ideal | engine | time (s) | " + ("CPU time (s) | " if cpu else "")
        + "speedup vs flat | of ideal | vs dta | peak MiB | contract MiB |",
        "|---|---:|---:|---:|---:|---|---:|" + ("---:|" if cpu else "") + "---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in rows:
        if r.get("vision_flops_flat"):  # images: what the vision tower's FLOP count is, flat and once per image
            flat, tree = r["vision_flops_flat"], r["vision_flops_tree"]
            notes.append(f"- {r['workload']}: vision tower forward {flat / 1e9:.2f} GFLOP flat, {tree / 1e9:.2f} once "
                         f"per distinct image ({flat / tree:.1f}x fewer; in the FLOP-ideal)")
        if r.get("refused"):
            lines.append(f"| {r['workload']} | {r['flat_tokens']:,} | {r['unique_tokens']:,} | {r['compression']:.2f} | "
                         f"{r['ideal']:.2f}x | {r['engine']} | refused | " + ("- | " if cpu else "")
                         + "- | - | - | - | - |")
            notes.append(f"- {r['engine']} refused: {r['refused']}")
            continue
        contract = _mib(r.get("contract_bytes")) + (" **over**" if r.get("over_contract") else "")
        lines.append(
            f"| {r['workload']} | {r['flat_tokens']:,} | {r['unique_tokens']:,} | {r['compression']:.2f} | "
            f"{r['ideal']:.2f}x | {r['engine']} | {r['seconds']:.3f} | "
            + (f"{r['cpu_seconds']:.3f} | " if cpu else "") + f"{_times(r['speedup'])} | "
            f"{_share(r['of_ideal'])} | {_times(r.get('vs_dta'))} | {_mib(r['peak_bytes'])} | {contract} |"
        )
    return "\n".join(lines + ([""] + list(dict.fromkeys(notes)) if notes else []))


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def memory_markdown(rows: list[dict]) -> str:
    """Peak MiB per engine (columns) as the number of samples sharing one prompt grows (rows)."""
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    lines = ["| samples G | tokens/sample | flat tokens | " + " | ".join(engines) + " |",
             "|---:|---:|---:|" + "---:|" * len(engines)]
    for g in dict.fromkeys(r["samples"] for r in rows):
        cells = {r["engine"]: r for r in rows if r["samples"] == g}
        first = next(iter(cells.values()))
        lines.append(f"| {g} | {first['sequence_tokens']:,} | {first['flat_tokens']:,} | "
                     + " | ".join(_mib(cells[e]["peak_bytes"]) for e in engines) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Measured speedup over flat against the FLOP-ideal one, per engine; the diagonal is the limit."""
    fig, ax = plt.subplots(figsize=(6.5, 5))
    top = max([r["ideal"] for r in rows] + [r["speedup"] or 1 for r in rows]) * 1.1
    ax.plot([0.8, top], [0.8, top], color="grey", linestyle="--", label="FLOP-ideal")
    for engine in dict.fromkeys(r["engine"] for r in rows):
        points = sorted((r["ideal"], r["speedup"], r["workload"]) for r in rows if r["engine"] == engine and r["speedup"])
        if engine == "flat" or not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=engine)
    for ideal, speedup, workload in sorted({(r["ideal"], r["speedup"], r["workload"]) for r in rows
                                            if r["engine"] == "dfs" and r["speedup"]}):  # no flat engine: no speedup
        ax.annotate(workload, (ideal, speedup), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP-ideal speedup over flat (T, U, attention from the config)")
    ax.set_ylabel("measured speedup over flat")
    ax.set_title("treerl bench: prefix sharing, measured vs ideal")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: list[dict], memory_rows: list[dict], meta: dict, out: Path) -> dict[str, Path]:
    """`bench.json` (settings + rows), `bench.md` (both tables) and `bench.png` under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "md": out / "bench.md", "png": out / "bench.png"}
    paths["json"].write_text(json.dumps({"settings": meta, "rows": rows, "memory_scaling": memory_rows}, indent=1))
    text = markdown(rows) + "\n"
    if memory_rows:
        text += "\nPeak memory (MiB) of one step, G samples of one prompt:\n\n" + memory_markdown(memory_rows) + "\n"
    paths["md"].write_text(text)
    plot(rows, paths["png"])
    return paths

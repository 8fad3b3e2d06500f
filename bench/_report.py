"""How a bench turns its rows into output: the one place for tables, files and plots.

A bench measures, formats its cells, and hands its rows here:

- `table(headers, rows)`: a markdown table, also readable as plain text;
  `save_markdown(name, title, sections)` (a title, then `## heading` sections) or
  `write(name, text)` writes bench/results/<name>.md. `machine_note()`,
  `load_average()` and `mb(bytes)` are the pieces of the conditions a report states.
- `median(values)`, `spread(values)` ("1.35x (1.34-1.42)" with unit "x": the median of
  a bench's rounds and their range) and `minmax_err(values)` (that range as an error bar).
- A bench of sections (`--only SECTION`): `run_sections(name, steps, merge)` runs them,
  notes how each ran, and writes bench/results/<name>.json (merged into the previous
  one with --only); `sections_text(res, tables)` is its report, `show_sections` prints and
  saves it with its plot.
- `pyplot()`: matplotlib's pyplot on the Agg backend (files, no display), imported on
  first use, so `--help` or a table alone does not load matplotlib. `grouped_bars(ax,
  series)` draws the shape most plots share: several series side by side, each bar at a
  value or, given samples, at their median with a min-max error bar. `save_plot(fig,
  name)` writes bench/results/<name>.png; `section_axes` lays out a bench of sections.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1_000_000


# ---------------------------------------------------------------------------------------
# Tables and files


def mb(n: float) -> str:
    return f"{n / MB:,.1f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (also readable as plain text), every column right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def document(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """A title, then a `## heading` and its body for each (heading, body)."""
    parts = [f"# {title}", ""]
    for heading, body in sections:
        parts += [f"## {heading}", "", body, ""]
    return "\n".join(parts)


def write(name: str, text: str) -> Path:
    """Write bench/results/<name>.md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text)
    return path


def save_markdown(name: str, title: str, sections: Sequence[tuple[str, str]]) -> Path:
    """Write bench/results/<name>.md: a title, then (heading, body) sections."""
    return write(name, document(title, sections))


def machine_note() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), Python {sys.version.split()[0]}"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as in "0.52 0.61 0.70"."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---------------------------------------------------------------------------------------
# Benches of sections


def run_sections(name: str, steps: Mapping[str, Callable[[], dict]], merge: bool) -> dict:
    """Run a bench's sections in order (section -> what measures it), noting in
    res["ran"] when and how each ran (the command, the load average before and after, the
    seconds it took); write them to bench/results/<name>.json, merged into the results
    there if `merge` (a run with --only), and return what was written."""
    res: dict[str, Any] = {}
    ran = {}
    for section, step in steps.items():
        started, before = time.perf_counter(), load_average()
        print(f"{section} ...", flush=True)
        res[section] = step()
        took = time.perf_counter() - started
        cmd = " ".join([f"bench/{name}.py", *sys.argv[1:]])
        ran[section] = (
            f"{time.strftime('%Y-%m-%d %H:%M')}, `{cmd}`,"
            f" load average {before} before, {load_average()} after, {took:.0f} s"
        )
    saved = RESULTS / f"{name}.json"
    merged = json.loads(saved.read_text()) if merge and saved.exists() else {}
    merged.update(res)
    merged["ran"] = {**merged.get("ran", {}), **ran}
    RESULTS.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(merged, indent=1))
    return merged


def sections_text(res: Mapping[str, Any], tables: Mapping[str, Callable[[dict], str]]) -> str:
    """The report of run_sections' results: the machine, then for each section present
    (in the order of `tables`, section -> its table) how it ran and its table."""
    parts = [f"{machine_note()}."]
    for section, render in tables.items():
        if section in res:
            parts += ["", res.get("ran", {}).get(section, ""), "", render(res[section])]
    return "\n".join(parts)


def show_sections(
    name: str,
    title: str,
    res: Mapping[str, Any],
    tables: Mapping[str, Callable[[dict], str]],
    plot: Callable[[Any], None],
) -> int:
    """Print sections_text, write it to bench/results/<name>.md, plot(res); 0."""
    text = sections_text(res, tables)
    print(text)
    save_markdown(name, title, [("Results", text)])
    plot(res)
    return 0


# ---------------------------------------------------------------------------------------
# Statistics


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float], digits: int = 2, unit: str = "", bold: bool = False) -> str:
    """The median and the range: "1.35x (1.34-1.42)" for unit "x"; bold: "**1.35x** (...)"."""
    mid = f"{median(values):.{digits}f}{unit}"
    return f"{f'**{mid}**' if bold else mid} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def minmax_err(values: Sequence[float]) -> list[list[float]]:
    """matplotlib's yerr for one bar at the median of `values`: down to min, up to max."""
    mid = median(values)
    return [[mid - min(values)], [max(values) - mid]]


# ---------------------------------------------------------------------------------------
# Plots


def pyplot() -> Any:
    """matplotlib.pyplot, on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(
    ax: Any,
    series: Mapping[str, Sequence[Any]],
    *,
    width: float | None = None,
    horizontal: bool = False,
    colors: Mapping[str, str] | None = None,
    samples: bool = False,
) -> list[Any]:
    """Bars of each series side by side around x = 0, 1, 2, ... (the caller sets the tick
    labels): `series` maps a legend label to one value per x, None for no bar there.
    `width`: of one bar (default 0.8 / the number of series). `horizontal`: barh, the
    first series on top. `samples`: the values are lists of samples; each bar stands at
    their median with an error bar from their min to their max. Returns each series'
    BarContainer (None for a series with no bar)."""
    n = len(series)
    width = 0.8 / n if width is None else width
    drawn = []
    for j, (label, values) in enumerate(series.items()):
        offset = (j - (n - 1) / 2) * width
        present = [(i, v) for i, v in enumerate(values) if v is not None]
        if not present:
            drawn.append(None)
            continue
        at = [i - offset if horizontal else i + offset for i, _ in present]
        kept = [v for _, v in present]
        style: dict[str, Any] = {"label": label}
        if colors:
            style["color"] = colors[label]
        heights = kept
        if samples:
            heights = [median(v) for v in kept]
            errs = [minmax_err(v) for v in kept]
            err = [[e[0][0] for e in errs], [e[1][0] for e in errs]]
            style["xerr" if horizontal else "yerr"] = err
        draw = ax.barh if horizontal else ax.bar
        drawn.append(draw(at, heights, width, **style))
    return drawn


def section_axes(
    res: Mapping[str, Any], sections: Sequence[str], size: tuple[float, float]
) -> tuple[Any, list[tuple[Any, str, Any]]]:
    """A figure of one plot per section present in `res`, side by side, each `size`
    inches; returns it and (axes, section, res[section]) for each."""
    present = [s for s in sections if s in res]
    fig, axes = pyplot().subplots(
        1, len(present), figsize=(size[0] * len(present), size[1]), squeeze=False
    )
    return fig, [(ax, s, res[s]) for ax, s in zip(axes[0], present, strict=True)]


def save_plot(fig: Any, name: str, dpi: int = 110) -> Path:
    """Write the figure to bench/results/<name>.png and close it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path

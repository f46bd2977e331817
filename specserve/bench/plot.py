"""`specserve bench --plot`: one PNG of a bench result, the dict that `--json` writes.

Drawn only from what the run measured, up to three panels:
- speedup over plain, one bar per speculative configuration, grouped by category in latency
  mode, and by concurrency in throughput mode (which measures tok/s over a whole run's wall
  time, so it has no categories);
- acceptance by draft position, one line per speculative configuration (for a tree the
  position is its depth, as bench reports it);
- tok/s against concurrency, one line per configuration, plain included (throughput mode).
A panel whose figures the run did not produce is left out. Peers (transformers, llama.cpp) are
not speculative methods of specserve's and have no acceptance figures; they stay in the table.

matplotlib is an optional extra, imported only when a figure is drawn; `require_matplotlib`
lets the command refuse `--plot` before a model loads.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from specserve import engine_args
from specserve.errors import InvalidParameterError, SpecserveError

# specserve's own speculative configurations: the methods, and a --config file's ("config").
SPECULATIVE = frozenset(engine_args.SPECULATIVE_METHODS) - {"none"} | {"config"}
MISSING_MATPLOTLIB = "--plot needs matplotlib: pip install 'specserve[plot]'"
PANEL_HEIGHT = 4.2  # inches per row of panels; 100 dpi keeps the figure near README width


def check_plot_path(path: str) -> None:
    """Refuse a figure that could not be written, before anything runs."""
    if not path.lower().endswith(".png"):
        raise InvalidParameterError("plot", path, "must name a .png file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise InvalidParameterError("plot", path, "its folder does not exist")


def require_matplotlib() -> None:
    """The optional extra, checked by importing it (a broken install fails here too, not after a run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SpecserveError(MISSING_MATPLOTLIB) from None


def load_result(path: str) -> dict:
    """A file `specserve bench --json` wrote."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidParameterError("plot_from", path, f"cannot be read as JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list) or not doc["results"]:
        raise InvalidParameterError("plot_from", path, "must be a file `specserve bench --json` wrote "
                                                       "(an object with a non-empty \"results\" list)")
    return doc


@dataclass(frozen=True, slots=True)
class PlotData:
    """What the panels show, taken out of a bench result; an empty field is a panel left out."""

    title: str
    group_by: str  # what the speedup bars are grouped by: "category" or "concurrency"
    groups: list[str]  # the categories in workload order, then "overall" if several; or the concurrencies
    speedup: dict[str, list[float | None]]  # label -> speedup over plain per group, aligned with groups
    acceptance: dict[str, list[float]]  # label -> acceptance at draft position (tree depth) 1, 2, ...
    acceptance_note: str  # which run the acceptance lines come from, when there were several
    throughput: dict[str, list[tuple[int, float]]]  # label -> [(concurrency, tok/s)], plain included

    @property
    def num_panels(self) -> int:
        return sum(map(bool, (self.speedup, self.acceptance, self.throughput)))


def plot_data(doc: dict) -> PlotData:
    results = doc["results"]
    spec = [r for r in results if r["method"] in SPECULATIVE]
    throughput_mode = "concurrency" in results[0]
    groups, speedup, throughput, note = [], {}, {}, ""
    if throughput_mode:
        for r in sorted(results, key=lambda r: r["concurrency"]):  # a sweep runs in the order typed (16,1,4)
            throughput.setdefault(r["label"], []).append((r["concurrency"], r["tokens_per_s"]))
        concurrencies = sorted({r["concurrency"] for r in results})
        groups = [f"c={c}" for c in concurrencies]
        found = {(r["label"], r["concurrency"]): r["speedup"] for r in spec}
        for label in dict.fromkeys(r["label"] for r in spec):
            speedup[label] = [found.get((label, c)) for c in concurrencies]
        # Acceptance is not additive across runs (the JSON holds rates, not counts), and an
        # adaptive k drafts differently under load: the lines are the lowest concurrency's,
        # the run closest to one request at a time.
        spec = [r for r in spec if r["concurrency"] == concurrencies[0]]
        note = f" (concurrency {concurrencies[0]})" if len(concurrencies) > 1 else ""
    elif spec:
        cats = list(results[0]["per_category"])
        groups = cats + ["overall"] if len(cats) > 1 else cats
        for r in spec:
            per = [r["per_category"][c]["speedup"] for c in cats]
            speedup[r["label"]] = per + [r["speedup"]] if len(cats) > 1 else per
    acceptance = {r["label"]: r["acceptance_by_position"] for r in spec if r["acceptance_by_position"]}
    return PlotData(_title(doc), "concurrency" if throughput_mode else "category", groups, speedup, acceptance,
                    note, throughput)


def _title(doc: dict) -> str:
    s, w, m = doc.get("settings", {}), doc.get("workload", {}), doc.get("machine", {})
    temp = s.get("temperature")
    sampling = "greedy" if temp == 0 else f"temperature {temp}, top_p {s.get('top_p')}"
    dtype = "" if s.get("dtype", "auto") == "auto" else f" ({s['dtype']})"  # auto: the machine line's kernels
    workload = os.path.basename(w.get("name", "?"))  # a JSONL path's folder says nothing about the prompts
    line1 = (f"specserve bench: {doc.get('model', '?')}{dtype}, {workload} "
             f"{w.get('num_prompts', '?')} prompts, {s.get('max_tokens', '?')} new tokens, {sampling}")
    if "repeat" in s:
        line1 += f", each asked {s['repeat']} times"
    hardware = m.get("gpu") or f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores"
    line2 = f"{hardware}, {m.get('kernels', '?')}, torch {m.get('torch', '?')}, {m.get('torch_threads', '?')} threads"
    return f"{line1}\n{line2}"


def draw(doc: dict, path: str):
    """Write the figure of a bench result to `path` (PNG); -> the matplotlib Figure, for tests.

    A Figure on its own Agg canvas, not pyplot: no global backend or figure registry changes."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = plot_data(doc)
    if not data.num_panels:
        raise SpecserveError("nothing to plot: the result has no speculative configuration and no concurrency run")
    small = [name for name, on in (("acceptance", data.acceptance), ("throughput", data.throughput)) if on]
    width = max(1, len(small))
    mosaic = ([["speedup"] * width] if data.speedup else []) + ([small] if small else [])
    fig = Figure(figsize=(5.5 * width if width > 1 else 9, PANEL_HEIGHT * len(mosaic) + 0.6), dpi=100,
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplot_mosaic(mosaic)
    # One colour per configuration in every panel; plain decoding grey, like the 1.0x line.
    labels = [label for label in dict.fromkeys([*data.speedup, *data.acceptance, *data.throughput]) if label != "none"]
    colors = {"none": "0.35"} | {label: f"C{i % 10}" for i, label in enumerate(labels)}
    if data.speedup:
        _speedup_panel(axes["speedup"], data, colors)
    if data.acceptance:
        _acceptance_panel(axes["acceptance"], data, colors)
    if data.throughput:
        _throughput_panel(axes["throughput"], data, colors)
    fig.suptitle(data.title, fontsize=10)
    fig.savefig(path, format="png")
    return fig


def _speedup_panel(ax, data: PlotData, colors: dict) -> None:
    n = len(data.speedup)
    width = 0.8 / n
    for i, (label, values) in enumerate(data.speedup.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(data.groups))]
        # A missing figure (plain measured no time) draws no bar rather than a zero.
        ax.bar(xs, [math.nan if v is None else v for v in values], width, label=label, color=colors[label])
    ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1)  # plain decoding
    if data.group_by == "category":
        ax.set_xticks(range(len(data.groups)), data.groups, rotation=40, ha="right", rotation_mode="anchor")
    else:
        ax.set_xticks(range(len(data.groups)), data.groups)
        ax.set_xlabel("requests in flight (concurrency)")
    ax.set_ylabel("speedup over plain (x)")
    ax.set_title(f"speedup over plain decoding by {data.group_by}")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _acceptance_panel(ax, data: PlotData, colors: dict) -> None:
    longest = 1
    for label, rates in data.acceptance.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label, color=colors[label])
        longest = max(longest, len(rates))
    ax.set_xticks(range(1, longest + 1))
    ax.set_ylim(-0.03, 1.05)  # a rate of 0 stays visible above the axis
    ax.set_xlabel("draft position (depth, for a tree)")
    ax.set_ylabel("acceptance rate")
    ax.set_title("acceptance by draft position" + data.acceptance_note)
    ax.legend(fontsize=9)


def _throughput_panel(ax, data: PlotData, colors: dict) -> None:
    for label, points in data.throughput.items():
        ax.plot(*zip(*points), marker="o", label=label, color=colors[label])
    concurrencies = sorted({c for points in data.throughput.values() for c, _ in points})
    ax.set_xscale("log", base=2)  # sweeps grow geometrically (1, 4, 16, 64)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("requests in flight (concurrency)")
    ax.set_ylabel("generated tok/s (wall time)")
    ax.set_title("throughput against concurrency")
    ax.legend(fontsize=9)

"""Plots for `tandem bench`: PNGs drawn from the bench.json dict alone, so a saved run can be
re-plotted (`tandem bench --replot DIR/bench.json`) without the servers it measured.

    ttft.png        TTFT distribution (ECDF, log x), one panel per workload, one line per system
    itl.png         the same for inter-chunk gaps (ITL)
    throughput.png  completion tokens/s against concurrency, one line per system
    summary.png     2×2: TTFT and ITL of one workload ("mixed" when run), throughput, and
                    ITL p50/p99 bars per workload and system (the figure docs/operating.md shows)

The dict's shape is written by cluster/bench_cli.py: `systems[name]` holds `workloads[wl]`
(loadgen's summary plus `samples.ttft_ms` / `samples.itl_ms`) and `sweep` (a list of
{concurrency, out_tok_s, ...}); `machine`, `started` and `model` go in the footnote.
A system is the same colour in every figure. Only the Agg backend is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

PLOTS = ("ttft.png", "itl.png", "throughput.png", "summary.png")
DPI = 120
_METRICS = {"ttft": ("TTFT", "time to first token (ms, log scale)"),
            "itl": ("ITL", "gap between text chunks (ms, log scale)")}


def plot_bench(data: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write PLOTS into out_dir from a bench.json dict; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = {name: f"C{i}" for i, name in enumerate(data["systems"])}
    workloads = _workload_names(data)
    paths = []

    for metric in ("ttft", "itl"):
        fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(5.2 * max(1, len(workloads)), 4.2),
                                 squeeze=False, sharey=True)
        for i, (ax, wl) in enumerate(zip(axes[0], workloads)):
            _ecdf_panel(ax, data, colors, metric, wl)
            if i:
                ax.set_ylabel("")
        fig.suptitle(f"{_METRICS[metric][0]} distribution per workload (lower and further left is better)")
        paths.append(_save(fig, data, out / f"{metric}.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    _throughput_panel(ax, data, colors)
    paths.append(_save(fig, data, out / "throughput.png"))

    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    focus = "mixed" if "mixed" in workloads else (workloads[-1] if workloads else "")
    _ecdf_panel(axes[0][0], data, colors, "ttft", focus)
    _ecdf_panel(axes[0][1], data, colors, "itl", focus)
    _throughput_panel(axes[1][0], data, colors)
    _itl_bars_panel(axes[1][1], data, colors, workloads)
    fig.suptitle(f"tandem bench: {', '.join(data['systems'])}", fontsize=14)
    paths.append(_save(fig, data, out / "summary.png"))
    return paths


def _workload_names(data: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for system in data["systems"].values():
        names += [w for w in system.get("workloads", {}) if w not in names]
    return names


def _ecdf_panel(ax: Axes, data: dict[str, Any], colors: dict[str, str], metric: str, workload: str) -> None:
    label, xlabel = _METRICS[metric]
    drawn = False
    for name, system in data["systems"].items():
        wl = system.get("workloads", {}).get(workload)
        values = [v for v in (wl or {}).get("samples", {}).get(f"{metric}_ms", []) if v and v > 0]
        if not values:
            continue
        p50, p99 = (wl.get(f"{metric}_ms") or {}).get("p50"), (wl.get(f"{metric}_ms") or {}).get("p99")
        ax.ecdf(values, color=colors[name], linewidth=2,
                label=f"{name}: p50 {_fmt(p50)}, p99 {_fmt(p99)} ms (n={len(values)})")
        drawn = True
    for q in (0.5, 0.99):
        ax.axhline(q, color="0.6", linestyle=":", linewidth=1)
        ax.annotate(f"p{round(q * 100)}", (1.0, q), xycoords=("axes fraction", "data"), xytext=(2, 0),
                    textcoords="offset points", va="center", fontsize=8, color="0.4")
    ax.set_title(f"{label}, workload '{workload}'")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples ≤ x")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="major", alpha=0.3)
    if drawn:
        ax.set_xscale("log")
        _plain_log_labels(ax.xaxis, ax.get_xlim())
        ax.legend(loc="lower right", fontsize=8)
    else:
        _no_data(ax)


def _throughput_panel(ax: Axes, data: dict[str, Any], colors: dict[str, str]) -> None:
    levels: set[int] = set()
    for name, system in data["systems"].items():
        points = [(p["concurrency"], p["out_tok_s"]) for p in system.get("sweep", []) if p.get("out_tok_s")]
        if not points:
            continue
        xs, ys = zip(*sorted(points))
        levels.update(xs)
        ax.plot(xs, ys, marker="o", color=colors[name], linewidth=2, label=name)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.0f}", (x, y), xytext=(-5, 5), textcoords="offset points", ha="right",
                        fontsize=8, color=colors[name])
    ax.set_title("Throughput vs concurrency (higher is better)")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("completion tokens / s (all streams)")
    ax.grid(True, alpha=0.3)
    if levels:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
        ax.legend(loc="upper left", fontsize=9)
    else:
        _no_data(ax)


def _itl_bars_panel(ax: Axes, data: dict[str, Any], colors: dict[str, str], workloads: list[str]) -> None:
    """Per workload a group of bars, one per system: pale bar to p99, solid bar to p50."""
    names = list(data["systems"])
    width = 0.8 / max(1, len(names))
    drawn, top = False, 0.0
    for i, name in enumerate(names):
        for j, wl in enumerate(workloads):
            itl = (data["systems"][name].get("workloads", {}).get(wl) or {}).get("itl_ms") or {}
            x = j - 0.4 + width * (i + 0.5)
            if itl.get("p99"):
                ax.bar(x, itl["p99"], width * 0.9, color=colors[name], alpha=0.35)
                ax.annotate(f"p99 {_fmt(itl['p99'])}\np50 {_fmt(itl.get('p50'))}", (x, itl["p99"]), xytext=(0, 2),
                            textcoords="offset points", ha="center", fontsize=7)
                top, drawn = max(top, itl["p99"]), True
            if itl.get("p50"):
                ax.bar(x, itl["p50"], width * 0.9, color=colors[name], label=name if j == 0 else None)
    ax.set_title("ITL by workload: solid bar p50, pale bar p99 (lower is better)")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_xlabel("workload")
    ax.set_ylabel("gap between text chunks (ms)")
    ax.grid(True, axis="y", alpha=0.3)
    if drawn:
        ax.set_ylim(0, top * 1.25)  # room for the labels and the legend
        ax.legend(loc="upper left", fontsize=9, ncols=len(names))
    else:
        _no_data(ax)


def _plain_log_labels(axis: Any, lim: tuple[float, float]) -> None:
    """Log-axis tick labels as plain numbers (20, 50, 100), the 2s and 5s between powers of ten
    labelled too when the axis spans under ~2.5 decades."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    few = lim[0] > 0 and lim[1] / lim[0] < 10**2.5
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if few and f"{v:.0e}"[0] in "25" else ""))


def _no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.4")


def _fmt(ms: float | None) -> str:
    if ms is None:
        return "–"
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def footnote(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    parts = [data.get("started", "")[:16].replace("T", " "), f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores",
             m.get("platform", ""),
             "model " + ", ".join(sorted({str(s.get("model")) for s in data["systems"].values()}) or ["?"])]
    return " · ".join(p for p in parts if p)


def _save(fig: Figure, data: dict[str, Any], path: Path) -> Path:
    fig.text(0.005, 0.005, footnote(data), fontsize=7, color="0.35", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.025, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path

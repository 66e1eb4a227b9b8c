"""The goodput bench's PNGs, drawn from its JSON alone (bench/goodput.py --replot FILE):

    goodput-attainment.png  SLO attainment and goodput against the offered rate, one line per system
    goodput-pareto.png      tok/s per user (1 / TPOT p50) against total out tok/s, one point per rate

Same style as cluster/plots.py (its footnote and resolution); a system keeps its colour.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from cluster.plots import DPI, footnote  # noqa: E402

PLOTS = ("goodput-attainment.png", "goodput-pareto.png")


def _series(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {name: s["sharegpt"] for name, s in data["systems"].items() if s.get("sharegpt")}


def _label(name: str, system: dict[str, Any]) -> str:
    return f"{name} (Q4_1)" if system.get("dtype") == "Q4_1" else name


def plot_goodput(data: dict[str, Any], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = {name: f"C{i}" for i, name in enumerate(data["systems"])}
    series = _series(data)
    slo = data.get("slo", {})
    slo_text = f"SLO: TTFT ≤ {slo.get('ttft_ms', '?'):g} ms and TPOT ≤ {slo.get('tpot_ms', '?'):g} ms"

    fig, (att, good) = plt.subplots(1, 2, figsize=(12, 4.6))
    top = 0.0
    for name, points in series.items():
        xs = [p["rate_rps"] for p in points]
        label = _label(name, data["systems"][name])
        att.plot(xs, [p["attainment"] for p in points], marker="o", color=colors[name], linewidth=2, label=label)
        good.plot(xs, [p["goodput_rps"] for p in points], marker="o", color=colors[name], linewidth=2, label=label)
        top = max(top, *xs)
    att.axhline(0.9, color="0.6", linestyle=":", linewidth=1)
    att.set(title=f"SLO attainment vs rate ({slo_text})", xlabel="offered rate (req/s, Poisson)",
            ylabel="share of requests meeting both SLOs", ylim=(0, 1.05))
    if top:
        good.plot([0, top], [0, top], color="0.6", linestyle=":", linewidth=1, label="offered")
        for ax in (att, good):
            ax.set_xlim(0, top * 1.05)
    good.set(title="Goodput vs rate (higher is better)", xlabel="offered rate (req/s, Poisson)",
             ylabel="requests/s meeting both SLOs")
    for ax in (att, good):
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    paths = [_save(fig, data, out / PLOTS[0])]

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, points in series.items():
        pts = [(p["out_tok_s"], p["tok_s_per_user"], p["rate_rps"]) for p in points
               if p.get("out_tok_s") and p.get("tok_s_per_user")]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[name], linewidth=2,
                label=_label(name, data["systems"][name]))
        for x, y, rate in pts:
            ax.annotate(f"{rate:g}", (x, y), xytext=(4, 4), textcoords="offset points", fontsize=7, color=colors[name])
    ax.set(title="Per-user speed vs total throughput, ShareGPT (labels: req/s; up and right is better)",
           xlabel="completion tokens/s, all users", ylabel="tokens/s per user (1 / TPOT p50)")
    ax.title.set_fontsize(10)
    ax.set_xlim(0, ax.get_xlim()[1] * 1.08)  # room for the rate labels
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    paths.append(_save(fig, data, out / PLOTS[1]))
    return paths


def _save(fig: Figure, data: dict[str, Any], path: Path) -> Path:
    fig.text(0.005, 0.005, footnote(data), fontsize=7, color="0.35", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path

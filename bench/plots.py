"""The pictures of `bench engine` and `bench serving`: ours and the peers' figures side by side, written next to the
result's JSON (same name, .png) so that a result reads at a glance. Saved results get theirs without a rerun:

    python -m bench.plots FILE.json                       writes FILE.png
    python -m bench.plots OURS.json PEER.json --out P.png  serving runs in one picture (ours and a peer's gateway,
                                                           or one gateway at several request rates)

Drawn with Agg on a bare Figure: no display, and no pyplot state shared with whatever imported this.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from .workloads import mixed_line

ENGINE_PANELS = (("batch1", "batch1_tps", "batch-1 decode"), ("mixed", "mixed_tps", "mixed workload"))
STATISTICS = ("mean", "p50", "p90", "p99")


def _round_figures(result: dict, workload: str) -> dict[str, list[float]]:
    """Each engine's tokens/s in every pair of `workload`, over the rounds (ours runs once per peer)."""
    found: dict[str, list[float]] = {}
    for rnd in result.get("rounds", []):
        for pair in rnd["pairs"]:
            if pair["workload"] == workload:
                for label, figure in pair["figures"].items():
                    found.setdefault(label, []).append(figure["tps"])
    return found


def _engine_label(result: dict, workload: str, name: str) -> str:
    ratio = result.get("ratios", {}).get(workload, {}).get(name)
    if ratio is None:
        return name
    return f"{name}\nours / this {ratio['median']:.2f}×\n[{ratio['min']:.2f}–{ratio['max']:.2f}]"


def engine_figure(result: dict) -> Figure:
    """Batch-1 and mixed tokens/s of ours and each peer (bars the medians, dots each round's figure, ours against
    the peer under its name), and the batch-1 fraction of the read roofline."""
    panels = [panel for panel in ENGINE_PANELS if result.get(panel[1])]
    roofline = result.get("roofline_fraction") or {}
    engines = list(dict.fromkeys([name for _, key, _ in panels for name in result[key]]))
    colors = {name: f"C{i}" for i, name in enumerate(engines)}
    fig = Figure(figsize=(5 * (len(panels) + bool(roofline)), 5), layout="constrained")
    axes = fig.subplots(1, len(panels) + bool(roofline), squeeze=False)[0]
    for ax, (workload, key, title) in zip(axes, panels, strict=False):
        names, rounds = list(result[key]), _round_figures(result, workload)
        bars = ax.bar(range(len(names)), [result[key][n] for n in names], color=[colors[n] for n in names])
        ax.bar_label(bars, fmt="%.0f", label_type="center", color="white", fontweight="bold")
        for i, name in enumerate(names):
            ax.plot([i] * len(rounds.get(name, [])), rounds.get(name, []), "k.", alpha=0.6)
        ax.set_xticks(range(len(names)), [_engine_label(result, workload, n) for n in names], fontsize=8)
        shape = result.get("mixed_workload") if workload == "mixed" else None
        ax.set_title(title if shape is None else mixed_line(shape).replace(": ", ":\n", 1), fontsize=10)
        ax.set_ylabel("output tokens/s (median; dots: rounds)")
    if roofline:
        ax, names = axes[-1], list(roofline)
        bars = ax.bar(range(len(names)), [roofline[n] for n in names], color=[colors[n] for n in names])
        ax.bar_label(bars, labels=[f"{roofline[n]:.0%}" for n in names])
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylim(0, 1)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_title("batch-1 decode: share of the read roofline\n(weight bytes per token × tok/s / bandwidth)",
                     fontsize=10)
    host = result.get("host", {})
    fig.suptitle(f"bench engine — {result.get('model')} {result.get('dtype')} on {result.get('device')}, "
                 f"{host.get('cpu', '')} ({host.get('threads', '?')} threads), {result.get('date')}, "
                 f"{result.get('rounds_run', len(result.get('rounds', [])))} rounds")
    return fig


def serving_label(run: dict) -> str:
    """A serving run by what it drove and how hard: model @ server, request rate, cap on requests in flight."""
    config = run.get("config", {})
    server = urlsplit(config.get("base_url") or "").netloc or config.get("base_url")
    cap = config.get("max_concurrency")
    return (f"{config.get('model')} @ {server}, {config.get('request_rate')} req/s"
            + (f", ≤{cap} in flight" if cap else "") + f": {run['completed']} done, {run['failed']} failed")


def _offered_load(run: dict) -> tuple[int, float]:
    config = run.get("config", {})
    rate = config.get("request_rate")
    return config.get("max_concurrency") or 0, float("inf") if rate in (None, "inf") else float(rate)


def serving_figure(runs: dict[str, dict]) -> Figure:
    """Serving runs (label -> `bench serving`'s summary), one colour each, in order of offered load: output and
    request throughput, and TTFT and TPOT (mean and percentiles)."""
    labels = sorted(runs, key=lambda label: (_offered_load(runs[label]), label))
    fig = Figure(figsize=(15, 5.5), layout="constrained")
    ax, *latency_axes = fig.subplots(1, 3)
    bars = ax.bar(range(len(labels)), [runs[k]["output_throughput"] for k in labels], 0.6,
                  color=[f"C{i}" for i in range(len(labels))])
    ax.bar_label(bars, labels=[f"{runs[k]['output_throughput']:.0f} tok/s\n{runs[k]['request_throughput']:.1f} req/s"
                               for k in labels])
    ax.set_xticks([])
    ax.set_xlim(-0.8, len(labels) - 0.2)
    ax.margins(y=0.15)
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput, by offered load")
    width = 0.8 / len(labels)
    for ax, key, title in zip(latency_axes, ("ttft_ms", "tpot_ms"), ("time to first token", "time per output token"),
                              strict=True):
        for i, label in enumerate(labels):
            values = [runs[label][key][s] for s in STATISTICS]
            ax.bar([x + (i - (len(labels) - 1) / 2) * width for x in range(len(STATISTICS))],
                   [0 if v is None else v for v in values], width, color=f"C{i}")
        if all(runs[label][key]["p50"] is None for label in labels):
            ax.text(0.5, 0.5, "none: every output was one token", transform=ax.transAxes, ha="center")
            ax.set_yticks([])
        ax.set_xticks(range(len(STATISTICS)), STATISTICS)
        ax.set_ylabel("ms")
        ax.set_title(title)
    fig.legend(bars.patches, labels, loc="outside lower center", fontsize=8)
    fig.suptitle("bench serving — client-side timings (streaming requests)")
    return fig


def figure_of(result: dict) -> Figure:
    if "batch1_tps" in result:
        return engine_figure(result)
    if "ttft_ms" in result and "output_throughput" in result:
        return serving_figure({serving_label(result): result})
    raise ValueError("no picture for this result: it is neither `bench engine`'s nor `bench serving`'s")


def save(fig: Figure, png: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(png, dpi=110)
    return png


def write_picture(result: dict, png: Path) -> Path:
    return save(figure_of(result), png)


def plot_files(paths: list[Path], out: Path | None = None) -> Path:
    """One result's picture (FILE.png by default), or several serving runs' in one (`out` then required)."""
    results = [json.loads(p.read_text()) for p in paths]
    if len(results) == 1:
        return write_picture(results[0], out or paths[0].with_suffix(".png"))
    if out is None:
        raise ValueError("several results go into one picture: say where with --out")
    if not all("ttft_ms" in r for r in results):
        raise ValueError("only serving runs are drawn together (an engine result already holds its peers)")
    labels = [serving_label(r) for r in results]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({p.name})" for label, p in zip(labels, paths, strict=True)]
    return save(serving_figure(dict(zip(labels, results, strict=True))), out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="result JSON files of bench engine or bench serving")
    p.add_argument("--out", type=Path, default=None, help="the PNG (default: the one result's name, .png)")
    args = p.parse_args(argv)
    try:
        print(plot_files(args.results, args.out))
    except ValueError as err:
        p.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())

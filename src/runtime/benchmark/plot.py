"""The plot of an op's page: per shape, our kernel backends beside the peers, as speed-up over the best peer.

matplotlib is imported only when a plot is drawn (runtime.benchmark.pages.new_figure: the Agg canvas, no display).
"""

from __future__ import annotations

from pathlib import Path

from .comparison import Comparison, compare
from .pages import OUR_COLOURS, PEER_COLOURS, PEER_HATCH, new_figure, save_figure


def _speedups(group: Comparison) -> dict[str, float]:
    """Each timed implementation's speed-up over the group's best peer (best peer = 1); empty without a timed peer."""
    best_peer = group.best(group.peers)
    if best_peer is None:
        return {}
    return {
        name: best_peer[1] / ms for name, ms in group.ms.items() if ms and (name in group.ours or name in group.peers)
    }


def plot_speedups(results: list[dict], path: Path) -> Path:
    """One panel per mode, one group of bars per shape (and dtype): each bar an implementation's speed-up over the
    best peer of that shape, ours first. Writes a PNG to path and returns it."""
    from matplotlib.ticker import FuncFormatter

    comparisons = compare(results)
    modes = list(dict.fromkeys(c.mode for c in comparisons))
    ours = list(dict.fromkeys(n for c in comparisons for n in c.ours))
    peers = list(dict.fromkeys(n for c in comparisons for n in c.peers))
    names = ours + peers
    colours = dict(zip(ours, OUR_COLOURS)) | dict(zip(peers, PEER_COLOURS))
    n_groups = max(sum(c.mode == m for c in comparisons) for m in modes) if modes else 1
    one_dtype = len({c.dtype for c in comparisons}) == 1

    figure = new_figure(figsize=(min(16.0, 3.0 + 0.25 * n_groups * max(len(names), 1)), 0.6 + 3.0 * max(len(modes), 1)))
    axes = figure.subplots(max(len(modes), 1), 1, squeeze=False)[:, 0]
    width = 0.8 / max(len(names), 1)
    gpu = any(row.get("gpu_ms") for result in results for row in result["rows"])
    for ax, mode in zip(axes, modes):
        groups = [c for c in comparisons if c.mode == mode]
        for i, name in enumerate(names):
            xs, heights = [], []
            for x, group in enumerate(groups):
                speedup = _speedups(group).get(name)
                if speedup is not None:
                    xs.append(x + (i - (len(names) - 1) / 2) * width)
                    heights.append(speedup)
            label = name if name in ours else f"{name} (peer)"
            ax.bar(
                xs,
                heights,
                width,
                label=label,
                color=colours[name],
                hatch=None if name in ours else PEER_HATCH,
                edgecolor="white" if name in ours else "black",
                linewidth=0.4,
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_xticks(range(len(groups)))
        labels = [g.shape if one_dtype else f"{g.shape}\n{g.dtype}" for g in groups]
        ax.set_xticklabels(
            labels, fontsize=7, rotation=25 if len(groups) > 4 else 0, ha="right" if len(groups) > 4 else "center"
        )
        ax.set_ylabel("speed-up vs best peer (log)")
        ax.set_title(f"{mode}, {'GPU time' if gpu else 'eager time'}: above 1 is faster than the best peer", fontsize=9)
        ax.grid(axis="y", linewidth=0.3)
    if names:
        handles, labels = axes[0].get_legend_handles_labels()
        figure.legend(handles, labels, fontsize=8, ncol=len(names), loc="upper center", frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.35 / figure.get_figheight()))
    return save_figure(figure, path, dpi=110)

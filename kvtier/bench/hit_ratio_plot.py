"""The --plot figure of `kvtier bench hit-ratio`: prefix hit ratio against capacity,
one line per policy, one panel per trace (matplotlib, Agg: no display needed)."""
from __future__ import annotations

from typing import Sequence

from kvtier.sim.replay import ReplayResult


def plot(results: Sequence[ReplayResult], path: str) -> None:
    import matplotlib.pyplot as plt
    fig = figure(results)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def figure(results: Sequence[ReplayResult]) -> "matplotlib.figure.Figure":  # noqa: F821
    """The figure itself (the caller closes it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    traces = list(dict.fromkeys(r.trace for r in results))
    # One colour per policy across every panel; the offline bound is drawn dashed in black
    # (the default cycle gave it an online policy's colour once the cycle wrapped).
    online = list(dict.fromkeys(r.policy for r in results if not r.offline))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {pol: cycle[i % len(cycle)] for i, pol in enumerate(online)}
    fig, axes = plt.subplots(1, len(traces), figsize=(6.0 * len(traces), 4.5), squeeze=False)
    for ax, tname in zip(axes[0], traces):
        by_pol: dict[str, list[ReplayResult]] = {}
        for r in results:
            if r.trace == tname:
                by_pol.setdefault(r.policy, []).append(r)
        for pol, rs in by_pol.items():
            rs.sort(key=lambda r: r.capacity_fraction)
            label = f"{pol} (offline bound)" if rs[0].offline else pol
            ax.plot([100 * r.capacity_fraction for r in rs], [r.prefix_hit_ratio for r in rs],
                    marker="o", linestyle="--" if rs[0].offline else "-", label=label,
                    color="black" if rs[0].offline else colour[pol])
        ax.set_xscale("log")
        # Ticks at the measured capacities, in percent: under a decade of range, the log
        # scale's own minor labels read "4x10^1".
        caps = sorted({100 * r.capacity_fraction for r in results if r.trace == tname})
        ax.set_xticks(caps)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.3g}%"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{tname}")
        ax.set_xlabel("cache capacity (% of the trace's unique blocks, log scale)")
        ax.set_ylabel("prefix hit ratio (hit blocks / block references)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")     # curves rise to the right: that corner stays clear
    fig.suptitle("KV-cache prefix hit ratio against capacity, by eviction policy")
    fig.tight_layout()
    return fig

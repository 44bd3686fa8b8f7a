"""The --plot figure of `kvtier bench hit-ratio`: prefix hit ratio against capacity,
one line per policy, one panel per trace (matplotlib, Agg: no display needed)."""
from __future__ import annotations

from typing import Sequence

from kvtier.sim.replay import ReplayResult


def plot(results: Sequence[ReplayResult], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    traces = list(dict.fromkeys(r.trace for r in results))
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
                    marker="o", linestyle="--" if rs[0].offline else "-", label=label)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}%"))
        ax.set_title(f"{tname}")
        ax.set_xlabel("cache capacity (% of the trace's unique blocks, log scale)")
        ax.set_ylabel("prefix hit ratio (hit blocks / block references)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("KV-cache prefix hit ratio against capacity, by eviction policy")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)

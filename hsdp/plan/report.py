"""The planner's outputs: a text table per rate, JSON, and the utilisation-vs-bandwidth plot
(the shape of Streaming DiLoCo's Figure 4, arXiv 2501.18512)."""

from __future__ import annotations

import math
from collections.abc import Callable

from hsdp.plan.model import Prediction


def rate_label(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:g} bit/s"


def human_s(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:.2f} d"
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    return f"{s:.4g} s"


def table(predictions: list[Prediction]) -> str:
    """A markdown table, one row per rate."""
    lines = [
        "| inter rate | step | compute | exposed comm | utilization | sync bytes/step | time to tokens |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in predictions:
        lines.append(
            f"| {rate_label(p.rate_bps)} | {p.step_time_s:.4g} s | {p.compute_s:.4g} s | {p.exposed_comm_s:.4g} s "
            f"| {100 * p.compute_utilization:.1f}% | {p.sync_bytes_per_step / 2**20:.4g} MiB "
            f"| {human_s(p.time_to_tokens_s)} ({p.tokens:.3g} tokens) |"
        )
    return "\n".join(lines)


def plot_utilization(path: str, curves: dict[str, Callable[[float], float]], lo_bps: float, hi_bps: float) -> None:
    """Compute utilisation against inter-link bandwidth (log axis), one curve per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 60
    rates = [lo_bps * (hi_bps / lo_bps) ** (i / (n - 1)) for i in range(n)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, util in curves.items():
        ax.plot([r / 1e9 for r in rates], [100 * util(r) for r in rates], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("inter-replica bandwidth (Gbit/s)")
    ax.set_ylabel("compute utilization (%)")
    ax.set_ylim(0, 100 + math.ulp(100))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

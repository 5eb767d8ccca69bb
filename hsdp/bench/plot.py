"""Val-loss plots of run folders (PNGs): vs tokens, vs sync bytes, vs training wall-clock; the Pareto plot.

matplotlib is the optional `plot` extra (`pip install -e ".[plot]"`) and is imported only
inside these functions, so nothing else of hsdp needs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from hsdp.bench.analysis import target_at, target_losses
from hsdp.bench.plan import LinkPlan
from hsdp.bench.records import LinkRun, read_metrics, wall_clock

PLOTS = ("tokens", "sync_bytes", "wall")
LABELS = {
    "tokens": "tokens",
    "sync_bytes": "sync bytes sent per rank (log scale)",
    "wall": "training time, s (Σ step_time_s, evals excluded)",
}

Curve = list[tuple[float, float]]  # (x, val loss) at each eval


def require_matplotlib() -> None:
    """Raise ImportError now if matplotlib is missing (before the runs, not after them)."""
    import matplotlib  # noqa: F401


def curves_of(run_dirs: Mapping[str, Path]) -> tuple[dict[str, dict[str, Curve]], list[str]]:
    """Each run's val-loss curves by x-axis (runs without evals left out), and the runs without a wall-clock."""
    curves: dict[str, dict[str, Curve]] = {}
    no_wall: list[str] = []
    for run, run_dir in run_dirs.items():
        steps = read_metrics(run_dir)
        evals = [(s, s.val_loss) for s in steps if s.val_loss is not None]  # (step, its val loss)
        if not evals:
            continue
        wall = wall_clock(steps)
        if wall is None:
            no_wall.append(run)
        curves[run] = {
            "tokens": [(s.tokens, loss) for s, loss in evals],
            "sync_bytes": [(s.sync_bytes, loss) for s, loss in evals if s.sync_bytes > 0],
            "wall": [(wall[s.step], loss) for s, loss in evals] if wall else [],
        }
    return curves, no_wall


def plot_runs(
    run_dirs: Mapping[str, Path], out_dir: Path, prefix: str, title: str = "", target: Optional[float] = None
) -> list[Path]:
    """Val-loss curves of run folders → `<out_dir>/<prefix>-{tokens,sync_bytes,wall}.png`; the paths written.

    From each run's metrics.jsonl, the val loss at its evals against: tokens; sync bytes sent per
    rank so far (log x; evals before the first sync, at 0 bytes, have no point); training
    wall-clock = cumulative `step_time_s`, which excludes evals and is complete only when every
    step was logged (`run.log_every=1`): other runs get no wall-clock curve and are named on
    stdout. `target` (a val loss) is drawn as a dashed line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves, no_wall = curves_of(run_dirs)
    if no_wall:
        print(
            f"note: no wall-clock curve for {', '.join(no_wall)} (not every step in metrics.jsonl; set run.log_every=1)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in PLOTS:
        if not any(c[kind] for c in curves.values()):
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for run, c in curves.items():
            if not c[kind]:
                continue
            xs, ys = zip(*c[kind])
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=run)
            ax.plot(xs[-1], ys[-1], marker="o", markersize=7, color=line.get_color())  # where the run ended
        if target is not None:
            ax.axhline(target, color="0.4", linestyle="--", linewidth=1, label=f"target {target:.4f}")
        if kind == "sync_bytes":
            ax.set_xscale("log")
        ax.set_xlabel(LABELS[kind])
        ax.set_ylabel("val loss")
        ax.set_title(title or prefix, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}-{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    ends = {run: c["sync_bytes"][-1] for run, c in curves.items() if c["sync_bytes"]}
    if ends:
        written.append(plot_pareto(ends, out_dir / f"{prefix}-pareto.png", title or prefix, target))
    return written


def pareto_front(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """The runs no other run beats on both axes (fewer bytes and lower loss), cheapest first."""
    front, best = [], float("inf")
    for run, (_, loss) in sorted(points.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if loss < best:
            front.append(run)
            best = loss
    return front


def plot_pareto(
    points: Mapping[str, tuple[float, float]], path: Path, title: str, target: Optional[float] = None
) -> Path:
    """Each run's final val loss against its total sync bytes per rank (log x), the Pareto front joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for run, (x, y) in points.items():
        ax.plot(x, y, marker="o", markersize=6)
        ax.annotate(run, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    front = pareto_front(points)
    xs, ys = [points[r][0] for r in front], [points[r][1] for r in front]
    ax.plot(xs, ys, color="0.3", linewidth=1, label="Pareto front")
    if target is not None:
        ax.axhline(target, color="0.4", linestyle="--", linewidth=1, label=f"target {target:.4f}")
    ax.set_xscale("log")
    ax.set_xlabel("sync bytes sent per rank, whole run (log scale)")
    ax.set_ylabel("final val loss")
    ax.set_title(f"{title}: final val loss vs sync bytes", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rates(plan: LinkPlan, runs: Sequence[LinkRun]) -> list[Path]:
    """The slow-link benchmark's plots: one set per rate (`<out>/<name>-<rate>-*.png`), the target as a line."""
    targets = target_losses(plan, runs)
    written = []
    for label, bps in plan.rates:
        dirs = {r.run: r.dir for r in runs if r.rate == label and r.ok}
        if not dirs:
            continue
        link = "an unshaped veth" if bps is None else f"a {bps / 1e6:g} Mbit/s link"
        title = f"{plan.name}: {plan.mesh[0]}×{plan.mesh[1]} (nodes × ranks) over {link}"
        written += plot_runs(dirs, plan.out, f"{plan.name}-{label}", title=title, target=target_at(label, targets))
    return written

"""Cold and warm compile time against depth: hsdp compiled (regional and not) and FSDP2 compiled.

    python scripts/compile_depth.py [--layers 2,4,8,16] [--steps 20] [--mesh 2x2] [--job exact|diloco]
                                    [--engines ...] [--out runs/compile-depth]

Each (engine, depth) is the tiny job (configs/tiny.yaml, exact HSDP) run twice on its own empty inductor
cache folder: the first run compiles every graph (cold), the second loads them (warm). A fresh folder per
run keeps one depth's compiled kernels (the blocks are the same at every depth) from warming the next.
--job diloco runs tiny.yaml's own schedule instead (a grad-sync warmup, then DiLoCo), shortened: the step
scope compiles one graph pair per reduce variant, so twice there (FSDP2 cannot run it: hsdp engines only).
Prints compile_time_s (each engine's first compiled call less its second: hsdp.engines.clock), the
median step and the whole run's wall time, and each hsdp run's cold compile ÷ FSDP2's at that depth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINES = {
    "hsdp regional": ["mesh.engine=hsdp", "compile.scope=step", "compile.regional=true"],  # the step one graph
    "hsdp inlined": ["mesh.engine=hsdp", "compile.scope=step", "compile.regional=false"],
    "fsdp2": ["mesh.engine=fsdp2"],
    "hsdp none": ["mesh.engine=hsdp", "compile.scope=step", "compile.passes=none"],  # the traced order
    "hsdp blocks": ["mesh.engine=hsdp", "compile.scope=blocks"],  # the default: each block, collectives eager
}
DEFAULT_ENGINES = ["hsdp blocks", "hsdp regional", "fsdp2"]
RUN = [
    "run.checkpoint_every=0",
    "run.eval_every=0",
    "wandb.mode=disabled",
    "compile.enabled=true",
    "compile.passes=ours",
    "compile.prefetch=1",
]  # every job's; an engine's overrides come after these
JOBS = {
    "exact": ["sync.warmup_steps=null", "sync.method=average", "sync.every=1", *RUN],  # grads averaged every step
    # tiny.yaml's schedule, shortened: 8 warmup steps syncing grads, then a DiLoCo round every 4 steps
    "diloco": ["sync.warmup_steps=8", "sync.method=diloco", "sync.every=4", *RUN],
}


def train(out: Path, name: str, overrides: list[str], cache: Path) -> dict:
    """One train.py run on inductor cache folder `cache`: its summary.json plus its wall time."""
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny.yaml")]
    for o in [*overrides, f"run.out_dir={out}", f"run.name={name}", "run.overwrite=true", "run.resume=never"]:
        cmd += ["--set", o]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "HSDP_NO_BAR": "1", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads((out / name / "summary.json").read_text()), "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,4,8,16", help="comma-separated model.n_layer values")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mesh", default="2x2", help="SYNCxSHARD (1x1: one process)")
    p.add_argument("--job", choices=tuple(JOBS), default="exact", help="exact HSDP, or warmup + DiLoCo")
    p.add_argument(
        "--engines",
        help=f"comma-separated, of {', '.join(ENGINES)} (default: {', '.join(DEFAULT_ENGINES)}; no fsdp2 "
        "with --job diloco)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/compile-depth"))
    args = p.parse_args()
    sync, shard = args.mesh.split("x")
    base = [*JOBS[args.job], f"run.steps={args.steps}", f"mesh.sync={sync}", f"mesh.shard={shard}"]
    if args.engines is None:  # FSDP2 runs no periodic sync
        args.engines = ",".join(e for e in DEFAULT_ENGINES if args.job == "exact" or e != "fsdp2")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    if args.job == "diloco" and "fsdp2" in engines:
        raise SystemExit("--job diloco: fsdp2 cannot run periodic syncs; leave it out of --engines")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n_layer in [int(x) for x in args.layers.split(",")]:
        for engine in engines:
            overrides = [*base, f"model.n_layer={n_layer}", *ENGINES[engine]]
            tag = f"{engine.replace(' ', '-')}-L{n_layer}"
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                cold = train(args.out, f"{tag}-cold", overrides, Path(cache))
                warm = train(args.out, f"{tag}-warm", overrides, Path(cache))
            row = {"engine": engine, "n_layer": n_layer, "cold": cold, "warm": warm}
            rows.append(row)
            print(
                f"{engine:14s} L={n_layer:<3d} cold {cold['compile_time_s']:6.2f} s"
                f"  warm {warm['compile_time_s']:5.2f} s  median step {cold['median_step_time_s']:.3f} s"
                f"  wall {cold['wall_s']:.1f} s",
                flush=True,
            )
    (args.out / "compile_depth.json").write_text(json.dumps(rows, indent=1, default=str))
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """The markdown table: per depth and engine, cold/warm compile, ratio to FSDP2's cold, step, wall."""
    fsdp = {r["n_layer"]: r["cold"]["compile_time_s"] for r in rows if r["engine"] == "fsdp2"}
    fsdp_step = {r["n_layer"]: r["cold"]["median_step_time_s"] for r in rows if r["engine"] == "fsdp2"}
    out = [
        "| n_layer | engine | cold compile | ÷ FSDP2 | warm compile | median step | ÷ FSDP2 | cold run wall |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cold, warm, L = r["cold"], r["warm"], r["n_layer"]
        ratio = f"{cold['compile_time_s'] / fsdp[L]:.2f}×" if L in fsdp else "–"
        step_ratio = f"{cold['median_step_time_s'] / fsdp_step[L]:.2f}×" if L in fsdp_step else "–"
        out.append(
            f"| {L} | {r['engine']} | {cold['compile_time_s']:.2f} s | {ratio} | {warm['compile_time_s']:.2f} s"
            f" | {cold['median_step_time_s']:.3f} s | {step_ratio} | {cold['wall_s']:.1f} s |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())

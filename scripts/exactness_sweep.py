"""The exactness property run wide: many generated configurations, each trained by every path that must agree.

    python scripts/exactness_sweep.py --seed 62 --eager 24 --compiled 16 [--record runs/exactness.jsonl]

Runs tests/test_exactness.py's two properties (tests/exactness.py: compiled ≡ eager in both scopes, sharded ≡
unsharded, fsdp2 and ddp ≡ hsdp) with Hypothesis's seed and these example counts instead of the suite's small
budget, each case's gaps appended to the record, then prints the summary that docs/results/exactness.md keeps:
configurations tried, and per path the worst relative difference (per step's loss and per param) and its case.
Exits 1 if any case failed (pytest's report names it, shrunk by Hypothesis).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_properties(seed: int, eager: int, compiled: int, record: Path) -> int:
    """pytest on the two properties with the wide budget; its exit code."""
    env = {
        **os.environ,
        "HSDP_EXACTNESS_EAGER": str(eager),
        "HSDP_EXACTNESS_COMPILED": str(compiled),
        "HSDP_EXACTNESS_RECORD": str(record),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_exactness.py", "-k", "generated or agree"]
    cmd += [f"--hypothesis-seed={seed}", "-p", "no:cacheprovider"]
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def summarize(record: Path) -> str:
    """Markdown: how many configurations, and per path its worst gap with the case that gave it."""
    rows = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    worst: dict[str, tuple[float, dict]] = {}
    for row in rows:
        for path, gap in row["gaps"].items():
            if path not in worst or gap > worst[path][0]:
                worst[path] = (gap, row["case"])
    compiled = sum(1 for r in rows if "step" in r["gaps"])
    lines = [
        f"{len(rows)} configurations ({compiled} with both compile scopes), "
        f"{sum(len(r['gaps']) for r in rows)} comparisons against eager hsdp",
        "",
        "| path | cases | worst relative difference | its case |",
        "|---|---:|---:|---|",
    ]
    for path, (gap, case) in sorted(worst.items()):
        n = sum(1 for r in rows if path in r["gaps"])
        shape = ", ".join(f"{k}={v}" for k, v in case.items())
        lines.append(f"| {path} | {n} | {gap:.2e} | {shape} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--seed", type=int, default=62, help="Hypothesis's seed (the draw of configurations)")
    p.add_argument("--eager", type=int, default=24, help="configurations for sharded/unsharded/engines")
    p.add_argument("--compiled", type=int, default=16, help="configurations for compiled vs eager (both scopes)")
    p.add_argument("--record", type=Path, default=Path("runs/exactness.jsonl"), help="each case's gaps (JSONL)")
    args = p.parse_args()
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.unlink(missing_ok=True)
    t0 = time.perf_counter()
    code = run_properties(args.seed, args.eager, args.compiled, args.record.resolve())
    if args.record.is_file():
        print(summarize(args.record))
    print(f"seed {args.seed}, {time.perf_counter() - t0:.0f} s, pytest exit {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""summary.md and summary.json of scripts/gpu_check.sh, from its work folder; every check PASS/FAIL/SKIP.

    python scripts/gpu_summary.py WORK OUT [--mode gpu|cpu] [--quiet]

WORK (what gpu_check.sh leaves, outside $OUT): env.txt, stages.jsonl (one line a stage: its exit code,
seconds and time limit, or why it was skipped), parity.json (tests/test_cuda_parity.py's measurements),
bench.md (python -m kernels.bench's table), runs/<name>/{summary.json, metrics.jsonl}. OUT gets the two
files; nothing else is written. Reads JSON and text only (no torch), so it runs in a fraction of a second:
gpu_check.sh calls it after every stage, and what a stage that ran out of time left is summarized too.

The checks and their bounds (a check whose stage did not run is SKIP; `--mode cpu`, a smoke run of the
script's plumbing on a CPU box, reports the GPU-only bounds as SKIP):

(a) parity     tests/test_cuda_parity.py passes: each kernel bitwise its CPU reference, and bitwise or within
               its stated bound of the reference on the GPU.
(b) bench      the device's copy bandwidth >= COPY_MIN_GBS, and each dense streaming kernel (DENSE: those
               kernels/registry.py marks dense) reaches >= DENSE_MIN_OF_COPY of it (the payload and top-k
               kernels are reported without a bound).
(c) runs       each gpu-124m run finishes with a finite loss; its summary's tokens_per_s is tokens_per_step /
               the median of its metrics' step times (STEADY_REL), below its wall_tokens_per_s never; the
               compiled runs report compile_time_s > 0 and no recompiles, hsdp compiled (the default
               compile.scope=blocks) also one dynamo graph for every block and the eval; hsdp compiled's
               steady MFU >= MFU_MIN and its steady rate >= COMPILED_VS_EAGER of hsdp eager's.
(d) engine     kernels.backend=triton vs torch, losses step by step: fp32 params, unquantized DiLoCo within
               ENGINE_FP32 (bitwise expected); bf16 params, int8 DiLoCo within ENGINE_BF16 (see gpu_check.sh).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Optional


def _kernel_registry() -> Any:
    """kernels/registry.py, read on its own (standard library only): the package would import torch."""
    spec = importlib.util.spec_from_file_location(
        "_kernel_registry", Path(__file__).resolve().parents[1] / "kernels" / "registry.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


COPY_MIN_GBS = 3500.0  # an H200 copies ~4.2-4.3 TB/s (read + write); below this the device is not itself
DENSE = _kernel_registry().dense_names()  # the bench's streaming kernels, held to DENSE_MIN_OF_COPY
DENSE_MIN_OF_COPY = 0.5  # streaming kernels of a 7b unit (25M elements, 50-300 MB): at least half the copy
STEADY_REL = 1e-9  # the summary's steady rate vs the metrics' step times (both from the same floats)
# hsdp compiled, gpu-124m, one H200: a steady MFU far above the whole-run figure's 0.0182 (the step scope then
# reached 0.28, and eager ran at half its rate; the blocks scope, the default now, is unmeasured on a GPU)
MFU_MIN = 0.10
COMPILED_VS_EAGER = 0.9  # hsdp compiled's steady rate at least this fraction of hsdp eager's
ENGINE_FP32 = 1e-6  # max relative loss difference, fp32 params, no quantization
ENGINE_BF16 = 2.0**-6  # max relative loss difference, bf16 params, int8 DiLoCo

# gpu-124m, in the table's order (c-hsdp-compiled: the default compile.scope=blocks; c-hsdp-step: the whole step
# one graph, run last, skipped when time is short)
C_RUNS = ("c-hsdp-compiled", "c-fsdp2-compiled", "c-hsdp-eager", "c-hsdp-step")
D_PAIRS = {  # engine check: pair -> (triton run, torch run, bound, what)
    "fp32": ("d-fp32-triton", "d-fp32-torch", ENGINE_FP32, "fp32 params, DiLoCo unquantized"),
    "bf16-int8": ("d-bf16-int8-triton", "d-bf16-int8-torch", ENGINE_BF16, "bf16 params, int8 DiLoCo"),
}


# ----------------------------------------------------------------------------- reading the work folder


def read_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_records(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's whole records (a torn last line, from a run killed mid-write, is left out)."""
    records = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def read_stages(work: Path) -> dict[str, dict[str, Any]]:
    stages = {}
    for record in read_records(work / "stages.jsonl"):
        stages[record["stage"]] = record
    return stages


def parse_bench(text: str) -> dict[str, Any]:
    """kernels.bench's output: the device line's copy bandwidth and the table's rows (column name -> cell)."""
    copy = re.search(r"copy bandwidth ([\d.,]+) GB/s", text)
    device = re.search(r"^device: ([^;]*)", text, re.MULTILINE)
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(set(c) <= set("-: ") for c in cells):
            rows.append(dict(zip(header, cells)))
    return {
        "device": device.group(1).strip() if device else None,
        "copy_gbs": float(copy.group(1).replace(",", "")) if copy else None,
        "rows": rows,
    }


def _number(cell: Optional[str]) -> Optional[float]:
    m = re.match(r"^[\s]*([-\d.,]+)", cell or "")
    try:
        return float(m.group(1).replace(",", "")) if m else None
    except ValueError:
        return None


def steady(summary: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's rates from its metrics' step times (every step logged) and its summary: the steady rate as
    summary.json defines it, recomputed, and the summary's own fields (absent where train.py predates them)."""
    times = [r["step_time_s"] for r in records if isinstance(r.get("step_time_s"), (int, float))]
    steps = summary.get("steps") or len(times) or 1
    per_step = summary.get("tokens_per_step") or (summary.get("tokens") or 0) / steps
    median = statistics.median(times) if times else None
    rate = per_step / median if median else None
    mfu, reported = summary.get("mfu"), summary.get("tokens_per_s")
    if "rate_basis" not in summary and mfu and reported and rate:
        mfu = round(mfu * rate / reported, 4)  # an older summary's mfu is of its whole-run rate: rescaled
    return {
        "steps_logged": len(times),
        "tokens_per_step": per_step,
        "median_step_time_s": median,
        "steady_tokens_per_s": rate,
        "steady_mfu": mfu,
        "summary_tokens_per_s": reported,
        "wall_tokens_per_s": summary.get("wall_tokens_per_s"),
        "wall_mfu": summary.get("wall_mfu"),
        "rate_basis": summary.get("rate_basis"),
    }


def max_rel_diff(a: list[Optional[float]], b: list[Optional[float]]) -> Optional[float]:
    """max |a − b| / |b| over the steps both have (None if a loss is missing or not finite)."""
    pairs = list(zip(a, b))
    if not pairs or any(x is None or y is None or not math.isfinite(x) or not math.isfinite(y) for x, y in pairs):
        return None
    return max(abs(x - y) / abs(y) if y else (0.0 if x == y else math.inf) for x, y in pairs)


# ----------------------------------------------------------------------------- the checks


class Checks:
    def __init__(self, mode: str, stages: dict[str, dict[str, Any]]) -> None:
        self.mode, self.stages, self.rows = mode, stages, []

    def add(self, check: str, bound: str, value: Any, ok: Optional[bool], why: str = "") -> None:
        """ok None: SKIP (with `why`)."""
        status = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        self.rows.append({"check": check, "bound": bound, "value": value, "status": status, "note": why})

    def stage_missing(self, stage: str) -> Optional[str]:
        """Why a stage's outputs are missing: it was skipped, failed or timed out (None: it ran and passed)."""
        s = self.stages.get(stage)
        if s is None:
            return "not run"
        if s.get("skipped"):
            return f"skipped: {s['skipped']}"
        if s.get("rc") in (124, 137):
            return f"timed out after {s.get('seconds')} s (limit {s.get('limit_s')} s)"
        if s.get("rc"):
            return f"exit code {s['rc']}"
        return None

    def gpu_only(self, check: str, bound: str, value: Any, ok: Optional[bool]) -> None:
        if self.mode == "cpu":
            self.add(check, bound, value, None, "cpu smoke run: a GPU bound")
        else:
            self.add(check, bound, value, ok)


def _absent(why: Optional[str]) -> Optional[bool]:
    """A check whose input is missing: SKIP (None) if its stage was skipped or never reached, else FAIL."""
    return None if why is not None and why.startswith(("skipped", "not run")) else False


def check_parity(c: Checks, parity: Optional[dict[str, Any]]) -> None:
    name, bound = "(a) Triton kernels vs torch references", "bitwise vs CPU ref; vs GPU ref bitwise or its bound"
    why = c.stage_missing("parity")
    if parity is None:
        if why is None and c.mode == "cpu":
            c.add(name, bound, "no CUDA: the GPU tests skipped", None, "cpu smoke run")
        else:
            c.add(name, bound, None, _absent(why), why or "no parity.json")
        return
    bad = [k for k, row in parity["kernels"].items() if not row["ok"]]
    value = f"{len(parity['kernels']) - len(bad)}/{len(parity['kernels'])} kernels" + (f"; off: {bad}" if bad else "")
    c.add(name, bound, value, not bad and why is None, why or "")


def check_bench(c: Checks, bench: Optional[dict[str, Any]]) -> None:
    why = c.stage_missing("bench")
    copy = bench["copy_gbs"] if bench else None
    name, bound = "(b) copy bandwidth", f">= {COPY_MIN_GBS:.0f} GB/s"
    if not copy:
        c.add(name, bound, None, _absent(why), why or "no copy bandwidth in bench.md")
        return
    c.gpu_only(name, bound, f"{copy:.0f} GB/s", copy >= COPY_MIN_GBS)
    rows = {r.get("kernel"): r for r in bench["rows"]} if bench else {}
    gbs = {k: _number(rows[k].get("GB/s")) for k in DENSE if k in rows}
    fracs = {k: v / copy for k, v in gbs.items() if v is not None}
    missing = [k for k in DENSE if k not in fracs]
    worst = min(fracs, key=lambda k: fracs[k]) if fracs else None
    value = f"lowest: {worst} {fracs[worst]:.0%}" if worst else "no rows"
    if missing:
        value += f"; missing: {missing}"
    ok = worst is not None and not missing and fracs[worst] >= DENSE_MIN_OF_COPY and why is None
    c.gpu_only(f"(b) dense kernels' bandwidth ({len(DENSE)})", f">= {DENSE_MIN_OF_COPY:.0%} of copy", value, ok)


def check_runs(c: Checks, runs: dict[str, dict[str, Any]]) -> None:
    for name in C_RUNS:
        run = runs.get(name)
        why = c.stage_missing(name)
        if run is None or run["summary"] is None:
            c.add(f"(c) {name} finishes", "summary.json, finite loss", None, _absent(why), why or "no summary.json")
            continue
        s, st = run["summary"], run["steady"]
        loss = s.get("final_loss")
        c.add(f"(c) {name} finishes", "summary.json, finite loss", loss, loss is not None and math.isfinite(loss))
        if "rate_basis" not in s:
            c.add(f"(c) {name} steady rate in summary.json", "fields of run_rates", "absent", False, "old train.py")
        else:
            expect, got, wall = st["steady_tokens_per_s"], s.get("tokens_per_s"), s.get("wall_tokens_per_s") or 0.0
            rel = abs(got - expect) / expect if got and expect else None
            value = None if rel is None else f"rel {rel:.1e}; steady {got:,.0f}, wall {wall:,.0f}"
            ok = rel is not None and rel <= STEADY_REL and 0 < wall <= got
            c.add(f"(c) {name} tokens_per_s = tokens/step ÷ median step", f"rel ≤ {STEADY_REL:g}, wall ≤ it", value, ok)
        if name == "c-hsdp-compiled":  # compile.scope=blocks: compiled at all, once for every block and eval
            ct, rc, g, g_all = (
                s.get(k) for k in ("compile_time_s", "recompiles", "dynamo_graphs", "dynamo_graphs_all")
            )
            ok = bool(ct) and rc == 0 and g == 1 and g_all == 1
            c.add(
                f"(c) {name} compile clock",
                "compile_time_s > 0, 0 recompiles, 1 dynamo graph in the run",
                f"{ct} s, {rc}, {g} / {g_all}",
                ok,
            )
        elif name != "c-hsdp-eager":  # every other run compiles
            ct, rc = s.get("compile_time_s"), s.get("recompiles")
            ok = bool(ct) and rc == 0
            c.add(f"(c) {name} compile clock", "compile_time_s > 0, 0 recompiles", f"{ct} s, {rc}", ok)
    hc, he = runs.get("c-hsdp-compiled"), runs.get("c-hsdp-eager")
    if hc and hc["summary"]:
        mfu = hc["steady"]["steady_mfu"]
        c.gpu_only("(c) hsdp compiled steady MFU", f">= {MFU_MIN}", mfu, mfu is not None and mfu >= MFU_MIN)
    if hc and he and hc["summary"] and he["summary"]:
        a, b = hc["steady"]["steady_tokens_per_s"], he["steady"]["steady_tokens_per_s"]
        ratio = a / b if a and b else None
        c.gpu_only(
            "(c) hsdp compiled vs eager, steady tokens/s",
            f">= {COMPILED_VS_EAGER}×",
            None if ratio is None else f"{ratio:.2f}×",
            ratio is not None and ratio >= COMPILED_VS_EAGER,
        )


def check_engine(c: Checks, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for pair, (tri, ref, bound, what) in D_PAIRS.items():
        a, b = runs.get(tri), runs.get(ref)
        name = f"(d) engine triton vs torch, {what}"
        if not (a and b and a["records"] and b["records"]):
            why = c.stage_missing(tri) or c.stage_missing(ref)
            c.add(name, f"max rel loss diff ≤ {bound:.3g}", None, _absent(why), why or "no metrics")
            continue
        la = [r.get("loss") for r in a["records"]]
        lb = [r.get("loss") for r in b["records"]]
        err = max_rel_diff(la, lb)
        same = la == lb
        out[pair] = {"steps": min(len(la), len(lb)), "max_rel_loss_diff": err, "bitwise": same, "bound": bound}
        value = "bitwise equal" if same else (None if err is None else f"{err:.2e}")
        why = c.stage_missing(tri) or c.stage_missing(ref)  # a run cut short compares only its first steps
        ok = err is not None and err <= bound and len(la) == len(lb) and why is None
        c.add(name, f"max rel loss diff ≤ {bound:.3g}", value, ok, why or "")
    return out


# ----------------------------------------------------------------------------- summary.md


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and spec:
        return format(v, spec)
    return str(v)


def _diffs(rows: list[dict[str, Any]]) -> str:
    """A parity cell: per output, '=' (bitwise), the code difference, or the largest relative difference."""
    parts = []
    for r in rows:
        if r["equal"]:
            parts.append(f"{r['output']}: =")
        elif "code_fraction" in r:
            parts.append(f"{r['output']}: ±{r['max_code_diff']} in {r['code_fraction']:.1e}")
        else:
            parts.append(f"{r['output']}: rel {r.get('max_rel', math.nan):.1e}")
    return ", ".join(parts)


def render(summary: dict[str, Any], bench_text: str) -> str:
    lines = [f"# GPU check: {summary['result']}", ""]
    lines += [f"- {line}" for line in summary["env"]]
    lines += [f"- mode: {summary['mode']}; stages took {summary['seconds']:.0f} s", ""]
    lines += ["## Checks", "", "| check | bound | measured | result |", "|---|---|---|---|"]
    for r in summary["checks"]:
        note = f" ({r['note']})" if r["note"] else ""
        lines.append(f"| {r['check']} | {r['bound']} | {_fmt(r['value'])} | {r['status']}{note} |")
    parity = summary.get("parity")
    lines += ["", "## (a) Triton kernels vs their torch references (tests/test_cuda_parity.py)", ""]
    if parity:
        lines += [f"{parity['device']}, torch {parity['torch']}, triton {parity['triton']}.", ""]
        lines += [
            "| kernel | elements | vs CPU ref | vs GPU ref | bound vs GPU ref | ok |",
            "|---|---:|---|---|---|---|",
        ]
        for name, k in parity["kernels"].items():
            lines.append(
                f"| {name} | {k['elements']:,} | {_diffs(k['cpu'])} | {_diffs(k['cuda'])} | {k['bound']} | "
                f"{'yes' if k['ok'] else 'NO'} |"
            )
    else:
        lines.append("(no measurements)")
    lines += ["", "## (b) python -m kernels.bench --size 7b", ""]
    lines += [bench_text.strip() or "(no output)"]
    lines += ["", "## (c) gpu-124m, one GPU, 30 steps, synthetic data", ""]
    lines += [
        "Steady: tokens_per_step / the median step time (metrics.jsonl, every step); wall: tokens / the sum of "
        "the step times (compile and warm-up included). MFU: against the dense bf16 peak of hsdp/models/gpt.py.",
        "",
        "| run | steady tok/s | steady MFU | wall tok/s | wall MFU | median step (ms) | compile_time_s | "
        "first call (s) | recompiles | peak MiB | final loss | max rel loss diff vs hsdp eager |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    runs = summary["runs"]
    ref = runs.get("c-hsdp-eager", {}).get("losses")
    for name in C_RUNS:
        run = runs.get(name)
        if not run:
            lines.append(f"| {name} | (did not run) |" + " |" * 11)
            continue
        s, st = run["summary"] or {}, run["steady"]
        diff = max_rel_diff(run["losses"], ref) if ref and name != "c-hsdp-eager" else None
        median = st["median_step_time_s"]
        lines.append(
            f"| {name} | {_fmt(st['steady_tokens_per_s'], ',.0f')} | {_fmt(st['steady_mfu'])} | "
            f"{_fmt(st['wall_tokens_per_s'], ',.0f')} | {_fmt(st['wall_mfu'])} | "
            f"{_fmt(median * 1e3 if median else None, '.1f')} | {_fmt(s.get('compile_time_s'))} | "
            f"{_fmt(s.get('compile_first_call_s'))} | {_fmt(s.get('recompiles'))} | "
            f"{_fmt(s.get('peak_mem_mb'), ',.0f')} | {_fmt(s.get('final_loss'), '.4f')} | {_fmt(diff, '.1e')} |"
        )
    lines += ["", "## (d) Engine on one GPU: kernels.backend=triton vs torch (60 steps, DiLoCo, deterministic)", ""]
    lines += ["| runs | steps | max rel loss diff | bitwise | bound |", "|---|---:|---:|---|---:|"]
    for pair, (_, _, bound, what) in D_PAIRS.items():
        e = summary["engine"].get(pair)
        if e:
            lines.append(
                f"| {what} | {e['steps']} | {_fmt(e['max_rel_loss_diff'], '.2e')} | "
                f"{'yes' if e['bitwise'] else 'no'} | {bound:.3g} |"
            )
        else:
            lines.append(f"| {what} | – | – | – | {bound:.3g} |")
    lines += ["", "## Stages", "", "| stage | exit code | seconds | limit (s) |", "|---|---:|---:|---:|"]
    for s in summary["stages"]:
        rc = f"skipped: {s['skipped']}" if s.get("skipped") else s.get("rc")
        lines.append(f"| {s['stage']} | {rc} | {_fmt(s.get('seconds'))} | {_fmt(s.get('limit_s'))} |")
    return "\n".join(lines) + "\n"


def build(work: Path, mode: str) -> tuple[dict[str, Any], str]:
    stages = read_stages(work)
    env = [line.strip() for line in (work / "env.txt").read_text().splitlines()] if (work / "env.txt").is_file() else []
    parity = read_json(work / "parity.json")
    bench_text = (work / "bench.md").read_text() if (work / "bench.md").is_file() else ""
    bench = parse_bench(bench_text) if bench_text else None
    runs: dict[str, dict[str, Any]] = {}
    for folder in sorted((work / "runs").glob("*")) if (work / "runs").is_dir() else []:
        summary = read_json(folder / "summary.json")
        records = read_records(folder / "metrics.jsonl")
        runs[folder.name] = {
            "summary": summary,
            "records": records,
            "losses": [r.get("loss") for r in records],
            "steady": steady(summary or {}, records),
        }
    c = Checks(mode, stages)
    check_parity(c, parity)
    check_bench(c, bench)
    check_runs(c, runs)
    engine = check_engine(c, runs)
    statuses = {r["status"] for r in c.rows}
    result = "FAIL" if "FAIL" in statuses else "INCOMPLETE" if "SKIP" in statuses and mode == "gpu" else "PASS"
    keep = ("final_loss", "tokens", "steps", "median_step_time_s", "peak_mem_mb", "step_alloc_peak_mb")
    keep += ("compile_time_s", "compile_first_call_s", "recompiles", "compile_graphs", "engine", "flops_per_token")
    keep += ("dynamo_graphs", "dynamo_graphs_all")
    keep += ("tokens_per_s", "wall_tokens_per_s", "mfu", "wall_mfu", "rate_basis", "tokens_per_step")
    summary = {
        "result": result,
        "mode": mode,
        "env": env,
        "seconds": sum(s.get("seconds") or 0 for s in stages.values()),
        "checks": c.rows,
        "parity": parity,
        "bench": bench,
        "runs": {
            name: {
                "summary": {k: (r["summary"] or {}).get(k) for k in keep},
                "steady": r["steady"],
                "losses": r["losses"],
            }
            for name, r in runs.items()
        },
        "engine": engine,
        "stages": list(stages.values()),
    }
    return summary, render(summary, bench_text)


def finite(obj: Any) -> Any:
    """obj with every non-finite float as its name ("inf", "nan"): JSON has no such numbers."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--mode", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--quiet", action="store_true", help="write the two files, print nothing")
    args = p.parse_args(argv)
    summary, text = build(args.work, args.mode)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(finite(summary), indent=1, allow_nan=False, default=str) + "\n")
    (args.out / "summary.md").write_text(text)
    if not args.quiet:
        for r in summary["checks"]:
            note = f"  [{r['note']}]" if r["note"] else ""
            print(f"{r['status']:4}  {r['check']}: {_fmt(r['value'])} (bound: {r['bound']}){note}")
        print(f"gpu_check: {summary['result']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

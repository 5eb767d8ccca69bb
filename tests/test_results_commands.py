"""Every command a docs/results/*.md page shows is run by a test, so none goes stale.

Each page's commands are read from its code spans and code blocks (fenced or indented) that call python, in page
order, and each is handled by the first rule that fits it (`RULES`); a command no rule fits fails
`test_every_results_command_has_a_rule`. The results themselves took minutes to hours (sweeps, the slow-link
benchmark as root, compile campaigns, 600-step jobs); here each command is, by kind:

- run, shortened (a second to nine each; about 25 s in all): `train.py` jobs (SHORT_STEPS steps of 2 sequences
  per rank in one worker, evaluated once, the config's warmup / sync / checkpoint cycle shrunk with it where it
  has one; memory.md's 2-step 1×4 job as written), `hsdp.prepare` (one stdlib package, not all of it),
  `hsdp.plan` (given its compute, `--compute-s`, and the shard group free where it would measure them with
  worker processes; `--for-utilization`'s fractions checked, its search left to tests/test_plan.py: seconds a
  fraction at H=100), `hsdp.plan.goodput` (as written; `--validate` on a stand-in slowlink.json at the page's
  path), the `STD=$(...)` shell line and `scripts/bpe_vs_bytes.py` (on the shortened runs);
- checked, not run (they take minutes to an hour, or need root and network namespaces): `hsdp.sweep` (its
  plan: the sweep file, `--only`, every run's config loaded and checked against this machine, as the sweep
  does before it runs anything), `hsdp.slowlink` (its plan: the spec and flags, every run's config checked),
  `hsdp.plan.validate` (its flags and both runs' configs), the scripts (their arguments parsed by the
  script's own argparse, in one interpreter for all of them: compile and stress campaigns, the elastic
  benchmarks, the loss-at-time table of slow-link runs), `kernels.bench` (its arguments), a `train.py`
  job that needs what the page describes around it (a compile run meant to fail; the gpt / llama
  placeholder, expanded) (its config loaded), pytest invocations (the test files and `-k` names exist: the
  suite runs them), and `tests/test_torchft_parity.py table OUT` (the script starts from the repository
  root and prints its usage; the suite runs the same table as `test_final_params_match_torchft_diloco`);
- covered elsewhere: a command the README shows too (tests/test_readme_commands.py runs those on a fresh
  clone);
- not a command: REFERENCES, a page's mention of a tool in prose or an abbreviation of a command written out
  nearby, each with why (and `test_the_rules_name_only_what_the_pages_show` keeps the list to what the
  pages still say).

Paths under /tmp/ a command names are moved into the test's workspace, whose `configs` and `scripts` are the
repository's; a relative `runs/`, `docs/` is the workspace's too (a plot never overwrites docs/).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from hsdp.config.loader import load_config
from tests.helpers import QUIET_ENV, REPO, run_train
from tests.test_docs import CODE_BLOCK, CODE_SPAN
from tests.test_readme_commands import README, readme_commands

RESULTS = REPO / "docs" / "results"
SHORT_STEPS = 8
WARMUP, EVERY, CHECKPOINT = 4, 2, 4  # a shortened run's warmup, sync period and checkpoint interval
SHORT = ["data.batch_size=2", "run.eval_every=0", "run.eval_batches=1"]
ONE_WORKER = ["mesh.sync=1", "mesh.shard=1"]  # a shortened run's mesh: each worker costs seconds of CPU
STDLIB_PACKAGE = "email"  # hsdp.prepare reads this package of the stdlib (0.4 MB), not all of it (31 MB)
COMPUTE_S = "0.2"  # hsdp.plan's compute, given (the tiny job's step; tests/test_plan.py measures it)

# A page's mention of a tool, or an abbreviation of a command it writes out in full nearby: not a command.
REFERENCES: dict[str, str] = {
    "python -m hsdp.plan": "prose: the planner named (plan.md)",
    "python -m hsdp.slowlink": "prose: plan.md's validation runs the slow-link benchmark",
    "python train.py": "prose: suite.md names the training script",
    "python -m hsdp.plan ... --gpu H100 --mfu 0.4 --for-utilization ...": "the 10B llama plan, in full below it",
    "python -m hsdp.sweep configs/ablations/sparseloco-target.yaml --only …": "the runs are listed after it",
    "python -m pytest -q tests/<module>": "a placeholder: any test module",
    "python -c 'while True: pass'": "the CPU load a suite measurement ran beside (it never ends)",
    "ruff check . && ruff format --check . && python -m pytest -q -n 3 --dist loadfile": "the suite itself",
    "python -m pytest -q -n 3 --dist loadfile --durations=50": "the suite itself, listing its longest items",
}
# The gpt vs llama runs of tiny-bpe.md: ARCH and B as the page says (B = true for gpt, false for llama).
ARCH_RUNS = {"gpt": "true", "llama": "false"}


# ----------------------------------------------------------------------------- the pages' commands
def _block_commands(body: str) -> list[str]:
    """A code block's commands: its lines, a line continued by a trailing backslash or by the next line's deeper
    indent joined into one."""
    commands: list[str] = []
    indent, continued = None, False
    for line in body.splitlines():
        if not line.strip() or line.strip().startswith("#"):
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if commands and (continued or depth > indent):
            commands[-1] += " " + line.strip()
        else:
            commands.append(line.strip())
        continued = commands[-1].endswith("\\")
        commands[-1] = commands[-1].removesuffix("\\").rstrip()
    return [" ".join(c.split()) for c in commands]


def page_commands(text: str) -> list[str]:
    """The commands of a page, in page order, each once: code spans and blocks (fenced, or indented four spaces
    after a blank line) that call python."""
    found: list[tuple[int, str]] = []
    for m in CODE_BLOCK.finditer(text):
        body = "\n".join(m.group(0).splitlines()[1:-1])
        found += [(m.start(), c) for c in _block_commands(body) if re.search(r"\bpython\b", c)]
    rest = CODE_BLOCK.sub(lambda m: " " * len(m.group(0)), text)  # offsets kept
    lines, at = rest.splitlines(keepends=True), 0
    starts = []
    for line in lines:
        starts.append(at)
        at += len(line)
    i = 0
    while i < len(lines):
        blank_before = i == 0 or not lines[i - 1].strip()
        if lines[i].startswith("    ") and lines[i].strip() and blank_before and "`" not in lines[i]:
            j = i
            while j < len(lines) and lines[j].strip() and "`" not in lines[j]:
                j += 1
            body = "".join(lines[i:j])
            if re.search(r"\bpython\b", body):
                found += [(starts[i], c) for c in _block_commands(body)]
                rest = rest[: starts[i]] + " " * len(body) + rest[starts[i] + len(body) :]
            i = j
        else:
            i += 1
    for m in CODE_SPAN.finditer(rest):
        span = " ".join(m.group(0).strip("`").split())
        if re.search(r"\bpython\b", span):
            found.append((m.start(), span))
    return list(dict.fromkeys(c for _, c in sorted(found, key=lambda f: f[0])))


def results_pages() -> list[Path]:
    return sorted(RESULTS.glob("*.md"))


def all_commands() -> list[tuple[str, str]]:
    """(page, command) for every page's every command."""
    return [(p.name, c) for p in results_pages() for c in page_commands(p.read_text("utf-8"))]


def test_page_commands_finds_spans_and_blocks() -> None:
    text = (
        "- **Command:** `python -m hsdp.sweep a.yaml\n  --only x`, then `ruff check`\n\n"
        "```\npython train.py --set a=1 \\\n  --set b=2\n```\n\n"
        "    python -m hsdp.plan c.yaml \\\n      --inter 1gbit\n\n"
        "prose `python -m hsdp.sweep a.yaml --only x` again\n"
    )
    assert page_commands(text) == [
        "python -m hsdp.sweep a.yaml --only x",
        "python train.py --set a=1 --set b=2",
        "python -m hsdp.plan c.yaml --inter 1gbit",
    ]


# ----------------------------------------------------------------------------- the workspace
@dataclass
class Page:
    """What a page's commands share: the workspace, the script parses, and what an earlier command made."""

    name: str
    ws: Path
    monkeypatch: pytest.MonkeyPatch
    scripts: dict[str, dict[str, Any]]
    made: dict[str, Path] = field(default_factory=dict)  # e.g. "prepared": the folder hsdp.prepare wrote


def workspace(root: Path) -> Path:
    """A folder that reads as the repository to a command (configs/, scripts/) and takes its outputs."""
    for name in ("configs", "scripts"):
        (root / name).symlink_to(REPO / name)
    (root / "docs").mkdir()
    return root


def in_ws(arg: str, ws: Path) -> str:
    """A /tmp/ path of a command, moved into the workspace (what the page ran writes there instead)."""
    return str(ws / "tmp" / arg.removeprefix("/tmp/")) if arg.startswith("/tmp/") else arg


def env_and_argv(command: str) -> tuple[dict[str, str], list[str]]:
    """`A=1 B=2 python ...` → ({A: 1, B: 2}, [python, ...])."""
    argv = shlex.split(command)
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    return env, argv


def sets_of(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def flag(argv: list[str], name: str) -> Optional[str]:
    return argv[argv.index(name) + 1] if name in argv else None


# ----------------------------------------------------------------------------- the rules
def run_train_command(command: str, page: Page, extra: Sequence[str] = ()) -> Path:
    """A train.py command, shortened (SHORT_STEPS steps, the config's cycle shrunk alike), run; its run folder."""
    _, argv = env_and_argv(command)
    config, sets = flag(argv, "--config"), [in_ws(s, page.ws) for s in sets_of(argv)] + list(extra)
    cfg = load_config(str(REPO / config) if config else None, sets)
    short = [f"run.steps={min(cfg.run.steps, SHORT_STEPS)}", *SHORT, "wandb.mode=disabled"]
    w = cfg.sync.warmup_steps
    if w is not None and w < cfg.run.steps:  # the cycle: a warmup, then periodic syncs (else all exact, kept)
        short += [f"sync.warmup_steps={min(w, WARMUP)}", f"sync.every={EVERY}"]
    if cfg.run.checkpoint_every:
        short.append(f"run.checkpoint_every={CHECKPOINT}")
    out = Path(cfg.run.out_dir) if Path(cfg.run.out_dir).is_absolute() else page.ws / "runs"
    res = run_train(out, cfg.run.name, [*sets, *short], config=config, timeout=300)
    assert (res.run_dir / "summary.json").is_file(), res.stderr[-3000:]
    return res.run_dir


def rule_train(command: str, page: Page) -> None:
    """A train.py job, shortened, in one worker, with what the page says around it (`PAGE_SETS`)."""
    run_dir = run_train_command(command, page, ONE_WORKER + PAGE_SETS.get(page.name, lambda c, p: [])(command, page))
    if "run.checkpoint_every" in command:  # checkpoints.md: the run keeps its last step's checkpoint
        assert (run_dir / "checkpoints" / f"step_{SHORT_STEPS - 1}" / ".complete").is_file()


def rule_train_as_written(command: str, page: Page) -> None:
    """memory.md's job: 2 steps already; run on its own mesh (1×4), only its run folder moved."""
    _, argv = env_and_argv(command)
    cfg = load_config(None, sets_of(argv))
    res = run_train(page.ws / "runs", cfg.run.name, sets_of(argv), timeout=300)
    assert res.summary["world"] == 4 and res.summary["peak_mem_mb"] > 0


def rule_train_config(command: str, page: Page) -> None:
    """A train.py job that is not run: its config loads (placeholders expanded, as the page says)."""
    _, argv = env_and_argv(command)
    config = flag(argv, "--config")
    variants = [sets_of(argv)]
    if "model.arch=ARCH" in command:
        variants = [
            [s.replace("ARCH", arch).replace("model.bias=B", f"model.bias={bias}") for s in sets_of(argv)]
            for arch, bias in ARCH_RUNS.items()
        ]
    for sets in variants:
        load_config(str(REPO / config) if config else None, sets)


def rule_shell(command: str, page: Page) -> None:
    """`STD=$(python -c ...)`: run by bash; the folder it names exists."""
    script = f'{command} && test -d "$STD" && echo "$STD"'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and Path(proc.stdout.strip()).is_dir(), proc.stderr


def rule_prepare(command: str, page: Page) -> None:
    """hsdp.prepare on one stdlib package ("$STD" narrowed), into the workspace; later runs train on it."""
    std = Path(sysconfig.get_paths()["stdlib"]) / STDLIB_PACKAGE
    _, argv = env_and_argv(command.replace('"$STD"', shlex.quote(str(std))))
    argv = [sys.executable, *(in_ws(a, page.ws) for a in argv[1:])]
    proc = subprocess.run(argv, cwd=page.ws, env={**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO)}, timeout=300)
    out = flag(argv, "--out")
    assert proc.returncode == 0 and out is not None
    page.made["prepared"] = Path(out)
    assert (page.made["prepared"] / "tokenizer.json").is_file()


def rule_bpe_vs_bytes(command: str, page: Page) -> None:
    """scripts/bpe_vs_bytes.py on the page's shortened runs and prepared folder (written into the workspace)."""
    _, argv = env_and_argv(command)
    argv = [sys.executable, *(in_ws(a, page.ws) for a in argv[1:])]
    proc = subprocess.run(argv, cwd=page.ws, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (page.ws / argv[-1]).is_file() and "nats/byte" in proc.stdout


def without(args: list[str], name: str) -> tuple[list[str], Optional[str]]:
    """`args` without the flag `name` and its value, and the value (None if absent)."""
    if name not in args:
        return args, None
    i = args.index(name)
    return args[:i] + args[i + 2 :], args[i + 1]


def rule_plan(command: str, page: Page) -> None:
    """hsdp.plan, shortened: given its compute where it would measure it (a fake-backend run, or a calibration
    run folder of the slow-link validation) and the shard group free where it would time it (loopback gloo
    workers); --for-utilization's fractions checked but not searched for (a bisection of 60 predictions per
    fraction, each 300 simulated steps at H=100: seconds a fraction; tests/test_plan.py runs the search)."""
    import hsdp.plan.__main__ as plan_cli

    _, argv = env_and_argv(command)
    args, _ = without(argv[3:], "--calibrate")
    args, targets = without(args, "--for-utilization")
    if targets is not None:
        assert plan_cli.parse_targets(targets)
    if not any(f in args for f in ("--compute-s", "--gpu", "--flops")):
        args += ["--compute-s", COMPUTE_S]
    if "--intra" not in args:
        args += ["--intra", "free"]
    page.monkeypatch.chdir(page.ws)
    assert plan_cli.main(args) == 0


def rule_plan_10b_alternatives(command: str, page: Page) -> None:
    """plan.md's "<the 10B llama --set list above> ... [A | B [C]]": the llama's --set list substituted (from
    the full command above it on the page), and each method: A (exact HSDP), B (DiLoCo H=100), B with C."""
    full = next(c for c in page_commands((RESULTS / page.name).read_text("utf-8")) if "--replicas 14" in c)
    llama = " ".join(f"--set {s}" for s in sets_of(shlex.split(full)) if not s.startswith("sync."))
    head, tail = command.split("<the 10B llama --set list above>")
    tail = tail[: tail.index("[")]
    a = "--set sync.warmup_steps=null"
    b = "--set sync.warmup_steps=0 --set sync.every=100 --set sync.method=diloco"
    c = "--set sync.fragments=4 --set sync.delay=5 --set sync.quantize=int4"
    assert all(x in command for x in (a, b, c)), "the page's alternatives changed: update this rule"
    for method in (a, b, f"{b} {c}"):
        rule_plan(f"{head}{llama} {tail}{method}", page)


def stand_in_report() -> dict[str, Any]:
    """A slowlink.json with one chaos run and its calm target (tests/test_plan_goodput.py's)."""
    faults = [
        {"kind": "kill", "replica": 1, "at_s": 10, "seconds": 2, "applied_s": 10, "over_s": 40},
        {"kind": "stop", "replica": 0, "at_s": 50, "seconds": 4, "applied_s": 50, "over_s": 54},
    ]
    return {
        "target_run": "calm",
        "mesh": [3, 1],
        "set": ["sync.every=32"],
        "runs": [
            {"run": "calm", "rate": "20mbit", "wall_time_s": 150.0, "mean_step_s": 0.25},
            {
                "run": "chaos",
                "rate": "20mbit",
                "wall_time_s": 200.0,
                "faults": {"chaos": {"seed": 7}, "faults": faults},
            },
        ],
    }


def rule_goodput(command: str, page: Page) -> None:
    """hsdp.plan.goodput as written (its --validate report: a stand-in at the path the page names)."""
    from hsdp.plan.goodput import main

    _, argv = env_and_argv(command)
    page.monkeypatch.chdir(page.ws)
    report = flag(argv, "--validate")
    if report:
        (page.ws / report).parent.mkdir(parents=True, exist_ok=True)
        (page.ws / report).write_text(json.dumps(stand_in_report()))
    assert main(argv[3:]) == 0
    plot = flag(argv, "--plot")
    assert plot is None or (page.ws / plot).is_file()


def rule_plan_validate(command: str, page: Page) -> None:
    """hsdp.plan.validate (root, minutes: a calibration run and the slow-link runs): its flags and both runs'
    configs."""
    from hsdp.plan.validate import check_args, parse_args

    _, argv = env_and_argv(command)
    assert check_args(parse_args(argv[3:]))


def rule_slowlink(command: str, page: Page) -> None:
    """hsdp.slowlink (root and network namespaces, 8 min to an hour): its plan, every run's config checked."""
    from hsdp.bench.plan import make_plan
    from hsdp.slowlink import parse_args

    _, argv = env_and_argv(command)
    page.monkeypatch.chdir(page.ws)
    plan = make_plan(parse_args(argv[3:]))
    assert plan.runs and plan.target in plan.runs


def rule_sweep(command: str, page: Page) -> None:
    """hsdp.sweep (minutes to an hour): its plan, every run's config loaded and checked before any runs."""
    from hsdp.bench.plan import plan_sweep
    from hsdp.bench.spec import parse_only
    from hsdp.sweep import parse_args

    page.monkeypatch.chdir(page.ws)
    for inner in re.findall(r"python -m hsdp\.sweep [^;']+", command):  # one, or each of an `sh -c '...; ...'`
        a = parse_args(shlex.split(inner)[3:])
        plan = plan_sweep(a.sweep, a.set, parse_only(a.only), a.no_run, a.resume)
        assert plan.configs


def rule_script(command: str, page: Page) -> None:
    """A script's arguments, parsed by its own argparse (`parsed_scripts`: one interpreter for all of them); a
    script without one (a repro that compiles for minutes) is given no arguments and compiles."""
    result = page.scripts[command]
    if result.get("why") == "no argparse":
        _, argv = env_and_argv(command)
        compile((REPO / argv[1]).read_text(), argv[1], "exec")
        assert result["takes_no_arguments"], result
        return
    assert result["parsed"], result


def rule_pytest(command: str, page: Page) -> None:
    """A pytest invocation (the suite runs these tests): its test files exist and its -k names are tests there."""
    files = re.findall(r"tests/\w+\.py", command)
    assert files, command
    text = "".join((REPO / f).read_text() for f in files)
    k = re.search(r"-k \"([^\"]+)\"", command)
    for name in re.split(r"\s+(?:or|and|not)\s+", k.group(1)) if k else []:  # a test's name or parameter id
        assert re.search(rf"def test_\w*{re.escape(name)}|[\"'][\w.-]*{re.escape(name)}[\w.-]*[\"']", text), name


def rule_parity(command: str, page: Page) -> None:
    """tests/test_torchft_parity.py from the repository root (it failed to import its helpers there): its usage;
    the table itself is what the suite's test_final_params_match_torchft_diloco runs."""
    _, argv = env_and_argv(command)
    proc = subprocess.run(
        [sys.executable, argv[1], "--help"], cwd=REPO, capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: python {argv[1]} table OUT"), proc.stderr
    assert "def test_final_params_match_torchft_diloco" in (REPO / argv[1]).read_text()


def readme_runs() -> list[str]:
    """What tests/test_readme_commands.py runs on a fresh clone: the README's commands, and sampling the default
    run right after it (`python -m hsdp.sample runs/tiny`, with `--tokens 8`)."""
    test = (REPO / "tests" / "test_readme_commands.py").read_text("utf-8")
    sample = "python -m hsdp.sample runs/tiny"
    return [*readme_commands(README.read_text("utf-8")), *([sample] if f'run("{sample} --tokens 8"' in test else [])]


def rule_readme(command: str, page: Page) -> None:
    """tests/test_readme_commands.py runs it, shortened, on a fresh clone."""
    assert command in readme_runs()


# The first rule whose pattern matches the start of the command (its environment assignments included) handles it.
RULES: list[tuple[str, Callable[[str, Page], None]]] = [
    (r"python -m hsdp\.plan configs/\S+ <the 10B llama", rule_plan_10b_alternatives),
    (r"python -m hsdp\.plan\.goodput\b", rule_goodput),
    (r"python -m hsdp\.plan\.validate\b", rule_plan_validate),
    (r"python -m hsdp\.plan\b", rule_plan),
    (r"python -m hsdp\.slowlink\b", rule_slowlink),
    (r"(TORCHINDUCTOR_CACHE_DIR=\S+ \S+ sh -c ')?python -m hsdp\.sweep\b", rule_sweep),
    (r"python -m hsdp\.prepare\b", rule_prepare),
    (r"STD=\$\(python -c", rule_shell),
    (r"python scripts/bpe_vs_bytes\.py\b", rule_bpe_vs_bytes),
    (r"(OMP_NUM_THREADS=\d+ )?python (scripts/\w+\.py|-m kernels\.bench)\b", rule_script),
    (r"python tests/test_torchft_parity\.py\b", rule_parity),
    (r"(RUST_LOG=\w+ |bash -c .*)?python -m pytest\b", rule_pytest),
    (r"TORCHINDUCTOR_DEBUG_COMPILE=1 .*python train\.py\b", rule_train_config),  # a compile run meant to fail
    (r"python train\.py .*model\.arch=ARCH\b", rule_train_config),  # the gpt / llama placeholder
    (r"python train\.py --set model\.d_model=768 ", rule_train_as_written),
    (r"python train\.py\b", rule_train),
]


def tiny_bpe_sets(command: str, page: Page) -> list[str]:
    """tiny-bpe.md's runs: both into /tmp/m19 (as the page says), the BPE one on the folder prepare wrote."""
    sets = [f"run.out_dir={in_ws('/tmp/m19', page.ws)}"]
    return sets + ([f"data.path={page.made['prepared']}"] if "tiny-bpe.yaml" in command else [])


# What a page says around its train.py commands, as overrides.
PAGE_SETS: dict[str, Callable[[str, Page], list[str]]] = {"tiny-bpe.md": tiny_bpe_sets}


def rule_for(command: str) -> Optional[Callable[[str, Page], None]]:
    """The rule that handles `command`; None for a REFERENCE; LookupError when none fits."""
    if command in REFERENCES:
        return None
    if command in readme_runs():
        return rule_readme
    for pattern, rule in RULES:
        if re.match(pattern, command):
            return rule
    raise LookupError(command)


def test_every_results_command_has_a_rule() -> None:
    missing = []
    for page, command in all_commands():
        try:
            rule_for(command)
        except LookupError:
            missing.append(f"{page}: {command}")
    assert not missing, "commands no rule of this file handles (add one):\n" + "\n".join(missing)


def test_the_rules_name_only_what_the_pages_show() -> None:
    shown = {c for _, c in all_commands()}
    assert not set(REFERENCES) - shown, f"REFERENCES no page shows any more: {set(REFERENCES) - shown}"
    used = {rule_for(c) for c in shown}
    assert not {r for _, r in RULES} - used, "a rule no command uses: drop it"


# ----------------------------------------------------------------------------- the scripts, parsed in one go
DRIVER = r"""
import argparse, importlib.util, json, runpy, sys
class Parsed(Exception):
    pass
real = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    real(self, args, namespace)  # argparse's own checks: a bad argument exits 2 here
    raise Parsed()
argparse.ArgumentParser.parse_args = parse_args
out = {}
for command, argv in json.loads(sys.argv[1]).items():
    sys.argv = argv[1:] if argv[1] != "-m" else [argv[2], *argv[3:]]
    source = open(argv[1] if argv[1] != "-m" else importlib.util.find_spec(argv[2]).origin).read()
    if "ArgumentParser(" not in source:  # nothing to parse, and running it is what the page measured
        out[command] = {"parsed": False, "why": "no argparse", "takes_no_arguments": len(sys.argv) == 1}
        continue
    try:
        if argv[1] == "-m":
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[1], run_name="__main__")
        out[command] = {"parsed": False, "why": "ran without parsing arguments"}
    except Parsed:
        out[command] = {"parsed": True}
    except SystemExit as e:
        out[command] = {"parsed": False, "why": f"exit {e.code}"}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsed_scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every script command of every page, its arguments parsed by the script's argparse (nothing run)."""
    ws = workspace(tmp_path_factory.mktemp("scripts"))
    todo = {c: env_and_argv(c)[1] for _, c in all_commands() if rule_for(c) is rule_script}
    for argv in todo.values():
        argv[:] = [in_ws(a, ws) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(todo)],
        cwd=ws,
        env={**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# ----------------------------------------------------------------------------- each page
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", results_pages(), ids=lambda p: p.name)
def test_results_page_commands_run_or_check(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parsed_scripts: dict[str, dict[str, Any]]
) -> None:
    page = Page(path.name, workspace(tmp_path), monkeypatch, parsed_scripts)
    for command in page_commands(path.read_text("utf-8")):
        rule = rule_for(command)
        if rule is None:
            continue
        try:
            rule(command, page)
        except BaseException as e:
            raise AssertionError(f"{path.name}: {command}\n({rule.__name__}) {type(e).__name__}: {e}") from e

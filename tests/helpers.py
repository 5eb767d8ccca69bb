"""Shared test helpers: run train.py as a subprocess (with a timeout) and read its outputs."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def hold_rendezvous() -> dist.TCPStore:
    """A gloo rendezvous store listening on a free port, made before any worker starts: the workers join it
    (`join_rendezvous(store.port, ...)`). Picking a free port and letting rank 0 bind it later raced with
    every other process on the box (gloo's own connections take ephemeral ports too: EADDRINUSE)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def join_rendezvous(port: int, rank: int, world_size: int, timeout: timedelta = timedelta(seconds=60)) -> None:
    """Init this worker's gloo process group through the store `hold_rendezvous` made."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


# The compiled hsdp engine's step scope (the whole step one graph, collectives inside, scheduled by
# compile.passes); compile.enabled alone compiles the blocks (the default scope).
STEP_SCOPE = ["compile.enabled=true", "compile.scope=step"]

# configs/tiny.yaml's job on a smaller model (a quarter of its per-step CPU), for runs that check rounds, heals,
# drops and faults rather than the model's compute: tests/test_elastic.py's `_start` puts it before its overrides.
SMALLER = ["model.n_layer=2", "model.d_model=64", "model.seq_len=32", "data.batch_size=4"]

# A small GPT whose dims do not divide a shard group of 4 (vocab 257, seq_len 17 → padding).
SMALL = [
    "model.vocab_size=257",
    "model.seq_len=17",
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=36",
    "data.source=synthetic",
    "data.batch_size=2",
    "run.log_every=1",
    "run.eval_every=0",
    "run.eval_batches=1",
    "wandb.mode=disabled",
    "optim.lr_warmup=3",
    "run.save_model=true",
    # No biases: the attention key bias has a mathematically zero grad, and Adam turns its
    # rounding noise into lr-sized steps, which would swamp a 1e-5 comparison.
    "model.bias=false",
    # Adam divides by sqrt(v) + eps: with eps=1e-8 the near-zero early grads of some weights turn
    # fp32 reduction-order noise into ~lr-sized steps (measured 1.1e-5 param error after 20 steps);
    # eps=1e-6 damps that 20x (6e-7) without changing what is being compared.
    "optim.eps=1e-6",
]


@dataclass
class RunResult:
    returncode: int
    stderr: str
    run_dir: Path

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    def params(self, replica: int = 0) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / f"model.replica{replica}.pt")


def run_train(
    out_dir: Path,
    name: str,
    overrides: list[str],
    config: str | None = None,
    timeout: float = 240,
    check: bool = True,
    env: dict[str, str] | None = None,
    script: list[str] | None = None,
) -> RunResult:
    """`python train.py [--config] --set ...`; a hang fails after `timeout` seconds.

    Served by the warm launcher (tests/train_server.py), except with `env`: variables that a
    process reads when it starts (e.g. MALLOC_*) need a fresh interpreter, so such a run is a
    plain subprocess. `script` replaces `train.py` (e.g. `["tests/faulty_train.py", "2", "3"]`).
    """
    script = script or ["train.py"]
    args = list(script[1:])
    if config:
        args += ["--config", str(REPO / config)]
    for o in ["mesh.timeout_s=60", *overrides, f"run.out_dir={out_dir}", f"run.name={name}"]:  # a test may raise it
        args += ["--set", o]
    full_env = {**os.environ, **QUIET_ENV, **(env or {})}
    if env:
        cmd = [sys.executable, str(REPO / script[0]), *args]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
        returncode, stderr = proc.returncode, proc.stderr
    else:
        returncode, stderr = _SERVER.run(str(REPO / script[0]), args, full_env, timeout)
    result = RunResult(returncode, stderr, out_dir / name)
    if check and returncode != 0:
        raise AssertionError(f"train.py failed ({returncode}):\n{stderr[-4000:]}")
    return result


QUIET_ENV = {"HSDP_NO_BAR": "1", "PYTHONWARNINGS": "ignore"}  # what every test run of train.py sets


class TrainServer:
    """The client of tests/train_server.py: started on first use, restarted after a run that hung."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pending = b""  # reply bytes read but not yet consumed (read unbuffered, so select() is exact)
        self.served: ServedRun | None = None  # the run `popen` started, until it ended

    def start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "train_server.py")],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
                env={**os.environ, **QUIET_ENV},
                start_new_session=True,  # its process group: the server, its fork server and every worker
            )
        return self.proc

    def run(self, script: str, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
        """One run: (exit code, its stdout+stderr). On a hang: SIGTERM the run, then kill everything."""
        output, pid = self._request(script, argv, env)
        try:
            try:
                returncode = self._reply(timeout)["returncode"]
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGTERM)  # the launcher stops its workers
                try:
                    self._reply(15)
                except subprocess.TimeoutExpired:
                    self.stop()
                raise
            return returncode, Path(output).read_text(errors="replace")
        finally:
            os.unlink(output)

    def _request(self, script: str, argv: list[str], env: dict[str, str]) -> tuple[str, int]:
        """Send one run to the server: (its output file, the served launcher's pid)."""
        assert self.served is None or self.served.returncode is not None, "the train server is serving a run"
        proc = self.start()
        fd, output = tempfile.mkstemp(prefix="hsdp-run-", suffix=".log")
        os.close(fd)
        request = {"script": script, "argv": argv, "cwd": str(REPO), "env": env, "output": output}
        proc.stdin.write((json.dumps(request) + "\n").encode())
        proc.stdin.flush()
        return output, self._reply(30)["pid"]

    def popen(self, script: str, argv: list[str], env: dict[str, str]) -> ServedRun:
        """A run that goes on while the test watches it (a Popen's poll/communicate/kill, its output as stderr)."""
        output, pid = self._request(script, argv, env)
        self.served = ServedRun(self, output, pid)
        return self.served

    def _reply(self, timeout: float) -> dict:
        """The server's next JSON line, waiting at most `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                self.stop()
                raise RuntimeError("the test suite's train server exited")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        """Kill the server, its fork server and any worker left (one process group)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc, self.pending = None, b""


class _Output:
    """A served run's output file, read as a Popen's stderr pipe would be (`read()`: all of it so far)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> str:
        try:
            return Path(self.path).read_text(errors="replace")
        except FileNotFoundError:  # communicate() read it and removed it
            return ""


class ServedRun:
    """`python train.py ...` forked by the train server, watched like a subprocess.Popen: `pid` (the launcher),
    `poll()`, `communicate(timeout)` → (None, its stdout+stderr), `kill()`, `returncode`, `stderr.read()`. Elastic
    tests start theirs this way: the same launcher without ~3.5 CPU s of a fresh interpreter's imports."""

    def __init__(self, server: TrainServer, output: str, pid: int) -> None:
        self.server, self.pid, self.stderr = server, pid, _Output(output)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.returncode = self.server._reply(0)["returncode"]
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        if self.returncode is None:
            try:
                self.returncode = self.server._reply(3600 if timeout is None else timeout)["returncode"]
            except RuntimeError:  # the server died under the run
                self.returncode = -signal.SIGKILL
        text = self.stderr.read()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stderr.path)
        return None, text

    def kill(self) -> None:
        """SIGKILL the launcher (its workers die with it); a server that then does not answer is killed too."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        try:
            self.returncode = self.server._reply(30)["returncode"]
        except (subprocess.TimeoutExpired, RuntimeError):
            self.server.stop()
            self.returncode = -signal.SIGKILL


_SERVER = TrainServer()
atexit.register(_SERVER.stop)


def serve_train(script: str, argv: list[str], env: dict[str, str]) -> ServedRun:
    """`python <script> <argv>` launched by this pytest process's warm launcher, watched as it runs."""
    return _SERVER.popen(script, argv, env)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def max_param_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(rel_err(a[k], b[k]) for k in a)


def schedules(run: RunResult) -> dict[str, list[list[str]]]:
    """schedule.txt → {"forward": [lines of each forward graph], "backward": [...]}."""
    out: dict[str, list[list[str]]] = {"forward": [], "backward": []}
    for block in (run.run_dir / "schedule.txt").read_text().split("# graph ")[1:]:
        head, *lines = block.strip().splitlines()
        out["forward" if "(forward)" in head else "backward"].append(lines)
    return out


def gathers_in_flight(lines: list[str]) -> list[int]:
    """For each compute line of a schedule: how many all-gathers are started and not yet waited."""
    started: set[str] = set()
    seen = []
    for line in lines:
        if line.startswith("start all_gather"):
            started.add(line.split()[2])
        elif line.startswith("wait"):
            started.discard(line.split()[1])
        elif line.startswith("compute"):
            seen.append(len(started))
    return seen


def assert_prefetch(run: RunResult, k: int) -> None:
    """In the run's generated forward code, compute runs with up to k gathers in flight (k ≥ 1 reaches k),
    none with k = 0; the FX liveness bound holds: at most k+1 units' full params alive at once."""
    forward = schedules(run)["forward"]
    assert forward
    for lines in forward:
        assert max(gathers_in_flight(lines)) == k, (k, lines)
    for g in run.summary["compiled"]:
        if g["graph"] == "forward":
            assert g["max_full_params_alive"] <= k + 1


def as_ctrl_c_reaches_it() -> None:
    """preexec_fn: the child starts with SIGINT at its default, as a terminal's foreground job does. The test
    process may itself ignore SIGINT (run as a script's background job, `cmd &`, which POSIX starts with
    SIGINT ignored), and a child inherits that, so a Ctrl-C test must not depend on how pytest was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

"""A warm launcher for the test suite: `python train.py` without paying for Python's start-up each run.

    python tests/train_server.py        (started by tests/helpers.py; one per pytest process)

It imports train.py (torch, hsdp) and starts the workers' zygote once
(hsdp.run.pool.start_zygote). Each request (one JSON line on stdin: argv, cwd,
env, output file) is served by a forked child that *is* the launcher of that
run: it runs the script as `__main__` with that argv, environment and directory,
its stdout/stderr going to the output file, and its `launch` finds the zygote
already running (inherited) and has it fork the workers, which get the child's
stdout/stderr and die with the child. Two JSON lines come back on stdout: the
child's pid when it starts, its exit status when it ends. A run of the small
test GPT saves ~4 s of imports (the launcher's and the zygote's) this way.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def serve_one(request: dict) -> None:
    """In the forked child: become `python <script> <argv...>` of the request, then exit with its code."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # The workers write to these descriptors too (the zygote hands them ours); O_APPEND keeps it a log.
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.argv = [request["script"], *request["argv"]]
        try:
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    sys.path.insert(0, str(REPO))
    import train
    from hsdp.config.loader import load_config
    from hsdp.data.tokens import load_tokens
    from hsdp.engines.registry import engine_modules
    from hsdp.run.pool import start_zygote
    from tests.helpers import SMALL

    # The test GPT's synthetic tokens: loaded here (hsdp.data.tokens keeps the chain per process) before the zygote
    # forks, each worker of each run finds them in its process (0.15 CPU s a worker).
    load_tokens(load_config(None, SMALL))
    start_zygote(train.train_worker, compiled=True)  # many test runs compile
    # Each run's launcher (a fork of this process) asks the registry for its engine in the preflight: imported
    # here once, not per run (0.7 CPU s a run, most of a warm 2x2 run's launcher).
    for module in engine_modules(compiled=True):
        importlib.import_module(module)
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # the replies; a child's fd 1 goes to its output file
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            serve_one(json.loads(line))
        reply.write(json.dumps({"pid": pid}) + "\n")  # so that a client can stop a run that hangs
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    main()

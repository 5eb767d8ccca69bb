"""The shard group's collectives timed for real: what a fake-backend calibration leaves out.

A `mesh.backend=fake` run issues every collective but moves nothing, so its step time has no
shard-group gathers or reduce-scatters in it; on a CPU box those run on loopback gloo and cost real
CPU and wire time. `measure_shard_collectives` times them on the config's own mesh (mesh.sync ×
mesh.shard local ranks, started by the run's launcher: gloo on CPU, nccl on GPUs), every shard group
at once as in a run:

    for each distinct message of the config's units (an all-gather of a unit's held elements in
    param_dtype, a reduce-scatter of S × held in reduce_dtype: the layout's sizes, the bytes the model
    counts), through Comm as the engine issues it: WARMUP untimed, then `reps` timed, each started
    after a world barrier; one repetition's time is the slowest rank's; a message's time the median.

On a CPU the collectives run on the cores that compute (`shares_compute`), so the step model charges
them to the compute clock instead of overlapping them (hsdp.plan.model). Rank 0 writes the table to a
JSON file (`MeasuredIntra.table`, which validate.json keeps; `from_json` reads it back).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hsdp.comm.mesh import build_mesh
from hsdp.config.schema import Config, ConfigError
from hsdp.core.layout import DTYPES
from hsdp.plan.model import MeasuredIntra
from hsdp.plan.workload import Message, build_workload

WARMUP = 2  # untimed repetitions per message (the first connects gloo's pairs and allocates)
REPS = 10


def distinct_messages(cfg: Config) -> list[tuple[Message, int]]:
    """(message, held elements) of every distinct shard-group gather and reduce-scatter of the config's units, and
    Muon's exchanges (elements: bf16 values one rank sends)."""
    w = build_workload(cfg)
    seen: dict[Message, int] = {}
    for u, unit in enumerate(w.units):
        for m in (w.gather_messages(u), w.reduce_scatter_message(u)):
            seen.setdefault(m, unit.held)
    for m in w.muon_messages():  # an all_to_all: bf16 values; Muon's all_gather: as many bytes in param dtype
        seen.setdefault(m, m.nbytes // 2 if m.op == "all_to_all" else m.nbytes // (w.S - 1) // w.param_bytes)
    return list(seen.items())


def measure_shard_collectives(cfg: Config, reps: int = REPS) -> Optional[MeasuredIntra]:
    """The config's shard-group collectives timed on its mesh now; None when there is no shard group (S = 1)."""
    if cfg.mesh.shard == 1:
        return None
    from hsdp.run.launch import WorkerError, launch  # the launcher, only when something is measured

    # the same mesh and shapes, communicating: no fake backend, one plain (non-elastic, eager) world
    mesh = dataclasses.replace(cfg.mesh, backend="auto")
    run = dataclasses.replace(
        cfg,
        mesh=mesh,
        elastic=dataclasses.replace(cfg.elastic, enabled=False),
        compile=dataclasses.replace(cfg.compile, enabled=False),
    )
    with tempfile.TemporaryDirectory(prefix="hsdp-plan-intra-") as tmp:
        out = Path(tmp) / "intra.json"
        try:
            launch(run, functools.partial(time_collectives_worker, str(out), reps))
        except WorkerError as e:
            raise ConfigError(f"timing the shard group's collectives failed: {str(e).splitlines()[-1]}") from None
        return from_json(json.loads(out.read_text()))


def time_collectives_worker(out: str, reps: int, cfg: Config) -> None:
    """One rank: build the mesh, time every distinct message through Comm; rank 0 writes the table."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = build_mesh(cfg.mesh.sync, cfg.mesh.shard, device, cfg.mesh.timeout_s, cfg.mesh.replicate)
    comm, S = mesh.comm, cfg.mesh.shard
    param, reduce = DTYPES[cfg.precision.param_dtype], DTYPES[cfg.precision.reduce_dtype]
    rows = []
    for m, held in distinct_messages(cfg):
        if m.op == "all_to_all":  # `held` bf16 values to the other ranks, evenly split
            each = -(-held // (S - 1))
            splits = [0 if r == mesh.shard_rank else each for r in range(S)]
            inp = torch.ones(sum(splits), dtype=torch.bfloat16, device=device)
            out_t = torch.empty(sum(splits), dtype=torch.bfloat16, device=device)
            issue = functools.partial(comm.all_to_all, out_t, inp, splits, splits, "shard")
        elif m.op == "all_gather":
            inp = torch.ones(held, dtype=param, device=device)
            out_t = torch.empty(S * held, dtype=param, device=device)
            issue = functools.partial(comm.all_gather, out_t, inp, "shard")
        else:
            inp = torch.ones(S * held, dtype=reduce, device=device)
            out_t = torch.empty(held, dtype=reduce, device=device)
            issue = functools.partial(comm.reduce_scatter, out_t, inp, "shard")
        times = []
        for i in range(WARMUP + reps):
            took = timed(issue, device)
            slowest = torch.tensor([took], dtype=torch.float64)
            comm.all_reduce(slowest, "world", op=dist.ReduceOp.MAX)
            if i >= WARMUP:
                times.append(float(slowest.item()))
        rows.append({"op": m.op, "nbytes": m.nbytes, "seconds": statistics.median(times)})
    if mesh.rank == 0:
        table = {"device": device.type, "backend": dist.get_backend(), "mesh": [mesh.sync_size, S], "reps": reps}
        Path(out).write_text(json.dumps({**table, "times": rows}))


def timed(issue, device: torch.device) -> float:
    """Seconds one blocking collective takes on this rank, started with every rank (a world barrier)."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    issue()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def from_json(data: dict) -> MeasuredIntra:
    """The measured table (the worker's JSON) as the step model's intra link."""
    table = {(r["op"], int(r["nbytes"])): float(r["seconds"]) for r in data["times"]}

    def time_of(m: Message) -> float:
        if (m.op, m.nbytes) not in table:  # another config than the one measured: refuse rather than guess
            raise ConfigError(f"plan: no measured time for a shard-group {m.op} of {m.nbytes} bytes per rank")
        return table[(m.op, m.nbytes)]

    sync, shard = data["mesh"]
    source = f"{data['backend']} on this machine's {sync}×{shard} mesh, median of {data['reps']}"
    return MeasuredIntra(time_of, shares_compute=data["device"] == "cpu", source=source, table=data)

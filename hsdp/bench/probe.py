"""The link probe: one all_reduce of a known size timed across a SlowLink, against its ring bytes / rate.

Before the runs of each rate, `run_probe` starts a Job whose workers are this module's entry

    python -m hsdp.bench.probe OUT NBYTES REPS      # under torchrun, in the replicas' namespaces

Each worker times an fp32 all_reduce of NBYTES on the sync group (one stream on the link:
only shard rank 0's sync group), then the same size on every shard group at once (inside
the namespaces: it shows the local path is not shaped), and rank 0 writes the times to OUT.
The expectation is ring bytes (as in hsdp.comm.groups) · 8 / rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from hsdp.bench.job import Job
from hsdp.bench.netns import SlowLink, SlowLinkError


@dataclass(frozen=True)
class ProbeResult:
    """A probe's times (seconds per repetition) and what they mean at its rate."""

    tensor_bytes: int
    ring_bytes: int  # what one rank sends for the all_reduce
    sync_s: list[float]
    shard_s: list[float]  # empty with one rank per replica
    replicas: int
    shard: int
    sync_s_median: float
    shard_s_median: Optional[float]
    expected_s: Optional[float]  # ring_bytes·8/rate; None unshaped
    measured_over_expected: Optional[float]
    effective_mbit: float
    rate: str

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> ProbeResult:
        """A probe of slowlink.json's `probes` (JSON: its values are not checked; a missing one is None)."""
        values: dict[str, Any] = {f.name: entry.get(f.name) for f in fields(cls)}
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def probe_bytes(rate_bps: Optional[int], replicas: int, seconds: float) -> int:
    """fp32 all_reduce size whose ring bytes take about `seconds` at the rate (clamped to 256 KiB..128 MiB)."""
    if rate_bps is None:
        return 64 * 2**20
    ring_factor = 2 * (replicas - 1) / replicas
    nbytes = int(rate_bps / 8 * seconds / ring_factor)
    return max(256 * 1024, min(128 * 2**20, nbytes // 4 * 4))


def run_probe(
    link: SlowLink, shard: int, seconds: float, reps: int, port: int, log_dir: Path, label: str, timeout_s: float = 120
) -> ProbeResult:
    """Run the probe across `link`; its times with the expectation bytes·8/rate and the ratio measured/expected."""
    nbytes = probe_bytes(link.rate_bps, link.replicas, seconds)
    out = log_dir / f"probe-{label}.json"
    out.unlink(missing_ok=True)
    target = ["-m", "hsdp.bench.probe", str(out), str(nbytes), str(reps)]
    job = Job(link, shard, target, port, log_dir, f"probe-{label}").start()
    rc = job.wait(timeout_s)
    if rc != 0 or not out.is_file():
        raise SlowLinkError(f"probe at {label} failed (exit {rc}); logs:\n{job.log_tail()}")
    times = json.loads(out.read_text())
    sync_median = statistics.median(times["sync_s"])
    expected = times["ring_bytes"] * 8 / link.rate_bps if link.rate_bps else None
    return ProbeResult(
        **times,
        sync_s_median=sync_median,
        shard_s_median=statistics.median(times["shard_s"]) if times["shard_s"] else None,
        expected_s=expected,
        measured_over_expected=sync_median / expected if expected else None,
        effective_mbit=times["ring_bytes"] * 8 / sync_median / 1e6,
        rate=label,
    )


def probe_worker(out: str, nbytes: int, reps: int) -> None:
    """Under torchrun in the namespaces: time an all_reduce on the sync group, then the same on a shard group."""
    import datetime

    import torch
    import torch.distributed as dist

    from hsdp.comm.groups import ring_bytes_of
    from hsdp.comm.mesh import build_mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world, shard = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mesh = build_mesh(world // shard, shard, torch.device("cpu"))
    t = torch.ones(nbytes // 4)
    small = torch.ones(1)
    mesh.comm.all_reduce(small, "sync")  # connections up, both sides in
    mesh.comm.all_reduce(small, "shard")
    sync_s, shard_s = [], []
    for _ in range(reps):  # one stream on the link: only shard rank 0's sync group
        dist.barrier()
        if mesh.shard_rank == 0:
            t0 = time.perf_counter()
            mesh.comm.all_reduce(t, "sync")
            sync_s.append(time.perf_counter() - t0)
    for _ in range(reps if shard > 1 else 0):  # every replica's shard group at once, inside the namespaces
        dist.barrier()
        t0 = time.perf_counter()
        mesh.comm.all_reduce(t, "shard")
        shard_s.append(time.perf_counter() - t0)
    dist.barrier()
    if mesh.rank == 0:
        times = {
            "tensor_bytes": nbytes,
            "ring_bytes": ring_bytes_of("all_reduce", mesh.sync_size, nbytes),
            "sync_s": sync_s,
            "shard_s": shard_s,
            "replicas": mesh.sync_size,
            "shard": shard,
        }
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hsdp.bench.probe", description="a link probe worker (under torchrun)")
    p.add_argument("out", help="JSON file rank 0 writes the times to")
    p.add_argument("nbytes", type=int, help="all_reduce size in bytes (fp32)")
    p.add_argument("reps", type=int, help="timed repetitions per group")
    args = p.parse_args(argv)
    probe_worker(args.out, args.nbytes, args.reps)


if __name__ == "__main__":
    main()

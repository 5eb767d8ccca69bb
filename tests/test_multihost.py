"""The documented multi-host launch (scripts/slurm/elastic.sbatch, docs/usage.md "Across hosts"), run on this machine
with each host a network namespace: the lighthouse's host and two replica sites, joined by veths through a bridge
(hsdp.bench.netns.SlowLink; no namespace shared, none the test's own). The sbatch file itself runs, with SLURM's
variables set and a stand-in `srun` that starts heterogeneous component G on host G: the same command lines a
cluster runs. Needs root and iproute2; skipped otherwise (the reason says which)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsdp.bench import netns

REPO = Path(__file__).resolve().parents[1]
STEPS = 32

# srun's stand-in: `srun --het-group=G [options] CMD...` runs CMD on host G (its namespace), with what that host
# would have of its own: its address (HSDP_ADDR: hostname is the same in every namespace here) and the interface
# gloo binds (GLOO_SOCKET_IFNAME). exec all the way down, so that the sbatch file's `kill -TERM` reaches CMD.
FAKE_SRUN = """#!/usr/bin/env bash
group=0
while [ $# -gt 0 ]; do
    case "$1" in
        --het-group=*) group=${1#--het-group=}; shift ;;
        --*) shift ;;
        *) break ;;
    esac
done
ns=HSDP_TEST_NS_$group addr=HSDP_TEST_ADDR_$group dev=HSDP_TEST_DEV_$group
exec ip netns exec "${!ns}" env HSDP_ADDR="${!addr}" GLOO_SOCKET_IFNAME="${!dev}" SLURM_STEP_NUM_NODES=1 "$@"
"""

# A small model (the launch is what is tested, not the compute): 2 replicas of 1 rank, DiLoCo rounds every 8 steps.
RUN = [
    "elastic.enabled=true",
    "mesh.sync=2",
    "mesh.shard=1",
    "sync.warmup_steps=0",
    "sync.method=diloco",
    "sync.every=8",
    f"run.steps={STEPS}",
    "run.save_model=true",
    "run.log_every=1",
    "run.eval_every=0",
    "wandb.mode=disabled",
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=4",
    "data.source=synthetic",
    "elastic.timeout_s=5",
    "mesh.timeout_s=60",
    "run.overwrite=true",
]


@pytest.mark.skipif(netns.missing_requirements() is not None, reason=f"{netns.missing_requirements()}")
@pytest.mark.timeout(360)
def test_the_slurm_script_runs_an_elastic_run_across_three_hosts(tmp_path: Path) -> None:
    """elastic.sbatch with SLURM_HET_SIZE=3: the lighthouse's host prepares the run folder and runs the lighthouse,
    each site waits for it and runs its replica's torchrun; the job exits 0, both replicas trained every step, their
    final models are bitwise equal, and the lighthouse was stopped at the end (no process left in any namespace)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    link = netns.SlowLink(2, None, lighthouse=True)  # hosts: replica 0's, replica 1's, the lighthouse's
    hosts = [(link.lighthouse_ns, link.lighthouse_addr, f"{link.prefix}el")]
    hosts += list(zip(link.namespaces, link.addrs, link.ifnames))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_HET_SIZE": "3",
        "HSDP_LIGHTHOUSE_HOST": link.lighthouse_addr,  # scontrol's answer on a cluster: component 0's node
        "HSDP_CONFIG": "configs/tiny.yaml",
        "HSDP_SET": " ".join([*RUN, f"run.out_dir={tmp_path}", "run.name=multihost"]),
        "HSDP_NPROC": "1",
        "HSDP_NO_BAR": "1",
        "OMP_NUM_THREADS": "1",
        **{f"HSDP_TEST_{key}_{g}": value for g, h in enumerate(hosts) for key, value in zip(("NS", "ADDR", "DEV"), h)},
    }
    log = tmp_path / "job.log"
    proc, lingering = None, None
    try:
        link.up()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["bash", str(REPO / "scripts/slurm/elastic.sbatch")],
                cwd=tmp_path,  # sbatch runs a copy elsewhere: the script finds the repository by SLURM_SUBMIT_DIR
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            code = proc.wait(timeout=300)  # the hang guard
        lingering = [pid for ns in link.created for pid in netns.namespace_pids(ns)]  # before down() stops them
    finally:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = link.down()
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert left == [] and lingering == [], (left, lingering)
    run_dir = tmp_path / "multihost"
    assert f"prepared {run_dir}" in text and "lighthouse: stopped" in text, text[-4000:]
    for m in (0, 1):
        steps = [json.loads(line)["step"] for line in (run_dir / f"metrics.replica{m}.jsonl").read_text().splitlines()]
        assert steps == list(range(STEPS)), (m, steps)
        assert json.loads((run_dir / f"summary.replica{m}.json").read_text())["sync_rounds"] >= STEPS // 8 - 1
    a, b = torch.load(run_dir / "model.replica0.pt"), torch.load(run_dir / "model.replica1.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_replica_under_torchrun_refuses_a_run_folder_not_prepared_for_its_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An elastic replica under torchrun prepares nothing (no replica is special): it refuses, in one line, a folder
    without config.yaml or one prepared for another config; a replica's own keys (its slowdown, elastic.replica, the
    lighthouse) may differ. `train.py --prepare` writes the folder and exits without training."""
    import train
    from hsdp.config.loader import load_config
    from hsdp.config.schema import ConfigError
    from hsdp.run.rundir import prepare_run_dir
    from hsdp.sync.seam import ReplicaSeat

    sets = [*RUN, f"run.out_dir={tmp_path}", "run.name=prep"]
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), sets)
    seat = ReplicaSeat(0, 0, "http://127.0.0.1:1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"is not prepared \(no config.yaml\).*--prepare") as e:
        prepare_run_dir(cfg, seat)
    assert "\n" not in str(e.value) and not (tmp_path / "prep").exists()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    argv = ["--config", str(REPO / "configs" / "tiny.yaml"), *[a for s in sets for a in ("--set", s)], "--prepare"]
    assert train.main(argv) == 0
    assert (tmp_path / "prep" / "config.yaml").is_file() and not list((tmp_path / "prep").glob("metrics*"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    mine = load_config(str(REPO / "configs" / "tiny.yaml"), [*sets, "run.slowdown=3", "elastic.replica=1"])
    prepare_run_dir(mine, seat)  # its own keys differ: accepted
    other = load_config(str(REPO / "configs" / "tiny.yaml"), [*sets, "sync.every=16"])
    with pytest.raises(ConfigError, match="sync.every: .* was prepared with 8, this replica's config has 16"):
        prepare_run_dir(other, seat)

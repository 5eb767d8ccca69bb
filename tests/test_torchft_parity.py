"""Parity with torchft 0.2.0's DiLoCo (torchft/local_sgd.py), run here: the same arithmetic and timing.

Two replicas, each a process. Each trains the same small model (four Linear units, the same seeded init) on
its own data (seeded by replica and step) with the same inner AdamW, 12 steps per case, twice:

  ours     hsdp.sync.policy.SyncPolicy over the default gloo group (the model's units as the held shards,
           copied in after each inner step and back after the sync), as tests/test_sync.py drives it;
  torchft  torchft.local_sgd.DiLoCo with its Manager (gloo, synchronous quorum) meeting the other replica at
           a LighthouseServer on localhost; one outer optimizer per fragment, fragment f = units f, f+P, ….

Outer SGD lr 0.7, momentum 0.9, Nesterov, in every case:

  plain       H 2, P 1, τ 0                       schedule hsdp (the default): torchft's timing at τ = 0
  streaming   H 4, P 2, τ 0                       schedule hsdp
  torchft_p2  H 4, P 2, τ 1, α 0.5                sync.schedule=torchft (docs/design.md §8.9)
  torchft_p3  H 6, P 3, τ 1, α 0.3                sync.schedule=torchft

Each case has a Manager of its own (whose step, from 0, picks the fragment: `current_step() % P`), and
every sync has landed by the end of step 11 (the last slot). Each replica's final params must be within
1e-6 relative (‖ours − torchft‖ / ‖torchft‖, per param) of torchft's. A control, torchft_p2's settings on
schedule hsdp, must NOT be: the timing is what the schedule changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script (`table OUT`, the workers): the project and tests/ importable

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tests.helpers import hold_rendezvous, join_rendezvous  # noqa: E402

USAGE = "usage: python tests/test_torchft_parity.py table OUT  (or: worker REPLICA PORT LIGHTHOUSE OUT)"
STEPS = 12
CASES: dict[str, dict[str, Any]] = {
    "plain": dict(every=2, fragments=1, delay=0, alpha=0.0, schedule="hsdp"),
    "streaming": dict(every=4, fragments=2, delay=0, alpha=0.0, schedule="hsdp"),
    "torchft_p2": dict(every=4, fragments=2, delay=1, alpha=0.5, schedule="torchft"),
    "torchft_p3": dict(every=6, fragments=3, delay=1, alpha=0.3, schedule="torchft"),
}
CONTROL = ("torchft_p2", "hsdp")  # (case, schedule): ours with another schedule, against torchft's case
TOL = 1e-6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.units = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, unit in enumerate(self.units):
            x = unit(x) if i == len(self.units) - 1 else torch.tanh(unit(x))
        return x


def build() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def inner_step(net: Net, opt: torch.optim.Optimizer, replica: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * replica + step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()  # torchft's DiLoCo syncs in this step's post-hook


def params(net: Net) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


# ---------------------------------------------------------------- the two implementations (in a replica's process)
def run_ours(case: dict[str, Any], replica: int, transport: Any) -> dict[str, torch.Tensor]:
    from hsdp.config.schema import SyncConfig
    from hsdp.sync.policy import SyncPolicy

    net, opt = build()
    units = list(net.units)
    flat = lambda u: torch.cat([p.detach().reshape(-1) for p in u.parameters()])  # noqa: E731
    held = [flat(u) for u in units]
    cfg = SyncConfig(warmup_steps=0, method="diloco", outer_lr=0.7, outer_momentum=0.9, nesterov=True, **case)
    policy = SyncPolicy(cfg, held, transport)
    for step in range(STEPS):
        inner_step(net, opt, replica, step)
        with torch.no_grad():
            for u, h in zip(units, held):
                h.copy_(flat(u))
            policy.after_step(step)
            for u, h in zip(units, held):
                at = 0
                for p in u.parameters():
                    p.copy_(h[at : at + p.numel()].view_as(p))
                    at += p.numel()
    late = policy.finish()  # only the control's last sync (τ after the slot of step 11) lands here
    assert not late or case["schedule"] == "hsdp" and case["delay"] > 0, late
    return params(net)


def run_torchft(case: dict[str, Any], replica: int, manager: Any) -> dict[str, torch.Tensor]:
    from torchft.local_sgd import DiLoCo

    assert manager.current_step() == 0  # a fresh manager: the fragment order starts at fragment 0
    net, opt = build()
    P = case["fragments"]
    fragments = [nn.ModuleList([net.units[u] for u in range(f, len(net.units), P)]) for f in range(P)]
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
    with DiLoCo(
        manager,
        list(fragments),
        opt,
        outer,
        sync_every=case["every"],
        backup_device=torch.device("cpu"),
        pin_memory=False,
        fragment_sync_delay=case["delay"],
        fragment_update_alpha=case["alpha"],
    ):
        for step in range(STEPS):
            inner_step(net, opt, replica, step)
    return params(net)


def worker(replica: int, port: int, lighthouse: str, out: str) -> None:
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from hsdp.comm.groups import Comm
    from hsdp.comm.transport import GroupTransport
    from hsdp.run.rank import shutdown_process_group

    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    join_rendezvous(port, replica, world_size=2, timeout=timeout)
    results: dict[str, dict[str, torch.Tensor]] = {}
    try:
        transport = GroupTransport(Comm({"sync": dist.group.WORLD}))
        for name, case in CASES.items():
            results[f"ours/{name}"] = run_ours(case, replica, transport)
        control, schedule = CONTROL
        results["ours/control"] = run_ours({**CASES[control], "schedule": schedule}, replica, transport)
        for name, case in CASES.items():
            # A manager per case: a DiLoCo registers its fragments' state with its manager once.
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout),
                load_state_dict=lambda state: None,  # init_sync off and no failures: nothing is ever healed
                state_dict=lambda: {},
                min_replica_size=2,
                use_async_quorum=False,  # DiLoCo's requirement
                init_sync=False,  # both replicas start from the same seeded init
                replica_id=f"{name}_{replica}",
                store_addr="127.0.0.1",
                store_port=store.port,
                rank=0,
                world_size=1,
                lighthouse_addr=lighthouse,
                hostname="127.0.0.1",
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
            )
            try:
                results[f"torchft/{name}"] = run_torchft(case, replica, manager)
            finally:
                manager.shutdown(wait=False)
    finally:
        shutdown_process_group()
    torch.save(results, Path(out) / f"replica{replica}.pt")


# ---------------------------------------------------------------- the test (pytest process: the lighthouse)
def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over params of ‖a − b‖ / ‖b‖ (float64)."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm()) for k in b)


def parity_table(out: Path) -> dict[str, list[float]]:
    """case → each replica's max relative difference between ours and torchft's final params."""
    per_replica = [torch.load(out / f"replica{m}.pt") for m in range(2)]
    table = {name: [rel(r[f"ours/{name}"], r[f"torchft/{name}"]) for r in per_replica] for name in CASES}
    table["control"] = [rel(r["ours/control"], r[f"torchft/{CONTROL[0]}"]) for r in per_replica]
    return table


def run_parity(out: Path, timeout: float = 240) -> dict[str, list[float]]:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info otherwise
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100, quorum_tick_ms=10)
    store = hold_rendezvous()  # listening until both workers are done
    port = store.port
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "RUST_LOG": "warn"}
    args = [sys.executable, str(REPO / "tests" / "test_torchft_parity.py"), "worker"]
    procs = [
        subprocess.Popen(
            [*args, str(m), str(port), lighthouse.address(), str(out)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for m in range(2)
    ]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return parity_table(out)


def test_final_params_match_torchft_diloco(tmp_path: Path):
    table = run_parity(tmp_path)
    print(json.dumps(table))
    for name in CASES:
        assert max(table[name]) <= TOL, (name, table[name])
    assert min(table["control"]) > 1e3 * TOL, table["control"]  # schedule hsdp is another algorithm


def main(argv: list[str]) -> int:
    """`worker REPLICA PORT LIGHTHOUSE OUT`: one replica's runs; `table OUT`: run both and print the table (each
    case's max relative difference per replica); `--help`: the usage. Other arguments: the usage, exit 2."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(argv) == 5 and argv[0] == "worker":
        worker(int(argv[1]), int(argv[2]), argv[3], argv[4])
        return 0
    if len(argv) != 2 or argv[0] != "table":
        print(USAGE, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, diffs in run_parity(out).items():
        print(f"{name:12s} " + "  ".join(f"{d:.2e}" for d in diffs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

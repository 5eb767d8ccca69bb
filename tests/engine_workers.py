"""Multi-process checks of the engine's internals, run as `python tests/engine_workers.py NAME WORLD OUT`.

Each check forks WORLD gloo ranks (shard group = all of them), compares the
engine against plain torch computed on every rank, and writes `OUT/rank{r}.json`;
the pytest side runs this on the suite's warm train server (tests/helpers.py, so
neither this process nor its forked ranks import torch again) with a timeout and
reads the files. Arguments after the first three (the server's `--set ...`) are ignored.
"""

from __future__ import annotations

import copy
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn as nn


def _mesh(world: int):
    from hsdp.comm.mesh import build_mesh

    return build_mesh(1, world, torch.device("cpu"))


def _toy_units() -> nn.ModuleList:
    """Units with params smaller than the shard count (bias of 3) and dims that do not divide 4."""
    torch.manual_seed(0)
    return nn.ModuleList(
        [nn.Linear(5, 3), nn.Sequential(nn.Linear(3, 257), nn.Tanh()), nn.Linear(257, 7, bias=False), nn.LayerNorm(7)]
    )


def check_odd_shapes(rank: int, world: int) -> dict:
    """Grads and SGD updates of the sharded engine equal plain torch on the full batch."""
    from hsdp.engines.hsdp import HSDPEngine

    mesh = _mesh(world)
    units = _toy_units()
    ref = copy.deepcopy(units)
    engine = HSDPEngine(units, mesh)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1)
    x_all = torch.randn(world * 3, 5)
    x = x_all[rank * 3 : (rank + 1) * 3]
    errs = []
    for _ in range(3):
        engine(x).pow(2).mean().backward()
        opt.step()
        engine.zero_grad()
        out = x_all
        for u in ref:
            out = u(out)
        out.pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = engine.full_state_dict()
    for name, p in ref.named_parameters():
        errs.append(float((full["units." + name] - p.detach()).abs().max() / p.detach().abs().max()))
    held_rows = {n: list(p.shape) for n, p in engine.named_parameters()}
    return {"max_rel_err": max(errs), "errs": errs, "held_shapes": held_rows}


def check_release(rank: int, world: int, compiled_blocks: bool = False) -> dict:
    """After a unit's forward (and after backward) its full params hold no storage, and nothing saved for
    backward is a copy of a weight (a cast or a transpose saved in place of the param would escape release).

    compiled_blocks: the engine of compile.scope=blocks (each block compiled in place)."""
    from hsdp.config.schema import ModelConfig
    from hsdp.engines.hsdp import HSDPEngine
    from hsdp.models.gpt import build_model

    mesh = _mesh(world)
    # tests/helpers.py's SMALL model and batch, so the compiled variant loads the blocks' graphs that
    # tests/test_compile_blocks.py's run compiled (the suite's inductor cache). B·T = 34 rows: no activation
    # has a weight's shape (d_model 36; weights 108x36, 36x36, 144x36, 36x144).
    model = build_model(ModelConfig(vocab_size=257, seq_len=17, n_layer=2, n_head=4, d_model=36, bias=False), 0)
    if compiled_blocks:
        from hsdp.engines.blocks import BlockCompiledHSDPEngine

        engine: HSDPEngine = BlockCompiledHSDPEngine(model.units, mesh)
    else:
        engine = HSDPEngine(model.units, mesh)
    weights = {i: [v for v in u.gather_full_fp32().values() if v.dim() == 2] for i, u in enumerate(engine.units)}
    saved: list[tuple[int, object]] = []  # (unit, what the engine's pack hook kept) for each saved tensor
    pack = HSDPEngine._pack_saved

    def spy(unit, t):
        packed = pack(unit, t)
        saved.append((unit.index, packed))
        return packed

    HSDPEngine._pack_saved = staticmethod(spy)
    seen_during_forward, full_views = [], []
    run_unit = engine._run_unit

    def recording_run_unit(unit, x):
        """Right after unit i ran (outside any compiled code): its own full storage size, the earlier units'
        (released) sizes, and the very full-param tensors the module computed with."""
        out = run_unit(unit, x)
        i = unit.index
        earlier = [engine.units[j].full_flat.untyped_storage().nbytes() for j in range(i)]
        seen_during_forward.append((i, unit.full_flat.untyped_storage().nbytes(), earlier))
        full_views.extend(s.owner._parameters[s.attr] for s in unit.specs)
        return out

    engine._run_unit = recording_run_unit
    logits = engine(torch.randint(0, 257, (2, 17)))
    after_forward = [u.full_flat.untyped_storage().nbytes() for u in engine.units]
    # The full params the module computed with now have no storage behind them.
    view_bytes = [t.untyped_storage().nbytes() for t in full_views]
    markers = [sum(isinstance(p, tuple) for i, p in saved if i == u) for u in range(len(engine.units))]
    weight_copies = [
        (i, tuple(p.shape))
        for i, p in saved
        if torch.is_tensor(p)
        and p.dim() == 2
        and any(p.shape == w.shape and torch.equal(p.float(), w) for w in weights[i] + [w.t() for w in weights[i]])
    ]
    logits.float().logsumexp(-1).mean().backward()
    after_backward = [u.full_flat.untyped_storage().nbytes() for u in engine.units]
    grad_nonzero = all(bool(u.grad_flat.abs().sum() > 0) for u in engine.units)
    HSDPEngine._pack_saved = staticmethod(pack)
    return {
        "during_forward": seen_during_forward,
        "after_forward": after_forward,
        "view_bytes": view_bytes,
        "after_backward": after_backward,
        "grad_nonzero": grad_nonzero,
        "markers": markers,
        "weight_copies": weight_copies,
    }


CHECKS = {
    "odd_shapes": check_odd_shapes,
    "release": check_release,
    "release_compiled_blocks": partial(check_release, compiled_blocks=True),
}


def _worker(rank: int, name: str, world: int, port: int, out: str) -> None:
    from hsdp.run.rank import shutdown_process_group
    from tests.helpers import join_rendezvous

    torch.set_num_threads(1)
    join_rendezvous(port, rank, world)
    try:
        result = CHECKS[name](rank, world)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        shutdown_process_group()


def main() -> None:
    name, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hsdp, when run as a script
    import hsdp.engines.hsdp  # noqa: F401  (once, before the fork, and not in each rank)
    import hsdp.models.gpt  # noqa: F401
    import hsdp.run.rank  # noqa: F401
    from tests.helpers import hold_rendezvous

    store = hold_rendezvous()  # listening before the ranks start: no port to lose to another process
    # fork: the ranks start from this interpreter, torch and hsdp already imported, and have done no
    # torch work yet (no thread pool to inherit); spawn would import them again in every rank.
    mp.start_processes(_worker, args=(name, world, store.port, out), nprocs=world, start_method="fork")


if __name__ == "__main__":
    main()

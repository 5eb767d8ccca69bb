"""The lossy sync codecs beyond int8 (docs/design.md §8.5: int4, top-k, error feedback) on a 2×2 mesh,
against the independent reference in sync_reference.py.

Every multi-process run goes through `run_train` and is made once per module (`CompressRuns`).
Warmup 3, every 4; the long runs are DiLoCo (η 0.7, μ 0.9) for 15 steps, syncing after 6, 10 and
14, so they end on a sync (every replica holds θ_g). The SMALL model's units hold 4968, 7812, 7812
and 4662 elements per shard rank.

  int4_first  average + int4 (block 64), 7 steps: ends right after the first sync
  topk_first  average + top-k 5% (chunk 64: k 4, last chunks of 40, 4 = k and 54), 7 steps
  topk4_first average + top-k 5% of chunk 128 (k 7; the blocks' last chunk has 4 < k elements)
              with int4 values (block 32; 273 / 431 / 259 values: odd, the last nibble empty)
  int4, int4_ef, topk, topk_ef, topk4, topk4_ef   the same codecs in the long run, ± error feedback
  frag_ef     fragments 2, top-k 5% of chunk 512 (k 26, int16 indices) with int8 values (block 16), EF
  delay_ef    int4 + EF, τ 1, α 0; a checkpoint after step 10 (a sync in flight, residuals non-zero)
              from which the resume test continues

Tolerances. The engine's Δ_m differs from the reference's by fp32 rounding (the sharded grads sum
in another order; fp32 cases agree to ~1e-6, tests/test_sync.py). A codec is discontinuous: an int4
rounding or a top-k selection whose input sits within that noise of a tie can go either way, and
then the element moves by a quant step or by the element itself. So:
  - right after the first sync with η 1, μ 0, every element must agree to 1e-5 except elements the
    reference marks as within a relative margin of 1e-3 of a tie (noise is ~1e-4 of a step), and
    those by at most one flip's worth (`codec_trace`). Measured: no flip at all in the three cases
    (the largest element difference is ~4e-4 of its flip bound); 1.2–4.3% of elements are near a
    tie by that margin, so a codec bug anywhere else cannot hide.
  - in the long runs a flip at one sync is carried on by Adam and the outer momentum, so the
    params are held to 1e-3 relative. Measured: 6e-7–9e-7 without a flip (int4, topk, topk4,
    topk_ef, topk4_ef), 8.8e-5 (int4_ef), 1.0e-4 (frag_ef), 1.1e-4 (delay_ef) after a flip: 9×
    headroom. Every alternative it must tell apart is ≥ 8.8× above it: error feedback off (≥ 0.032
    between the references ± EF), the wrong layout (int4 + EF over whole units instead of held
    shards: 1.0e-2; 8.8e-3 for delay_ef) and no codec (≥ 9.5e-3 to the fp32 run).
The codec alone is also checked bit for bit (no tie can differ there): hsdp.sync.codec on M = 3
replicas over an in-process transport vs the reference's codec, EF residuals included.

Bytes (per rank and step; sync group M, n = a unit's held elements, B = quant_block, C = topk_chunk,
k = ⌈ρ·C⌉, written here from the docstring of hsdp/sync/codec.py): one all-gather per unit of a
payload; a rank sends (M − 1)·payload:
  int4      ⌈n/2⌉ + 4⌈n/B⌉
  top-k     ⌈c·b/8⌉ + values(c), c = (⌈n/C⌉ − 1)·k + min(k, n − (⌈n/C⌉ − 1)·C), b = ⌈log₂ C⌉ bits per
            packed index; values(c) = 4c (fp32), c + 4⌈c/B⌉ (int8), ⌈c/2⌉ + 4⌈c/B⌉ (int4),
            ⌈c/4⌉ + 8⌈c/B⌉ (int2)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from hsdp.config.loader import load_config
from hsdp.config.schema import SyncConfig
from hsdp.models.gpt import build_model
from hsdp.run.checkpoint import read_meta
from hsdp.sync.elastic.transport import FTTransport
from tests.helpers import SMALL, max_param_rel_err, rel_err, run_train
from tests.sync_reference import (
    CodecSpec,
    SyncReferenceResult,
    compressed_mean_delta,
    fragment_due,
    held_numel,
    sync_reference_run,
)
from tests.test_checkpoint import assert_same_run
from tests.test_sync import MESH, PERIODIC, TOL, M, Runs, S, fp32_all_reduce_bytes, max_loss_rel_err

LONG = [*PERIODIC, "run.steps=15", "sync.method=diloco"]  # syncs after 6, 10, 14: ends on a sync
FIRST = [*PERIODIC, "run.steps=7"]  # average (η 1, μ 0): ends right after the first sync
INT4 = ["sync.quantize=int4", "sync.quant_block=64"]
TOPK = ["sync.topk=0.05", "sync.topk_chunk=64"]
TOPK4 = ["sync.topk=0.05", "sync.topk_chunk=128", "sync.quantize=int4", "sync.quant_block=32"]
TOPK8 = ["sync.topk=0.05", "sync.topk_chunk=512", "sync.quantize=int8", "sync.quant_block=16"]
EF = ["sync.error_feedback=true"]

CASES: dict[str, list[str]] = {
    "int4_first": [*FIRST, *INT4],
    "topk_first": [*FIRST, *TOPK],
    "topk4_first": [*FIRST, *TOPK4],
    "int4": [*LONG, *INT4],
    "int4_ef": [*LONG, *INT4, *EF],
    "topk": [*LONG, *TOPK],
    "topk_ef": [*LONG, *TOPK, *EF],
    "topk4": [*LONG, *TOPK4],
    "topk4_ef": [*LONG, *TOPK4, *EF],
    "frag_ef": [*LONG, "sync.fragments=2", *TOPK8, *EF],
    "delay_ef": [*LONG, *INT4, *EF, "sync.delay=1", "sync.alpha=0", "run.checkpoint_every=11"],
}
FIRST_CASES = ["int4_first", "topk_first", "topk4_first"]
LONG_CASES = [c for c in CASES if c not in FIRST_CASES]
EF_PAIRS = ["int4", "topk", "topk4"]  # each with a twin case `<name>_ef`

LONG_TOL = 1e-3  # long runs, params (see the module docstring)
MARGIN = 1e-3  # first sync: relative distance from a tie below which an element may flip


def overrides(case: str) -> list[str]:
    return [*SMALL, *CASES[case]]


class CompressRuns(Runs):
    """tests/test_sync.py's cache of runs and references, over this module's cases."""

    def run(self, case: str):
        if case not in self._runs:
            self._runs[case] = run_train(self.out, case, [*overrides(case), *MESH])
        return self._runs[case]

    def ref(self, case: str) -> SyncReferenceResult:
        if case not in self._refs:
            self._refs[case] = sync_reference_run(overrides(case), M, S)
        return self._refs[case]

    def fp32_ref(self) -> SyncReferenceResult:
        """The long runs' config without a codec: uncompressed DiLoCo."""
        if "fp32" not in self._refs:
            self._refs["fp32"] = sync_reference_run([*SMALL, *LONG], M, S)
        return self._refs["fp32"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> CompressRuns:
    return CompressRuns(tmp_path_factory.mktemp("compress"))


# ---------------------------------------------------------------- the byte formula (codec.py's docstring)
def unit_sizes() -> list[int]:
    """n: elements of one rank's held shard of each unit of the SMALL model."""
    model = build_model(load_config(None, SMALL).model, 0)
    return [sum(held_numel(p.shape, S) for p in unit.parameters()) for unit in model.units]


def topk_k(sc: SyncConfig) -> int:
    return math.ceil(sc.topk * sc.topk_chunk)


def selected(n: int, chunk: int, k: int) -> int:
    """c: the (index, value) pairs of n elements: k per chunk, a last chunk shorter than k all of its own."""
    full = math.ceil(n / chunk) - 1
    return full * k + min(k, n - full * chunk)


def value_bytes(c: int, quantize: str, block: int) -> int:
    if quantize == "int8":
        return c + 4 * math.ceil(c / block)
    if quantize == "int4":
        return math.ceil(c / 2) + 4 * math.ceil(c / block)
    if quantize == "int2":
        return math.ceil(c / 4) + 8 * math.ceil(c / block)
    return 4 * c


def payload_bytes(n: int, sc: SyncConfig) -> int:
    """What one replica all-gathers for a unit of n held elements."""
    if sc.topk > 0:
        c = selected(n, sc.topk_chunk, topk_k(sc))
        bits = math.ceil(math.log2(sc.topk_chunk))  # per index, packed across the payload
        return math.ceil(c * bits / 8) + value_bytes(c, sc.quantize, sc.quant_block)
    return value_bytes(n, sc.quantize, sc.quant_block)


def expected_sync_bytes(case: str) -> list[int]:
    cfg = load_config(None, overrides(case))
    sc = cfg.sync
    sizes = unit_sizes()
    out = []
    for s in range(cfg.run.steps):
        b = sum(fp32_all_reduce_bytes(n) for n in sizes) if s < sc.warmup_steps else 0
        for f in range(sc.fragments):
            if fragment_due(s, f, sc.warmup_steps, sc.every, sc.fragments):
                b += sum((M - 1) * payload_bytes(sizes[u], sc) for u in range(f, len(sizes), sc.fragments))
        out.append(b)
    return out


def test_cases_cover_short_last_chunks_and_odd_payloads():
    """The shapes the cases exercise, worked from the unit sizes."""
    sizes = unit_sizes()
    assert sizes == [4968, 7812, 7812, 4662]
    last = lambda n, chunk: n - (math.ceil(n / chunk) - 1) * chunk  # noqa: E731
    assert [last(n, 64) for n in sizes] == [40, 4, 4, 54] and [math.ceil(n / 64) for n in sizes] == [78, 123, 123, 73]
    assert [last(n, 128) for n in sizes] == [104, 4, 4, 54]  # k = 7: blocks send a short last chunk whole
    assert [selected(n, 128, 7) for n in sizes] == [273, 431, 431, 259]  # odd: int4's last nibble is empty
    assert payload_bytes(7812, SyncConfig(topk=0.05, topk_chunk=128, quantize="int4", quant_block=32)) == (
        378 + 216 + 4 * 14  # 431 indices of 7 bits: 3017 bits in 378 bytes
    )


@pytest.mark.parametrize("case", list(CASES))
def test_synced_flags_and_sync_bytes(runs: CompressRuns, case: str):
    """Each step's sync_bytes is the codec's formula exactly (τ > 0: counted when the sync starts)."""
    run, ref = runs.run(case), runs.ref(case)
    metrics = run.metrics
    assert [m["step"] for m in metrics] == list(range(len(ref.synced)))
    assert [m["synced"] for m in metrics] == ref.synced
    cum = [m["sync_bytes"] for m in metrics]
    assert [b - a for a, b in zip([0, *cum], cum)] == expected_sync_bytes(case)
    assert run.summary["sync_bytes"] == cum[-1]


# ---------------------------------------------------------------- the codec alone, bit for bit
class _Loopback:
    """M replicas in one process: the i-th all-gather completes (on wait) once every replica issued its i-th."""

    def __init__(self, M: int, contributors: list[int] | None = None) -> None:
        self.M = M
        self.contributors = list(range(M)) if contributors is None else contributors
        self.calls: dict[int, list] = {}
        self.sent: list[int] = [0] * M  # bytes each replica handed to all_gather

    def transport(self, m: int):
        group = self

        class Transport:
            size = group.M
            contributors = _contributors = group.contributors
            contributed_rows = FTTransport.contributed_rows  # the elastic transport's own (spectators dropped)
            issued = 0

            def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool):
                slot = group.calls.setdefault(self.issued, [None] * group.M)
                slot[m] = inp.clone()
                self.issued += 1
                group.sent[m] += inp.numel() * inp.element_size()
                return _Work(lambda: out.copy_(torch.cat(slot)))

        return Transport()


@dataclasses.dataclass
class _Work:
    fn: object

    def wait(self) -> None:
        self.fn()


def _deltas(n: int, M: int, seed: int, cfg: SyncConfig) -> list[torch.Tensor]:
    """Δ_m with exact ties: repeated and negated values, zeros of both signs, 600 elements of one magnitude
    (top-k ties at every chunk's boundary) and, for the dense codecs, a block of exact rounding ties."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(M):
        d = torch.randn(n, generator=g) * 1e-3
        d[3::9] = -d[1::9][: d[3::9].numel()]
        d[5::13] = d[2::13][: d[5::13].numel()]
        d[7::17], d[8::19] = 0.0, -0.0
        if n >= 600:
            d[:600:2], d[1:600:2] = 5e-4, -5e-4
        B = cfg.quant_block
        start = math.ceil(600 / B) * B
        if cfg.topk == 0 and n >= start + B:  # scale = 2^-10 exactly, x/scale = j + ½
            qmax = 127 if cfg.quantize == "int8" else 7
            j = torch.arange(B - 1) % (2 * qmax) - qmax
            d[start] = qmax * 2.0**-10
            d[start + 1 : start + B] = (j + 0.5) * 2.0**-10
        out.append(d)
    return out


@pytest.mark.parametrize(
    "codec",
    [
        dict(quantize="int4", quant_block=64),
        dict(quantize="int8", quant_block=16, error_feedback=True),
        dict(quantize="int4", quant_block=6, error_feedback=True),
        dict(topk=0.05, topk_chunk=64),
        dict(topk=0.05, topk_chunk=64, error_feedback=True),
        dict(topk=0.05, topk_chunk=128, quantize="int4", quant_block=32, error_feedback=True),
        dict(topk=0.1, topk_chunk=300, quantize="int8", quant_block=16, error_feedback=True),
        dict(topk=0.3, topk_chunk=10, quantize="int4", quant_block=4, error_feedback=True),
    ],
    ids=lambda c: "-".join(f"{v}" for v in c.values()),
)
def test_codec_equals_reference_bit_for_bit(codec: dict):
    """hsdp.sync.codec (M = 3, in one process) vs the reference's codec: mean Δ, residuals and bytes sent,
    over 3 rounds (the residuals carry over), on sizes with short last chunks and odd payloads."""
    from hsdp.sync.codec import build_codec

    cfg = SyncConfig(**codec)
    spec = CodecSpec.of(cfg)
    engine = build_codec(cfg)
    M3 = 3
    for n in (4968, 7812, 431, 5):
        errs = [torch.zeros(n) for _ in range(M3)] if cfg.error_feedback else None
        ref_errs = [[torch.zeros(n)] for _ in range(M3)]
        for rnd in range(3):
            deltas = _deltas(n, M3, 10 * n + rnd, cfg)
            group = _Loopback(M3)
            transports = [group.transport(m) for m in range(M3)]
            reds = [
                engine.start(d.clone(), t, async_op=False, error=None if errs is None else errs[m])
                for m, (d, t) in enumerate(zip(deltas, transports))
            ]
            for red, t in zip(reds, transports):
                engine.finish(red, t)
            (want,), _, _ = compressed_mean_delta([[d] for d in deltas], 1, spec, ref_errs)
            for m in range(M3):
                assert torch.equal(reds[m].delta, want), (n, rnd, m, rel_err(reds[m].delta, want))
                if errs is not None:
                    assert torch.equal(errs[m], ref_errs[m][0]), (n, rnd, m)
            assert group.sent == [payload_bytes(n, cfg)] * M3
        if errs is not None:
            assert all(float(e.abs().max()) > 0 for e in errs)  # something was held back


@pytest.mark.parametrize(
    "codec",
    [dict(quantize="int8", quant_block=16), dict(quantize="int4", quant_block=6), dict(topk=0.1, topk_chunk=64)],
    ids=lambda c: "-".join(f"{v}" for v in c.values()),
)
def test_a_spectators_part_is_dropped_from_the_mean(codec: dict):
    """An elastic replica that spectates a round (hsdp/sync/elastic/) takes part in the gathers but its
    part is not counted: 3 replicas with replica 1 spectating give every replica, the spectator too, the
    mean that replicas 0 and 2 alone give, bit for bit. (The fp32 codec's all-reduce gets a zero part from
    a spectator: the elastic kill runs cover it.)"""
    from hsdp.sync.codec import build_codec

    cfg = SyncConfig(**codec)
    engine = build_codec(cfg)
    n = 431
    deltas = _deltas(n, 3, 7, cfg)

    def means(group: _Loopback, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        transports = [group.transport(m) for m in range(group.M)]
        reds = [engine.start(d.clone(), t, async_op=False) for d, t in zip(parts, transports)]
        for red, t in zip(reds, transports):
            engine.finish(red, t)
        return [r.delta for r in reds]

    alone = means(_Loopback(2), [deltas[0], deltas[2]])
    spectated = means(_Loopback(3, contributors=[0, 2]), deltas)
    assert torch.equal(alone[0], alone[1])
    assert all(torch.equal(got, alone[0]) for got in spectated)
    assert not torch.equal(means(_Loopback(3), deltas)[0], alone[0])  # counting replica 1 would differ


# ---------------------------------------------------------------- distributed run == reference
def check_equal_up_to_flips(params: list[dict[str, torch.Tensor]], ref: SyncReferenceResult, step: int) -> None:
    """Right after a sync with η 1, μ 0 (a flip moves θ by its flip_bound): exact but for flips near a tie."""
    trace = ref.codec_trace[step]
    total = flipped = fragile = 0
    for m, eng in enumerate(params):
        assert eng.keys() == ref.params[m].keys() == trace.keys()
        for name, (bound, margin) in trace.items():
            r = ref.params[m][name]
            d = (eng[name] - r).abs()
            flip = d > 0.1 * bound + 1e-6 * float(r.abs().max())
            assert bool((d[flip] <= 1.1 * bound[flip]).all()), f"{name}: off by more than one flip"
            assert bool((margin[flip] <= MARGIN).all()), f"{name}: differs where the reference is not near a tie"
            patched = torch.where(flip, r, eng[name])
            assert rel_err(patched, r) <= TOL, f"{name}: {rel_err(patched, r):.3g} outside flipped elements"
            total += d.numel()
            flipped += int(flip.sum())
            fragile += int((margin <= MARGIN).sum())
    assert flipped <= 1e-3 * total, f"{flipped} of {total} elements flipped"
    assert fragile <= 0.1 * total, f"{fragile} of {total} elements near a tie: the check would be too weak"


@pytest.mark.parametrize("case", FIRST_CASES)
def test_first_sync_matches_reference_up_to_ties(runs: CompressRuns, case: str):
    run, ref = runs.run(case), runs.ref(case)
    assert ref.synced == [False] * 6 + [True]
    assert max_loss_rel_err(run.losses, ref.losses) <= TOL
    check_equal_up_to_flips([run.params(m) for m in range(M)], ref, 6)


@pytest.mark.parametrize("case", LONG_CASES)
def test_long_run_matches_reference(runs: CompressRuns, case: str):
    """Losses to 1e-5, params to LONG_TOL. Where every fragment lands after the last step (all but
    frag_ef, whose fragment 0 last synced after step 12), every replica ends on θ_g."""
    run, ref = runs.run(case), runs.ref(case)
    assert max_loss_rel_err(run.losses, ref.losses) <= TOL
    for m in range(M):
        err = max_param_rel_err(run.params(m), ref.params[m])
        assert err <= LONG_TOL, (case, m, err)
    ends_on_theta_g = len(ref.landed[-1]) == load_config(None, overrides(case)).sync.fragments
    assert ends_on_theta_g == (case != "frag_ef")
    if ends_on_theta_g:
        a, b = run.params(0), run.params(1)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert all(torch.equal(ref.params[0][k], ref.global_params[k]) for k in ref.params[0])


def test_long_tolerance_separates_what_it_must(runs: CompressRuns):
    """LONG_TOL is far below what a wrong codec moves the params by (figures in the module docstring)."""
    for base in EF_PAIRS:  # error feedback ignored
        d = max_param_rel_err(runs.ref(base).params[0], runs.ref(f"{base}_ef").params[0])
        assert d >= 20 * LONG_TOL, (base, d)
    for case in ("int4_ef", "delay_ef"):  # the smallest codec effect: int4 with error feedback
        assert max_param_rel_err(runs.ref(case).params[0], runs.fp32_ref().params[0]) >= 5 * LONG_TOL, case
    # int4 with EF over whole units (one shard rank holding all; same data per replica) instead of held shards
    whole = sync_reference_run([*overrides("int4_ef"), "data.batch_size=4"], M, 1)
    assert max_param_rel_err(whole.params[0], runs.ref("int4_ef").params[0]) >= 5 * LONG_TOL


# ---------------------------------------------------------------- error feedback
@pytest.mark.parametrize("base", EF_PAIRS)
def test_error_feedback_changes_the_run_and_brings_it_closer_to_fp32(runs: CompressRuns, base: str):
    """θ_g (the runs end on a sync) with and without EF, and its distance to uncompressed DiLoCo.

    Measured (max over params of the relative distance to the fp32 run): int4 0.040 → 0.010 with EF,
    top-k 0.566 → 0.470, top-k + int4 0.577 → 0.489; ± EF apart by 0.033, 0.33, 0.32.
    """
    plain, ef = runs.run(base).params(0), runs.run(f"{base}_ef").params(0)
    fp32 = runs.fp32_ref().params[0]
    assert max_param_rel_err(ef, plain) > 20 * LONG_TOL
    d_plain, d_ef = max_param_rel_err(plain, fp32), max_param_rel_err(ef, fp32)
    assert d_ef < (0.5 if base == "int4" else 0.9) * d_plain, (base, d_ef, d_plain)


def test_resume_with_error_feedback_is_bitwise(runs: CompressRuns):
    """delay_ef's checkpoint after step 10 holds each replica's residuals (after 2 syncs) and the sync
    started after step 10; a new run resumed from it ends bit for bit as the uninterrupted one."""
    ref = runs.run("delay_ef")
    step_10 = ref.run_dir / "checkpoints" / "step_10"
    meta = read_meta(step_10)
    sync = meta["engine_meta"]["sync"]
    assert sync["error_units"] == [0, 1, 2, 3]
    assert sync["in_flight"] == [{"fragment": 0, "start": 10, "land": 11}]
    assert not meta["replicas_identical"]
    resumed = run_train(runs.out, "delay_ef-resumed", [*overrides("delay_ef"), *MESH, f"run.resume={step_10}"])
    assert_same_run(resumed, ref, from_step=11)
    assert resumed.summary["sync_bytes"] == ref.summary["sync_bytes"]


# ---------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    "bad, key",
    [
        (["sync.error_feedback=true"], "sync.error_feedback"),
        (["sync.error_feedback=true", "sync.quantize=none", "sync.topk=0"], "sync.error_feedback"),
        (["sync.quantize=int4", "sync.quant_block=63"], "sync.quant_block"),
    ],
)
def test_config_error_exits_2_with_one_line(tmp_path: Path, bad: list[str], key: str):
    run = run_train(tmp_path, "bad", [*SMALL, *MESH, *PERIODIC, *bad], check=False, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}: "), run.stderr
    assert not run.run_dir.exists()

"""Data: stdlib corpus, text/tokens/synthetic sources, deterministic rank-disjoint batches, epochs."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp.config.schema import Config, ConfigError
from hsdp.data.tokens import Data, TokenStream, check_data, load_tokens, stdlib_files, synthetic_tokens
from hsdp.run.preflight import load_checked_config


def make_cfg(**sections) -> Config:
    """Config() with `section={key: value}` changes (no validation: tests pick their own sizes)."""
    cfg = Config()
    for section, values in sections.items():
        for k, v in values.items():
            assert hasattr(getattr(cfg, section), k), f"{section}.{k}"
            setattr(getattr(cfg, section), k, v)
    return cfg


def small_stdlib_cfg(batch_size: int = 3, grad_accum: int = 1, seed: int = 0) -> Config:
    return make_cfg(
        model=dict(seq_len=32),
        data=dict(source="stdlib", batch_size=batch_size),
        optim=dict(grad_accum=grad_accum),
        run=dict(seed=seed),
    )


@pytest.fixture(scope="module")
def stdlib_data() -> Data:
    return Data(small_stdlib_cfg(), 0, 1)


def write_bin(path: Path, tokens: np.ndarray) -> Path:
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    return path


# ------------------------------------------------------------------ stdlib corpus
def test_stdlib_files_are_deterministic_and_sorted():
    a, b = stdlib_files(), stdlib_files()
    assert a == b and len(a) > 100
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in a]
    assert rel == sorted(rel)
    assert len(set(rel)) == len(rel)
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in a)


def test_stdlib_split_is_by_file_and_non_empty():
    cfg = make_cfg(data=dict(source="stdlib", val_fraction=0.1))
    train, val = load_tokens(cfg)
    assert len(train) > 1_000_000 and len(val) > 100_000
    assert train.dtype == np.uint8 and val.dtype == np.uint8
    files = stdlib_files()
    # independently: every 10th file (val_fraction 0.1) is validation, the rest is training
    val_files, train_files = files[0::10], [f for i, f in enumerate(files) if i % 10]
    assert not set(val_files) & set(train_files)
    sizes = {f: f.stat().st_size for f in files}
    assert len(val) == sum(sizes[f] for f in val_files)
    assert len(train) == sum(sizes[f] for f in train_files)
    assert len(train) + len(val) == sum(sizes.values())
    # the val stream starts with the first file's bytes, train with the second's
    first, second = files[0].read_bytes(), files[1].read_bytes()
    assert bytes(val[: len(first)]) == first
    assert bytes(train[: len(second)]) == second


def test_stdlib_split_follows_val_fraction():
    files = stdlib_files()
    train, val = load_tokens(make_cfg(data=dict(source="stdlib", val_fraction=0.25)))
    val_files = files[0::4]
    assert len(val) == sum(f.stat().st_size for f in val_files)


# ------------------------------------------------------------------ determinism and targets
def test_same_step_gives_identical_batches_across_instances(stdlib_data):
    other = Data(small_stdlib_cfg(), 0, 1)
    for step in (0, 1, 17):
        x1, y1 = stdlib_data.train_batch(step, 0)
        x2, y2 = other.train_batch(step, 0)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # repeated calls on the same instance (out of order) too
    a = stdlib_data.train_batch(5, 0)[0]
    stdlib_data.train_batch(2, 0)
    assert torch.equal(stdlib_data.train_batch(5, 0)[0], a)


def test_batch_shape_dtype_and_shifted_targets(stdlib_data):
    x, y = stdlib_data.train_batch(3, 0)
    assert x.shape == (3, 32) and y.shape == (3, 32)
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < 256


def test_rows_are_aligned_windows_of_the_corpus(stdlib_data):
    T = 32
    tokens = np.asarray(stdlib_data.train.tokens)
    x, y = stdlib_data.train_batch(4, 0)
    ids = stdlib_data.train.windows(4 * 3, 3)
    for row, (i, xr, yr) in enumerate(zip(ids, x, y)):
        expect = torch.from_numpy(tokens[i * T : i * T + T + 1].astype(np.int64))
        assert torch.equal(xr, expect[:-1]) and torch.equal(yr, expect[1:]), f"row {row}"


def test_different_steps_and_seeds_differ(stdlib_data):
    x0, _ = stdlib_data.train_batch(0, 0)
    x1, _ = stdlib_data.train_batch(1, 0)
    assert not torch.equal(x0, x1)
    other_seed = Data(small_stdlib_cfg(seed=1), 0, 1)
    assert not torch.equal(other_seed.train_batch(0, 0)[0], x0)


def test_grad_accum_micro_steps_are_consecutive_batches():
    acc = Data(small_stdlib_cfg(grad_accum=2), 0, 1)
    plain = Data(small_stdlib_cfg(grad_accum=1), 0, 1)
    for step in range(3):
        for micro in range(2):
            assert torch.equal(acc.train_batch(step, micro)[0], plain.train_batch(2 * step + micro, 0)[0])
    assert not torch.equal(acc.train_batch(0, 0)[0], acc.train_batch(0, 1)[0])


def test_val_batches_are_fixed_and_not_train(stdlib_data):
    v0 = stdlib_data.val_batch(0)
    for i in range(3):
        stdlib_data.val_batch(i)
    assert torch.equal(stdlib_data.val_batch(0)[0], v0[0])
    assert not torch.equal(stdlib_data.val_batch(1)[0], v0[0])
    assert torch.equal(v0[0][:, 1:], v0[1][:, :-1])
    assert not torch.equal(v0[0], stdlib_data.train_batch(0, 0)[0])


# ------------------------------------------------------------------ ranks
W = 4


@pytest.fixture(scope="module")
def unique_bin(tmp_path_factory) -> Path:
    """A token file whose every token is distinct, so a row identifies its window: start = x[0]."""
    path = tmp_path_factory.mktemp("uniq") / "train.bin"
    return write_bin(path, np.arange(60_000))


def test_ranks_never_share_a_window(unique_bin):
    T, B, accum = 16, 5, 2
    cfg = make_cfg(
        model=dict(seq_len=T, vocab_size=65536),
        optim=dict(grad_accum=accum),
        data=dict(source="tokens", path=str(unique_bin), batch_size=B, val_fraction=0.1),
    )
    ranks = [Data(cfg, r, W) for r in range(W)]
    n_windows = ranks[0].train.n_windows
    seen_over_steps: set[int] = set()
    for step in range(4):
        for micro in range(accum):
            starts = []
            for d in ranks:
                x, y = d.train_batch(step, micro)
                assert torch.equal(x[:, 1:], y[:, :-1])
                assert bool((x[:, 0] % T == 0).all()), "rows must start at window boundaries"
                assert torch.equal(x, x[:, :1] + torch.arange(T)), "rows must be contiguous corpus slices"
                starts.append(set((x[:, 0] // T).tolist()))
            union = set().union(*starts)
            assert len(union) == W * B, f"step {step} micro {micro}: ranks share a window"
            assert all(len(s) == B for s in starts)
            # within the first epoch no window is repeated across steps either
            assert not union & seen_over_steps
            seen_over_steps |= union
    assert len(seen_over_steps) <= n_windows


def test_ranks_disjoint_by_token_stream_windows():
    cfg = small_stdlib_cfg(batch_size=4)
    stream = Data(cfg, 0, W).train
    B = cfg.data.batch_size
    for index in range(3):
        per_rank = [set(stream.windows(index * W * B + r * B, B).tolist()) for r in range(W)]
        for r in range(W):
            for q in range(r + 1, W):
                assert not per_rank[r] & per_rank[q], f"ranks {r} and {q} share windows at index {index}"


@pytest.mark.parametrize("source", ["stdlib", "tokens"])
def test_concatenated_rank_batches_equal_single_process_batch(source, unique_bin):
    B, accum = 3, 2
    extra = dict(path=str(unique_bin)) if source == "tokens" else {}
    vocab = 65536 if source == "tokens" else 256
    per_rank_cfg = make_cfg(
        model=dict(seq_len=32, vocab_size=vocab),
        optim=dict(grad_accum=accum),
        data=dict(source=source, batch_size=B, **extra),
    )
    single_cfg = make_cfg(
        model=dict(seq_len=32, vocab_size=vocab),
        optim=dict(grad_accum=accum),
        data=dict(source=source, batch_size=B * W, **extra),
    )
    ranks = [Data(per_rank_cfg, r, W) for r in range(W)]
    single = Data(single_cfg, 0, 1)
    for step in range(3):
        for micro in range(accum):
            xs, ys = zip(*(d.train_batch(step, micro) for d in ranks))
            x1, y1 = single.train_batch(step, micro)
            assert torch.equal(torch.cat(xs), x1), f"step {step} micro {micro}"
            assert torch.equal(torch.cat(ys), y1)
    for i in range(2):
        xs, _ = zip(*(d.val_batch(i) for d in ranks))
        assert torch.equal(torch.cat(xs), single.val_batch(i)[0])


# ------------------------------------------------------------------ text / tokens / synthetic sources
def test_text_source_single_file(tmp_path):
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200)).encode()
    f = tmp_path / "corpus.txt"
    f.write_bytes(text)
    cfg = load_checked_config(
        None, ["data.source=text", f"data.path={f}", "model.seq_len=16", "data.batch_size=2", "data.val_fraction=0.2"]
    )
    train, val = load_tokens(cfg)
    cut = int(len(text) * 0.8)
    assert bytes(train) == text[:cut] and bytes(val) == text[cut:]
    d = Data(cfg, 0, 1)
    x, y = d.train_batch(0, 0)
    assert x.shape == (2, 16)
    for xr, yr in zip(x, y):
        row = bytes(xr.tolist()) + bytes(yr[-1:].tolist())
        assert row in text[:cut]
    xv, _ = d.val_batch(0)
    assert bytes(xv[0].tolist()) in text[cut:]


def test_text_source_glob_splits_by_file(tmp_path):
    contents = {}
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        contents[name] = (name * 500).encode()
        (tmp_path / name).write_bytes(contents[name])
    (tmp_path / "skip.md").write_text("not matched")
    cfg = load_checked_config(None, ["data.source=text", f"data.path={tmp_path}/*.txt", "data.val_fraction=0.5"])
    train, val = load_tokens(cfg)
    # sorted files, every 2nd is validation: a, c → val; b, d → train
    assert bytes(val) == contents["a.txt"] + contents["c.txt"]
    assert bytes(train) == contents["b.txt"] + contents["d.txt"]


def test_tokens_source_reads_uint16_and_splits_without_val_bin(tmp_path):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 1000, size=5000).astype(np.uint16)
    path = write_bin(tmp_path / "train.bin", toks)
    cfg = load_checked_config(
        None,
        [
            "data.source=tokens",
            f"data.path={path}",
            "model.vocab_size=1000",
            "model.seq_len=8",
            "data.batch_size=4",
            "data.val_fraction=0.1",
        ],
    )
    train, val = load_tokens(cfg)
    assert np.array_equal(np.asarray(train), toks[:4500]) and np.array_equal(np.asarray(val), toks[4500:])
    d = Data(cfg, 0, 1)
    x, y = d.train_batch(0, 0)
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) >= 256  # really uint16, not bytes
    # each row occurs in the file at an aligned offset
    for xr in x:
        start = None
        for i in range(len(toks) // 8):
            if np.array_equal(toks[i * 8 : i * 8 + 8], xr.numpy()):
                start = i
                break
        assert start is not None


def test_tokens_source_uses_val_bin_beside_it(tmp_path):
    toks = (np.arange(3000) % 500).astype(np.uint16)
    val_toks = (np.arange(700) % 300 + 200).astype(np.uint16)
    path = write_bin(tmp_path / "train.bin", toks)
    write_bin(tmp_path / "val.bin", val_toks)
    cfg = load_checked_config(
        None,
        ["data.source=tokens", f"data.path={path}", "model.vocab_size=500", "model.seq_len=8", "data.batch_size=2"],
    )
    train, val = load_tokens(cfg)
    assert np.array_equal(np.asarray(train), toks)  # the whole train file, no hold-out
    assert np.array_equal(np.asarray(val), val_toks)
    xv, yv = Data(cfg, 0, 1).val_batch(0)
    assert bool(((xv >= 200) & (xv < 500)).all())
    assert torch.equal(xv[:, 1:], yv[:, :-1])


def test_tokens_source_rejects_ids_beyond_vocab(tmp_path):
    path = write_bin(tmp_path / "train.bin", np.arange(2000) % 300)
    cfg = make_cfg(model=dict(vocab_size=256, seq_len=8), data=dict(source="tokens", path=str(path)))
    with pytest.raises(ConfigError, match="model.vocab_size=256") as info:
        check_data(cfg)  # validate() calls it: the error comes before any worker starts
    assert str(path) in str(info.value) and "token id 256 at position 256" in str(info.value)


def test_tokens_source_rejects_val_ids_beyond_vocab(tmp_path):
    path = write_bin(tmp_path / "train.bin", np.arange(2000) % 200)
    write_bin(tmp_path / "val.bin", np.arange(2000) % 300)
    cfg = make_cfg(model=dict(vocab_size=256, seq_len=8), data=dict(source="tokens", path=str(path)))
    with pytest.raises(ConfigError, match="vocab_size") as info:
        check_data(cfg)
    assert "val.bin" in str(info.value)


def test_token_id_check_scans_the_whole_file(tmp_path):
    """One bad id after 3M good ones (beyond any head sample) is found, by load_checked_config."""
    tokens = np.zeros(3_000_001, dtype=np.uint16)
    tokens[-1] = 300
    path = write_bin(tmp_path / "train.bin", tokens)
    with pytest.raises(ConfigError, match="position 3000000"):
        load_checked_config(None, ["data.source=tokens", f"data.path={path}", "model.vocab_size=256"])
    assert load_checked_config(None, ["data.source=tokens", f"data.path={path}", "model.vocab_size=301"])


def test_synthetic_source_is_in_vocab_and_seeded():
    cfg = make_cfg(model=dict(vocab_size=97, seq_len=16), data=dict(source="synthetic", batch_size=4))
    d = Data(cfg, 0, 1)
    for step in range(3):
        x, y = d.train_batch(step, 0)
        assert int(x.min()) >= 0 and int(x.max()) < 97 and int(y.max()) < 97
    xv, _ = d.val_batch(0)
    assert int(xv.max()) < 97
    a, b = synthetic_tokens(97, 0, 5000), synthetic_tokens(97, 0, 5000)
    assert np.array_equal(a, b) and int(a.max()) < 97
    assert not np.array_equal(a, synthetic_tokens(97, 1, 5000))
    assert len(np.unique(a)) > 10  # not degenerate


@pytest.mark.parametrize("vocab,seed,n", [(257, 0, 20_000), (50_000, 3, 5_000), (2, 5, 10), (97, 1, 1)])
def test_synthetic_tokens_are_the_seeded_chain(vocab: int, seed: int, n: int) -> None:
    """The chain token by token, as its definition reads (the draws in the same order), equals the fast loop's:
    every synthetic run trains on the same tokens as before that loop was made faster."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    choice = rng.integers(0, 4, size=n)
    want = np.zeros(n, dtype=np.uint16)
    for i in range(1, n):
        want[i] = successors[want[i - 1], choice[i]]
    got = synthetic_tokens(vocab, seed, n)
    assert got.dtype == np.uint16 and np.array_equal(got, want)


def test_stdlib_files_are_the_sorted_py_files_outside_site_packages() -> None:
    """The fast listing (os.walk) names the files Path.rglob finds, in the order of their path in the stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    want = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.parts), key=lambda p: p.relative_to(root).as_posix()
    )
    assert stdlib_files() == want and len(want) > 100


def test_too_short_corpus_is_an_error():
    with pytest.raises(ValueError):
        TokenStream(np.arange(8, dtype=np.uint16), seq_len=8, seed=0)  # needs seq_len + 1 tokens
    assert TokenStream(np.arange(9, dtype=np.uint16), seq_len=8, seed=0).n_windows == 1


# ------------------------------------------------------------------ epochs
def test_windows_cross_epoch_boundaries_as_permutations():
    T, n = 4, 10
    stream = TokenStream(np.arange(n * T + 1, dtype=np.uint16), seq_len=T, seed=3)
    assert stream.n_windows == n
    ids = stream.windows(0, 4 * n)
    epochs = [ids[e * n : (e + 1) * n] for e in range(3)]
    for e, perm in enumerate(epochs):
        assert sorted(perm.tolist()) == list(range(n)), f"epoch {e} is not a permutation"
    tail = ids[3 * n : 3 * n + 5]
    assert len(set(tail.tolist())) == len(tail) and all(0 <= i < n for i in tail)
    # epochs are reshuffled, not repeated
    assert any(not np.array_equal(epochs[0], e) for e in epochs[1:])
    # windows(start, count) is a slice of the same endless sequence, whatever the call order
    again = TokenStream(np.arange(n * T + 1, dtype=np.uint16), seq_len=T, seed=3)
    assert np.array_equal(again.windows(27, 10), ids[27:37])
    assert np.array_equal(again.windows(3, 9), ids[3:12])


def test_batches_beyond_one_epoch_via_data(tmp_path):
    T, B = 4, 3
    path = write_bin(tmp_path / "train.bin", np.arange(41))  # 10 windows of 4 (+1)
    write_bin(tmp_path / "val.bin", np.arange(41))
    cfg = make_cfg(model=dict(seq_len=T, vocab_size=64), data=dict(source="tokens", path=str(path), batch_size=B))
    d = Data(cfg, 0, 1)
    n = d.train.n_windows
    assert n == 10
    starts = []
    for step in range(10):  # 30 windows = 3 epochs
        x, y = d.train_batch(step, 0)
        assert x.shape == (B, T)
        assert torch.equal(x, x[:, :1] + torch.arange(T)) and torch.equal(y, x + 1)
        starts += (x[:, 0] // T).tolist()
    for e in range(3):
        assert sorted(starts[e * n : (e + 1) * n]) == list(range(n))

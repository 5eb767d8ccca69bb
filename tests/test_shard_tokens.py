"""python -m hsdp.prepare --shard-tokens: numbered shards that data.path reads as one stream.

The same corpus prepared in many small shards and in one: the token streams are equal, every
batch is equal, and a run trains bit for bit the same. The folders written before shards
(train.bin, val.bin) still read as they did.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp.config.schema import ConfigError
from hsdp.data.shards import open_tokens, read_header
from hsdp.data.tokens import Data, load_tokens
from hsdp.prepare import main as prepare_main
from hsdp.run.preflight import load_checked_config
from tests.helpers import run_train

TEXT = "<|endoftext|>".join(f"def g{i}(a, b):\n    return a * {i} - b // {i % 5 + 1}\n" for i in range(400))
SHARD = 700  # tokens per shard: the corpus's train split takes several


def tokens(paths: list[Path]) -> np.ndarray:
    return np.concatenate([np.asarray(open_tokens(read_header(p))) for p in paths])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One corpus prepared twice with one tokenizer: in SHARD-token shards ("many") and in one shard ("one")."""
    tmp = tmp_path_factory.mktemp("shards")
    (tmp / "corpus.txt").write_text(TEXT)
    assert prepare_main([str(tmp / "corpus.txt"), "--out", str(tmp / "one"), "--vocab", "300"]) == 0
    tok = ["--tokenizer", str(tmp / "one" / "tokenizer.json")]
    assert prepare_main([str(tmp / "corpus.txt"), "--out", str(tmp / "many"), *tok, "--shard-tokens", str(SHARD)]) == 0
    return {"one": tmp / "one", "many": tmp / "many", "tmp": tmp}


def test_shards_cut_one_stream(folders: dict[str, Path]) -> None:
    """Every shard but the last holds exactly --shard-tokens tokens; together they are the one-shard stream."""
    for split in ("train", "val"):
        many = sorted(folders["many"].glob(f"{split}_*.bin"))
        [one] = sorted(folders["one"].glob(f"{split}_*.bin"))
        assert one.name == f"{split}_000000.bin"
        assert [p.name for p in many] == [f"{split}_{i:06d}.bin" for i in range(len(many))]
        counts = [read_header(p).count for p in many]
        assert all(c == SHARD for c in counts[:-1]) and 0 < counts[-1] <= SHARD
        assert np.array_equal(tokens(many), tokens([one]))
    assert len(list(folders["many"].glob("train_*.bin"))) >= 4
    record = json.loads((folders["many"] / "prepare.json").read_text())
    assert record["shard_tokens"] == SHARD and len(record["shards"]["train"]) >= 4


def config(folder: Path, *extra: str):
    overrides = ["data.source=tokens", f"data.path={folder}", "model.vocab_size=null", "model.seq_len=16"]
    return load_checked_config(None, [*overrides, "data.batch_size=3", *extra])


def test_every_batch_is_the_same(folders: dict[str, Path]) -> None:
    """data.path as the folder or as a glob of the shards: the same windows as one shard, past an epoch."""
    one = Data(config(folders["one"]), 0, 1)
    for path in (folders["many"], folders["many"] / "train_*.bin"):
        many = Data(config(path), 0, 1)
        assert many.train.n_windows == one.train.n_windows and many.val.n_windows == one.val.n_windows
        for i in range(0, 2 * one.train.n_windows // 3, 7):  # every 7th batch over two epochs
            assert all(torch.equal(a, b) for a, b in zip(many.train_batch(i, 0), one.train_batch(i, 0)))
        for i in range(3):
            assert all(torch.equal(a, b) for a, b in zip(many.val_batch(i), one.val_batch(i)))


def test_several_shards_train_bitwise_like_one(folders: dict[str, Path]) -> None:
    common = ["model.seq_len=16", "model.n_layer=1", "model.n_head=2", "model.d_model=16", "data.source=tokens"]
    common += ["model.vocab_size=null", "data.batch_size=4", "run.steps=3", "run.log_every=1", "run.eval_every=0"]
    common += ["run.eval_batches=2", "run.save_model=true", "wandb.mode=disabled"]
    runs = {name: run_train(folders["tmp"], name, [*common, f"data.path={folders[name]}"]) for name in ("one", "many")}
    assert runs["many"].losses == runs["one"].losses
    assert runs["many"].summary["final_val_loss"] == runs["one"].summary["final_val_loss"]
    a, b = runs["many"].params(), runs["one"].params()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_folders_prepared_before_shards_still_read(folders: dict[str, Path], tmp_path: Path) -> None:
    """train.bin / val.bin (what prepare wrote before --shard-tokens): as data.path=DIR/train.bin or DIR."""
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(folders["one"] / "tokenizer.json", old)
    for split in ("train", "val"):
        shutil.copy(folders["one"] / f"{split}_000000.bin", old / f"{split}.bin")
    want = load_tokens(config(folders["one"]))
    for path in (old, old / "train.bin"):
        got = load_tokens(config(path))
        assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))


def test_bad_shard_input_is_one_line(folders: dict[str, Path], tmp_path: Path, capsys) -> None:
    corpus = str(folders["tmp"] / "corpus.txt")
    assert prepare_main([corpus, "--out", str(tmp_path / "x"), "--shard-tokens", "0"]) == 2
    assert "--shard-tokens" in capsys.readouterr().err and not (tmp_path / "x").exists()
    tok = ["--tokenizer", str(folders["one"] / "tokenizer.json")]
    assert prepare_main([corpus, "--out", str(folders["many"]), *tok, "--shard-tokens", "900"]) == 2
    assert "shard_tokens differs" in capsys.readouterr().err  # the folder's shards are kept as they are
    with pytest.raises(ConfigError, match="set data.path to the folder"):  # an old config, a new folder
        config(folders["many"] / "train.bin")
    with pytest.raises(ConfigError, match="holds no train_"):
        config(tmp_path)

"""python -m hsdp.prepare and the llm.c shard format it writes and data.source=tokens reads.

Shards are checked against headers written by hand here (numpy, not hsdp.data.shards),
and tokens against the tokenizer encoding each document whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from hsdp import prepare
from hsdp.config.schema import ConfigError
from hsdp.data.shards import MAGIC, ShardWriter
from hsdp.data.tokens import Data, load_tokens
from hsdp.prepare import EOT, main
from hsdp.run.preflight import load_checked_config
from tests.helpers import QUIET_ENV, REPO, run_train

DOCS = [
    "def f(x):\n    return x * 2  # döubled\n",
    "Привет, мир! 你好 🌍\n\nsecond paragraph\n",
    "tabs\tand  double  spaces \n\n\n  trailing   ",
    "print('hello')\n" * 40,
    "naïve café — “quotes” …\n",
    "class A:\n    pass\n",
    "x = 1\ny = 2\n",
    "¿qué? ¡sí!\n",
    "import os\nimport sys\n",
    "last one\n",
    "The end.",
]


def header(count: int, magic: int = MAGIC, version: int = 1) -> bytes:
    """llm.c's header, written here independently of hsdp.data.shards."""
    h = np.zeros(256, dtype="<i4")
    h[:3] = magic, version, count
    return h.tobytes()


def read_shard(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = path.read_bytes()
    return np.frombuffer(raw[:1024], dtype="<i4"), np.frombuffer(raw[1024:], dtype="<u2")


@pytest.fixture(autouse=True)
def no_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSDP_NO_BAR", "1")  # progress bars write to stderr, where errors are checked


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three files: one document, several separated by <|endoftext|>, and a .jsonl (one per line)."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.txt").write_text(DOCS[0])
    (root / "b.md").write_text(EOT.join(DOCS[1:6]))
    (root / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS[6:]) + "\n")
    (root / "skip.bin").write_bytes(b"\xff\xfe binary")  # not a --suffix: not read
    return root


@pytest.fixture(scope="module")
def prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out") / "data"
    os.environ["HSDP_NO_BAR"] = "1"  # module scope: before the autouse fixture; the test suite's runs set it too
    assert main([str(corpus), "--out", str(out), "--vocab", "300", "--val-fraction", "0.25"]) == 0
    return out


def test_tokenizer_round_trips_every_document(prepared: Path) -> None:
    tok = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    assert tok.get_vocab_size() <= 300 and tok.token_to_id(EOT) is not None
    for text in [*DOCS, "unseen: ∑ λ 🤖 \x00\x7f"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_header_fields_and_split_by_documents(prepared: Path) -> None:
    """Magic, version, count; each document whole on one side (every 4th at 0.25), EOT before each."""
    tok = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    expected = {"train": [], "val": []}
    for i, doc in enumerate(DOCS):
        split = "val" if int((i + 1) * 0.25) > int(i * 0.25) else "train"
        expected[split] += [eot, *tok.encode(doc, add_special_tokens=False).ids]
    assert [i for i in range(len(DOCS)) if int((i + 1) * 0.25) > int(i * 0.25)] == [3, 7]
    for split, ids in expected.items():
        head, tokens = read_shard(prepared / f"{split}_000000.bin")
        assert list(head[:3]) == [20240520, 1, len(tokens)] and not head[3:].any()
        assert tokens.tolist() == ids
    manifest = json.loads((prepared / "prepare.json").read_text())
    assert manifest["complete"] and manifest["splits"]["val"]["documents"] == 2


def test_long_document_in_chunks_equals_whole(tmp_path: Path, prepared: Path) -> None:
    """A document read in 64-byte pieces (cut at pre-token boundaries) encodes to the tokens of the whole."""
    tok = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    text = "".join(DOCS) * 5 + "x" * 300  # a 300-char word has no cut point: cut after 64 chunks at worst
    (tmp_path / "long.txt").write_text(text)
    (tmp_path / "other.txt").write_text("tiny\n")
    corpus = prepare.Corpus([tmp_path / "long.txt", tmp_path / "other.txt"], 0, [])
    pieces = [p for _, _, p, _ in prepare.documents(corpus, prepare.Split(0.5), 64)]
    assert len(pieces) > 10 and "".join(pieces[:-1]) == text
    out = tmp_path / "out"
    out.mkdir()
    prepare.encode_corpus(tok, corpus, out, prepare.Split(0.5), bar=False, chunk_bytes=64)
    _, tokens = read_shard(out / "train_000000.bin")
    assert tokens.tolist() == [tok.token_to_id(EOT), *tok.encode(text, add_special_tokens=False).ids]


def test_given_tokenizer_and_rerun(prepared: Path, corpus: Path, tmp_path: Path, capsys) -> None:
    """--tokenizer reuses one; the same command again changes nothing; another corpus in --out is refused."""
    out = tmp_path / "again"
    args = [str(corpus), "--out", str(out), "--tokenizer", str(prepared / "tokenizer.json"), "--val-fraction", "0.25"]
    assert main(args) == 0
    assert (out / "train_000000.bin").read_bytes() == (prepared / "train_000000.bin").read_bytes()
    mtime = (out / "train_000000.bin").stat().st_mtime_ns
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().err
    assert (out / "train_000000.bin").stat().st_mtime_ns == mtime
    assert main([str(corpus / "a.txt"), str(corpus / "b.md"), *args[1:]]) == 2
    assert "different corpus" in capsys.readouterr().err
    assert (out / "train_000000.bin").stat().st_mtime_ns == mtime


def _exit_2_with_one_line(argv: list[str], capsys, needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_bad_input_refused_before_any_output(corpus: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    _exit_2_with_one_line(["--out", str(out)], capsys, "no INPUT")
    _exit_2_with_one_line([str(tmp_path / "missing.txt"), "--out", str(out)], capsys, "missing.txt")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.txt")
    _exit_2_with_one_line([str(tmp_path / "dangling.txt"), "--out", str(out)], capsys, "dangling.txt")
    _exit_2_with_one_line([str(tmp_path / "*.nothing"), "--out", str(out)], capsys, "matches no files")
    _exit_2_with_one_line([str(corpus), "--out", str(out), "--vocab", "70000"], capsys, "--vocab")
    _exit_2_with_one_line([str(corpus), "--out", str(out), "--vocab", "100"], capsys, "--vocab")
    _exit_2_with_one_line([str(corpus), "--out", str(out), "--val-fraction", "1"], capsys, "--val-fraction")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    _exit_2_with_one_line([str(tmp_path / "latin1.txt"), "--out", str(out)], capsys, "not UTF-8")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
    _exit_2_with_one_line([str(tmp_path / "bad.jsonl"), "--out", str(out)], capsys, "line 2")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "train.bin").write_bytes(b"\0\0")
    _exit_2_with_one_line([str(corpus), "--out", str(foreign)], capsys, "not written by hsdp.prepare")
    (tmp_path / "empty.txt").write_text("")
    _exit_2_with_one_line([str(tmp_path / "empty.txt"), "--out", str(out)], capsys, "no text")
    assert not (out / "train_000000.bin").exists() and not list(out.glob(".*tmp*"))
    assert (foreign / "train.bin").read_bytes() == b"\0\0"


def test_interrupted_prepare_leaves_no_final_shard(corpus: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """Ctrl-C while encoding: no shard, no temporary file left; a rerun completes."""
    out = tmp_path / "out"
    calls = []

    def interrupt(self, tokens):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ShardWriter, "write", interrupt)
        assert main([str(corpus), "--out", str(out), "--vocab", "300"]) == 130
        assert not out.exists()  # this run made the folder: it is gone with what the run wrote
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        calls.clear()
        assert main([str(corpus), "--out", str(out), "--vocab", "300"]) == 130
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # no manifest, tokenizer, shard or temporary
    assert main([str(corpus / "a.txt"), "--out", str(out), "--vocab", "300"]) == 0  # any corpus is welcome
    assert main([str(corpus), "--out", str(tmp_path / "other"), "--vocab", "300"]) == 0
    out = tmp_path / "other"
    assert (out / "train_000000.bin").is_file() and (out / "val_000000.bin").is_file()


def test_killed_prepare_leaves_no_final_shard(prepared: Path, tmp_path: Path) -> None:
    """kill -9 mid-encode: only a temporary name exists; the next run removes it and finishes."""
    big = tmp_path / "big.txt"
    big.write_text(EOT.join(DOCS * 2) * 600)  # ~1 MB, encoded 256 KiB per batch: a shard is open after the first
    out = tmp_path / "out"
    # The command's own main with smaller encode batches (4 MiB by default, which would need a ~10 MB corpus to
    # catch the shard open): what is tested, a kill leaving only a temporary name, does not depend on it.
    main = "import sys, hsdp.prepare as p; p.BATCH_CHARS = 1 << 18; sys.exit(p.main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", main, str(big), "--out", str(out)]
    cmd += ["--tokenizer", str(prepared / "tokenizer.json")]
    env = {**os.environ, **QUIET_ENV}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob(".train_000000.bin.tmp-*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        assert proc.poll() is None, "prepare finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(out.glob(".train_000000.bin.tmp-*")) and not (out / "train_000000.bin").exists()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "train_000000.bin").is_file() and not list(out.glob(".*tmp*"))


# ----------------------------------------------------------------- data.source=tokens
def tokens_cfg(path: Path, *extra: str):
    return load_checked_config(
        None, ["data.source=tokens", f"data.path={path}", "model.seq_len=8", "data.batch_size=2", *extra]
    )


def test_hand_written_llmc_shard_loads(tmp_path: Path) -> None:
    ids = np.arange(1000, dtype="<u2")[::-1].copy()  # distinct ids: a row's first id says where it starts
    (tmp_path / "train.bin").write_bytes(header(len(ids)) + ids.tobytes())
    (tmp_path / "val.bin").write_bytes(header(100) + ids[:100].tobytes())
    cfg = tokens_cfg(tmp_path / "train.bin", "model.vocab_size=1000")
    train, val = load_tokens(cfg)
    assert np.array_equal(np.asarray(train), ids) and np.array_equal(np.asarray(val), ids[:100])
    x, y = Data(cfg, 0, 1).train_batch(0, 0)
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        start = 999 - int(row_x[0])
        assert start % 8 == 0
        assert row_x.tolist() == ids[start : start + 8].tolist()
        assert row_y.tolist() == ids[start + 1 : start + 9].tolist()


def test_glob_of_shards_reads_as_one_stream(tmp_path: Path) -> None:
    """fineweb_train_*.bin are concatenated in order (windows cross shard boundaries); fineweb_val_* is val."""
    ids = np.arange(5000, dtype="<u2")
    for i, part in enumerate(np.array_split(ids, 3)):
        (tmp_path / f"fineweb_train_{i + 1:06d}.bin").write_bytes(header(len(part)) + part.tobytes())
    (tmp_path / "fineweb_val_000000.bin").write_bytes(header(50) + ids[:50].tobytes())
    cfg = tokens_cfg(tmp_path / "fineweb_train_*.bin", "model.vocab_size=5000")
    train, val = load_tokens(cfg)
    assert len(train) == 5000 and np.array_equal(train[1660:1680], ids[1660:1680])  # across a boundary
    assert np.array_equal(np.asarray(val), ids[:50])
    (tmp_path / "fineweb_val_000000.bin").unlink()  # no val shards: the tail of train is held out
    train, val = load_tokens(tokens_cfg(tmp_path / "fineweb_train_*.bin", "model.vocab_size=5000"))
    assert len(train) == 4500 and np.array_equal(val[0:500], ids[4500:])


def test_vocab_size_null_takes_the_tokenizers(prepared: Path, tmp_path: Path) -> None:
    cfg = tokens_cfg(prepared, "model.vocab_size=null")
    assert cfg.model.vocab_size == Tokenizer.from_file(str(prepared / "tokenizer.json")).get_vocab_size()
    with pytest.raises(ConfigError, match="smaller than"):
        tokens_cfg(prepared, "model.vocab_size=257")
    bare = tmp_path / "train.bin"
    bare.write_bytes((prepared / "train_000000.bin").read_bytes())
    with pytest.raises(ConfigError, match="model.vocab_size: null"):
        tokens_cfg(bare, "model.vocab_size=null")


BAD_SHARDS = {
    "magic": header(20, magic=1234) + bytes(40),
    "version": header(20, version=2) + bytes(40),
    "length": header(30) + bytes(40),
    "id": header(100) + np.full(100, 400, dtype="<u2").tobytes(),
}


@pytest.mark.parametrize("bad", sorted(BAD_SHARDS))
def test_bad_shards_refused_with_exit_2(tmp_path: Path, bad: str) -> None:
    """A bad magic/version/length or an id >= model.vocab_size: train.py exits 2 with one line naming the file."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(BAD_SHARDS[bad])
    overrides = ["data.source=tokens", f"data.path={data / 'train.bin'}", "model.vocab_size=300", "model.seq_len=4"]
    overrides += ["data.batch_size=1", "run.steps=1", "wandb.mode=disabled"]
    run = run_train(tmp_path, "bad", overrides, check=False, timeout=60)
    assert run.returncode == 2, run.stderr
    line = run.stderr.strip()
    assert len(line.splitlines()) == 1 and "train.bin" in line and "data.path" in line, line
    assert {"magic": "magic", "version": "version", "length": "truncated", "id": "token id 400"}[bad] in line
    assert not (tmp_path / "bad").exists()


# ----------------------------------------------------------------- bounded pre-tokens, the split, identity
def test_long_pretokens_are_cut_and_normal_text_encodes_as_before(tmp_path: Path) -> None:
    """A whitespace-free document: no pre-token of the trained tokenizer exceeds the bound (BPE training cost
    grows with the square of a pre-token's length; this is what keeps 10 MB of it at seconds), the shards
    equal encoding with tokenizer.json (what hsdp.sample uses), and normal text has GPT-2's pre-tokens."""
    (tmp_path / "nospace.txt").write_text("ab" * 50_000 + "é" * 300)  # 100 KB, then 2-byte chars
    (tmp_path / "other.txt").write_text(EOT.join(DOCS))
    out = tmp_path / "out"
    assert main([str(tmp_path / "nospace.txt"), str(tmp_path / "other.txt"), "--out", str(out), "--vocab", "300"]) == 0
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    nospace = (tmp_path / "nospace.txt").read_text()
    pieces = tok.pre_tokenizer.pre_tokenize_str(nospace)
    assert max(len(p) for p, _ in pieces) == prepare.MAX_PRETOKEN_BYTES  # byte-level: one character a byte
    assert "".join(p for p, _ in pieces) == "".join(
        p for p, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(nospace)
    )
    assert tok.decode(tok.encode(nospace, add_special_tokens=False).ids) == nospace
    ids = [tok.token_to_id(EOT), *tok.encode(nospace, add_special_tokens=False).ids]
    assert read_shard(out / "train_000000.bin")[1].tolist()[: len(ids)] == ids
    plain = Tokenizer.from_str(tok.to_str())  # the same model behind GPT-2's pre-tokenizer alone
    plain.pre_tokenizer = ByteLevel(add_prefix_space=False)
    normal = [*DOCS, (REPO / "hsdp" / "prepare.py").read_text(), (REPO / "README.md").read_text()]
    for text in normal:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == plain.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text


def _shard_text(tok: Tokenizer, path: Path) -> list[str]:
    """The documents of a shard, decoded (split at the end-of-text id)."""
    ids = read_shard(path)[1].tolist()
    eot, docs = tok.token_to_id(EOT), []
    for i in ids:
        if i == eot:
            docs.append([])
        else:
            docs[-1].append(i)
    return [tok.decode(d) for d in docs]


def test_one_document_gives_val_its_tail(tmp_path: Path, capsys) -> None:
    """One document: val is its last F (from a pre-token start), train the rest; together the document."""
    doc = "".join(f"line {i}: the quick brown fox\n" for i in range(200))
    (tmp_path / "one.txt").write_text(doc)
    out = tmp_path / "out"
    assert main([str(tmp_path / "one.txt"), "--out", str(out), "--vocab", "280", "--val-fraction", "0.25"]) == 0
    assert "val is the last document's tail" in capsys.readouterr().err
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    [head], [tail] = _shard_text(tok, out / "train_000000.bin"), _shard_text(tok, out / "val_000000.bin")
    assert head + tail == doc and tail[0] in " \n" and not tail[1].isspace()
    assert abs(len(tail) - 0.25 * len(doc)) < 10  # the cut moved on to the next pre-token start only
    manifest = json.loads((out / "prepare.json").read_text())
    assert manifest["splits"]["val"]["documents"] == 1 and manifest["val_is_tail_of_document"] == 0


def test_touching_an_input_keeps_the_corpus_editing_it_does_not(prepared: Path, corpus: Path, tmp_path: Path, capsys):
    """Identity is path, size and SHA-256: a new mtime is the same corpus; same size, other bytes is not."""
    files = sorted(corpus.iterdir())
    copy = tmp_path / "corpus"
    copy.mkdir()
    for f in files:
        (copy / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out"
    args = [str(copy), "--out", str(out), "--vocab", "300", "--val-fraction", "0.25"]
    assert main(args) == 0
    capsys.readouterr()
    os.utime(copy / "a.txt", ns=(1, 1))
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().err
    saved = json.loads((out / "prepare.json").read_text())  # a manifest from before hashes: mtimes
    old = {**saved, "files": [[p, size, Path(p).stat().st_mtime_ns] for p, size, _ in saved["files"]]}
    (out / "prepare.json").write_text(json.dumps(old))
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().err
    (out / "prepare.json").write_text(json.dumps(saved))
    (copy / "a.txt").write_text(DOCS[0].replace("x", "y"))  # same size, other content
    _exit_2_with_one_line(args, capsys, "different corpus (files differs")


def test_failure_after_output_began_removes_what_it_wrote(corpus: Path, tmp_path: Path, monkeypatch, capsys):
    """An error while training (here a full disk) removes the manifest and tokenizer; a kill -9's leftovers
    (an unfinished manifest of another corpus) do not block another corpus."""
    out = tmp_path / "out"

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(out / "tokenizer.json"))

    with monkeypatch.context() as m:
        m.setattr(prepare, "train_tokenizer", disk_full)
        _exit_2_with_one_line([str(corpus), "--out", str(out), "--vocab", "300"], capsys, "No space left")
    assert not out.exists()
    out.mkdir()  # what a killed prepare of another corpus leaves
    (out / "prepare.json").write_text(json.dumps({"files": [["/elsewhere", 1, "00"]], "complete": False}))
    (out / "tokenizer.json").write_text("{}")
    (out / ".train.bin.tmp-1").write_bytes(b"\0")
    assert main([str(corpus), "--out", str(out), "--vocab", "300"]) == 0
    assert "unfinished prepare of another corpus" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [
        "prepare.json",
        "tokenizer.json",
        "train_000000.bin",
        "val_000000.bin",
    ]

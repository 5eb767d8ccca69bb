"""python -m hsdp.sample: deterministic for a seed, greedy = argmax of the exported model, the run's tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from hsdp.export import export
from hsdp.model import GPT
from hsdp.prepare import main as prepare_main
from hsdp.run.checkpoint import latest_checkpoint, read_saved_config
from hsdp.sample import main
from tests.helpers import QUIET_ENV, REPO, run_train

TINY = [
    "model.arch=llama",
    "model.bias=false",
    "model.seq_len=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=16",
    "data.batch_size=4",
    "run.steps=20",
    "run.checkpoint_every=20",
    "run.eval_every=0",
    "run.eval_batches=1",
    "wandb.mode=disabled",
]
TEXT = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(300))


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sample")
    (tmp / "corpus.txt").write_text(TEXT)
    run_train(tmp, "bytes", TINY + ["data.source=text", f"data.path={tmp / 'corpus.txt'}"])
    return tmp / "bytes"


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sample-bpe")
    corpus = tmp / "corpus.txt"
    corpus.write_text("<|endoftext|>".join(TEXT[i : i + 500] for i in range(0, len(TEXT), 500)))
    assert prepare_main([str(corpus), "--out", str(tmp / "data"), "--vocab", "320"]) == 0
    overrides = TINY + ["data.source=tokens", f"data.path={tmp / 'data' / 'train.bin'}", "model.vocab_size=null"]
    run_train(tmp, "bpe", overrides)
    return tmp / "bpe"


def sample(capsys: pytest.CaptureFixture, *argv: str) -> str:
    torch.set_num_threads(1)
    assert main([*argv]) == 0
    return capsys.readouterr().out


def test_same_seed_same_text_other_seed_other_text(byte_run: Path, capsys) -> None:
    args = [str(byte_run), "--tokens", "60", "--temperature", "1.0", "--top-k", "0"]
    a, b = sample(capsys, *args, "--seed", "3"), sample(capsys, *args, "--seed", "3")
    assert a == b and len(a) > 10
    assert sample(capsys, *args, "--seed", "4") != a


def test_greedy_is_the_argmax_of_the_exported_model(byte_run: Path, capsys) -> None:
    """Temperature 0: each byte is the exported model's most likely next byte (computed here, step by step)."""
    out = sample(capsys, str(byte_run), "--prompt", "def f", "--tokens", "12", "--temperature", "0")
    checkpoint = latest_checkpoint(byte_run)
    cfg = read_saved_config(checkpoint)
    model = GPT(cfg.model)
    model.load_state_dict(export(checkpoint)[0])
    ids = list(b"def f")
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids[-cfg.model.seq_len :]]))[0, -1, :256].argmax()))
    assert out == bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_uses_the_runs_tokenizer(bpe_run: Path, capsys) -> None:
    out = sample(capsys, str(bpe_run), "--prompt", "def f1", "--tokens", "20", "--seed", "1")
    assert out.startswith("def f1") and len(out) > len("def f1") + 5
    tok = Tokenizer.from_file(str(Path(read_saved_config(bpe_run).data.path).parent / "tokenizer.json"))
    assert read_saved_config(bpe_run).model.vocab_size == tok.get_vocab_size()


def test_bad_input_exits_2(byte_run: Path, tmp_path: Path, capsys) -> None:
    for argv in ([str(tmp_path / "nothing")], [str(byte_run), "--tokens", "0"], [str(byte_run), "--top-k", "-1"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error:"), err


def test_command_line(byte_run: Path) -> None:
    cmd = [sys.executable, "-m", "hsdp.sample", str(byte_run), "--tokens", "8", "--seed", "5", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **QUIET_ENV})
    assert proc.returncode == 0, proc.stderr
    assert "sampling" in proc.stderr and proc.stdout.endswith("\n")

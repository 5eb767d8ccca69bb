"""python -m hsdp.sample: deterministic for a seed, greedy = argmax of the exported model, the run's tokenizer."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import hsdp.export as hsdp_export
import hsdp.sample as hsdp_sample
from hsdp.export import export
from hsdp.export import main as export_main
from hsdp.models.gpt import GPT
from hsdp.prepare import main as prepare_main
from hsdp.run.checkpoint import latest_checkpoint, read_saved_config
from hsdp.sample import main
from tests.helpers import QUIET_ENV, REPO, as_ctrl_c_reaches_it, run_train

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
    overrides = TINY + ["data.source=tokens", f"data.path={tmp / 'data'}", "model.vocab_size=null"]
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
    tok = Tokenizer.from_file(str(Path(read_saved_config(bpe_run).data.path) / "tokenizer.json"))  # the prepared folder
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


def _one_line_error(capsys: pytest.CaptureFixture, argv: list[str], needle: str, code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    return err


def test_bad_flags_refused_before_anything_is_loaded(tmp_path: Path, capsys) -> None:
    """A nan, infinite or negative temperature, a negative top-k, a missing --tokenizer: one line, exit 2,
    even with a path that does not exist (the flags are checked first)."""
    missing = str(tmp_path / "no-run")
    for flag, value in [("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-inf")]:
        _one_line_error(capsys, [missing, f"{flag}={value}"], "--temperature")
    _one_line_error(capsys, [missing, "--temperature=-0.5"], "--temperature")
    _one_line_error(capsys, [missing, "--top-k=-1"], "--top-k")
    _one_line_error(capsys, [missing, "--tokenizer", str(tmp_path / "none.json")], "--tokenizer")


def test_ctrl_c_keeps_the_text_so_far(byte_run: Path, capsys, monkeypatch) -> None:
    """Ctrl-C after 7 tokens: the 7 tokens' text (the same seed's full text begins with it), one line, 130."""
    args = [str(byte_run), "--tokens", "30", "--temperature", "1.0", "--top-k", "0", "--seed", "2"]
    full = sample(capsys, *args)
    real = hsdp_sample.generate

    def interrupted(*a, **k):
        for i, token in enumerate(real(*a, **k)):
            if i == 7:
                raise KeyboardInterrupt
            yield token

    monkeypatch.setattr(hsdp_sample, "generate", interrupted)
    assert main(args) == 130
    got = capsys.readouterr()
    assert got.err.strip().splitlines()[-1] == "interrupted after 7 of 30 tokens"
    assert full.startswith(got.out[:-1]) and got.out.endswith("\n") and len(got.out) > 1


def test_sigint_mid_stream(byte_run: Path) -> None:
    """A real Ctrl-C (SIGINT) while printing: text already on stdout, exit 130, no traceback."""
    cmd = [sys.executable, "-m", "hsdp.sample", str(byte_run), "--tokens", "1000000", "--device", "cpu"]
    env = {**os.environ, **QUIET_ENV}
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=as_ctrl_c_reaches_it
    )
    try:
        first = proc.stdout.read(20)  # streamed: arrives long before a million tokens are done
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert len(first) == 20 and proc.returncode == 130, err
    assert b"Traceback" not in err and err.decode().strip().splitlines()[-1].startswith("interrupted after")


def test_tokenizer_of_another_size_is_refused(bpe_run: Path, tmp_path: Path, capsys) -> None:
    """The run's tokenizer has 320 ids: one of 300 or of 400 is refused, naming both sizes."""
    (tmp_path / "c.txt").write_text(TEXT)
    for vocab in (300, 400):
        assert prepare_main([str(tmp_path / "c.txt"), "--out", str(tmp_path / str(vocab)), "--vocab", str(vocab)]) == 0
        capsys.readouterr()  # prepare's progress and summary
        other = tmp_path / str(vocab) / "tokenizer.json"
        err = _one_line_error(capsys, [str(bpe_run), "--tokenizer", str(other)], f"has {vocab} ids")
        assert "320" in err


def test_elastic_run_folder_samples_the_newest_replica_checkpoint(byte_run: Path, tmp_path: Path, capsys) -> None:
    """RUN/replica<m>/checkpoints/step_N (no final model): the newest, replica 0's on a tie, as sampling it."""
    run = tmp_path / "elastic"
    run.mkdir()
    shutil.copy(byte_run / "config.yaml", run / "config.yaml")
    _one_line_error(capsys, [str(run)], "replica<m>/checkpoints")
    step = latest_checkpoint(byte_run)
    for m in (0, 1):
        shutil.copytree(step, run / f"replica{m}" / "checkpoints" / step.name)
    greedy = ["--prompt", "def f", "--tokens", "10", "--temperature", "0"]
    assert sample(capsys, str(run), *greedy) == sample(capsys, str(step), *greedy)
    assert main([str(run), *greedy]) == 0
    assert f"replica0/checkpoints/{step.name}" in capsys.readouterr().err


def test_checkpoint_pruned_while_read_retries_the_newest(byte_run: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """The run deletes its newest checkpoint while sample reads it: sample reads the newest left, once."""
    run = tmp_path / "run"
    shutil.copytree(byte_run, run)
    newest = latest_checkpoint(run)
    shutil.copytree(newest, run / "checkpoints" / "step_1")  # an older one (its content does not matter)
    real = hsdp_export.read_checkpoint
    calls = []

    def pruned_first(checkpoint, *a):
        calls.append(checkpoint)
        if len(calls) == 1:
            shutil.rmtree(checkpoint)  # as prune() does, between the checks and the read
        return real(checkpoint, *a)

    monkeypatch.setattr(hsdp_export, "read_checkpoint", pruned_first)
    assert main([str(run), "--tokens", "4"]) == 0
    assert calls == [newest, run / "checkpoints" / "step_1"]
    assert "step_1 on" in capsys.readouterr().err
    calls.clear()
    (run / "checkpoints" / "step_1" / ".complete").unlink()  # named explicitly: no other will do
    newest = latest_checkpoint(byte_run)
    shutil.copytree(newest, run / "checkpoints" / newest.name)
    _one_line_error(capsys, [str(run / "checkpoints" / newest.name)], "deleted while it was read")


def test_export_names_a_missing_checkpoint_and_lists_the_runs(byte_run: Path, tmp_path: Path, capsys) -> None:
    missing = byte_run / "checkpoints" / "step_5"
    assert export_main([str(missing), str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err and latest_checkpoint(byte_run).name in err, err
    assert not (tmp_path / "m.pt").exists()

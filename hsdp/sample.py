"""Print text sampled from a trained model (one process, CPU or CUDA).

    python -m hsdp.sample RUN_DIR_OR_CHECKPOINT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S]

The model: a checkpoint folder, or a run folder's latest complete checkpoint, as
`hsdp.export` exports it (θ_g when the run keeps one); a run folder whose final
`model.replica0.pt` is newer than its last checkpoint (or that has none) uses that.
An elastic run folder: the newest complete checkpoint of any replica
(`replica<m>/checkpoints`, replica 0's on a tie), or its final `model.replica<m>.pt`
(the lowest m). A checkpoint pruned while it is read (a run still training) is
retried once with the run's newest.
The tokenizer: `--tokenizer`, else the `tokenizer.json` beside the run's
`data.path`, else bytes (byte-level runs; ids ≥ 256 are never sampled then). A
tokenizer whose size is not the model's vocabulary is refused, except a model padded
beyond it to a multiple of 64 (llm.c's 50304 for GPT-2's 50257), which then samples
only the tokenizer's ids.
Sampling: the last `model.seq_len` tokens are the context; logits / T, the top
K kept, one draw from a generator seeded with S (T = 0: the most likely token).
Text is printed as it is generated; Ctrl-C ends it there (exit 130).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from hsdp.config.schema import Config, ConfigError
from hsdp.data.tokens import tokenizer_path
from hsdp.export import CheckpointGone, export, run_checkpoints
from hsdp.models.gpt import GPT
from hsdp.run.checkpoint import read_saved_config, step_of
from hsdp.run.checkpoint.find import checkpoint_step

BYTES = 256


class ByteCodec:
    """Bytes as token ids (the stdlib, text and byte-level token sources)."""

    eot = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class TokenizerCodec:
    """A tokenizer.json (as hsdp.prepare writes it)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception for a missing or malformed file
            raise ConfigError(f"tokenizer: cannot load {path} ({str(e).splitlines()[0]})") from None
        self.eot = self.tok.token_to_id("<|endoftext|>")
        self.path = path
        self.size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def newest_checkpoint(run: Path) -> Optional[Path]:
    """The run's newest complete checkpoint: its own, or an elastic replica's (replica 0's on a tie)."""
    found = run_checkpoints(run)  # the run's own, then replica 0's, 1's, ... each oldest first
    return max(found, key=checkpoint_step, default=None)  # max keeps the first of equals: the lowest replica


def final_model(run: Path) -> Optional[Path]:
    """The run's final model.replica<m>.pt of the lowest m (replica 0 unless it was given up)."""
    finals = sorted(run.glob("model.replica[0-9]*.pt"), key=lambda p: int(p.name[13:-3]))
    return finals[0] if finals else None


def pick_model(path: Path) -> tuple[Optional[Path], Optional[Path], Config]:
    """(checkpoint or None, final model file or None, config) for a checkpoint or run folder (see the doc)."""
    if not path.is_dir():
        raise ConfigError(f"path: {path} is not a run folder or checkpoint folder")
    if (path / "meta.json").is_file():
        return path, None, read_saved_config(path, key="checkpoint")
    cfg = read_saved_config(path, key="run folder")
    checkpoint, final = newest_checkpoint(path), final_model(path)
    if final is not None and (checkpoint is None or (step_of(checkpoint) or 0) < cfg.run.steps - 1):
        return None, final, cfg
    if checkpoint is None:
        raise ConfigError(
            f"path: {path} has no complete checkpoint (in checkpoints/ or replica<m>/checkpoints/) and no "
            "model.replica<m>.pt to sample from"
        )
    return checkpoint, None, cfg


def load_model(path: Path, picked: tuple[Optional[Path], Optional[Path], Config]) -> tuple[GPT, Config, str]:
    """The model `pick_model(path)` picked (see the module doc), its config, and what it is."""
    checkpoint, final, cfg = picked
    if checkpoint is not None:
        try:
            state, what = export(checkpoint)
        except CheckpointGone:
            if checkpoint == path:  # the user named this checkpoint: no other will do
                raise
            checkpoint, final, cfg = pick_model(path)  # pruned by the run, still training: its newest now
            if checkpoint is not None:
                state, what = export(checkpoint)
    if final is not None:
        state, what = torch.load(final, map_location="cpu"), str(final)
    else:
        what = f"{what} of {checkpoint}"
    model = GPT(cfg.model)
    model.load_state_dict(state)
    return model.eval(), cfg, what


def load_codec(cfg: Config, given: Optional[Path]) -> Any:
    """The run's tokenizer (see the module doc), its size checked against the model's vocabulary."""
    vocab = cfg.model.vocab_size
    assert vocab is not None  # a run's saved config holds the resolved size (hsdp.run.preflight)
    path = given or tokenizer_path(cfg)
    if path is None:
        if cfg.data.source == "tokens" and vocab > BYTES:
            raise ConfigError(
                f"tokenizer: no tokenizer.json beside data.path {cfg.data.path!r} and the vocabulary is larger "
                "than bytes; pass --tokenizer"
            )
        return ByteCodec()
    codec = TokenizerCodec(path)
    own = tokenizer_path(cfg)
    if own is not None and path != own:  # the run was prepared with its own: another must be the same size
        own_size = TokenizerCodec(own).size
        if codec.size != own_size:
            raise ConfigError(
                f"tokenizer: {path} has {codec.size} ids but the run's own {own} has {own_size} (the model's "
                f"vocabulary is {vocab}); give a tokenizer of the run's vocabulary"
            )
    # A model padded beyond its tokenizer (llm.c: GPT-2's 50257 ids in 50304) trained only on the tokenizer's
    # ids; training checked the run's own tokenizer against the model, a given one is trusted to 64 ids.
    padded = codec.size < vocab and (own is not None or vocab == -(-codec.size // 64) * 64)
    if codec.size != vocab and not padded:
        raise ConfigError(
            f"tokenizer: {path} has {codec.size} ids but the model's vocabulary is {vocab}; "
            "give the tokenizer the run was prepared with"
        )
    return codec


@torch.no_grad()
def generate(
    model: GPT,
    prompt: list[int],
    n: int,
    temperature: float,
    top_k: int,
    seed: int,
    allowed: int,
    device: torch.device,
) -> Iterator[int]:
    """n new ids after `prompt`, one at a time, drawn only among ids < `allowed`."""
    generator = torch.Generator(device).manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(n):
        logits = model(idx[:, -model.cfg.seq_len :])[0, -1, :allowed].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < allowed:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        yield nxt
        idx = torch.cat([idx, torch.tensor([[nxt]], device=device)], dim=1)


class TextStream:
    """Decoded text printed as ids arrive; ids that end inside a character wait for the ones completing it.

    Ids are decoded from the last point where the text so far ended on a whole character, so the
    printed text equals decoding all ids at once."""

    def __init__(self, codec: Any, out: Any) -> None:
        self.codec, self.out, self.count = codec, out, 0
        self.pending: list[int] = []

    def add(self, token: int) -> None:
        self.pending.append(token)
        self.count += 1
        text = self.codec.decode(self.pending)
        if not text.endswith("\ufffd"):  # U+FFFD at the end: maybe a character still incomplete
            self.write(text)

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        self.pending = []

    def close(self) -> None:
        """Print what is still pending, and end the line."""
        self.write((self.codec.decode(self.pending) if self.pending else "") + "\n")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hsdp.sample", description=__doc__.splitlines()[0])
    p.add_argument(
        "path",
        type=Path,
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run folder (its newest complete checkpoint or final model) or a checkpoint folder",
    )
    p.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    p.add_argument("--tokens", type=int, default=200, help="ids to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the K most likely ids; 0 = all (default 50)")
    p.add_argument(
        "--seed", type=int, default=0, help="the sampling generator's seed: same seed, same text (default 0)"
    )
    p.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json (default: the run's)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> torch.device:
    """The flags alone (ConfigError, one line); the device to sample on."""
    if args.tokens < 1:
        raise ConfigError(f"--tokens: expected an integer >= 1, got {args.tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature: expected a finite value >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k: expected an integer >= 1, or 0 for all ids, got {args.top_k}")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        raise ConfigError(f"--tokenizer: {args.tokenizer} is not a file")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"--device: expected cpu or cuda (with a GPU), got {device!r}")
    return torch.device(device)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        device = check_args(args)
        picked = pick_model(args.path)
        codec = load_codec(picked[2], args.tokenizer)  # a tokenizer that does not fit: refused before the weights
        model, cfg, what = load_model(args.path, picked)
        prompt = codec.encode(args.prompt)
        if not prompt:  # a new document: what precedes every document in training
            prompt = [codec.eot] if codec.eot is not None else codec.encode("\n")
        vocab = cfg.model.vocab_size
        assert vocab is not None  # a run's saved config holds the resolved size (hsdp.run.preflight)
        allowed = min(vocab, BYTES if isinstance(codec, ByteCodec) else codec.size)
        if max(prompt) >= vocab:
            raise ConfigError(f"--prompt: encodes to id {max(prompt)}, beyond the model's {vocab}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted before sampling began", file=sys.stderr)
        return 130
    print(f"sampling {what} on {device}", file=sys.stderr)
    stream = TextStream(codec, sys.stdout)
    try:
        stream.write(args.prompt)
        for token in generate(
            model.to(device), prompt, args.tokens, args.temperature, args.top_k, args.seed, allowed, device
        ):
            stream.add(token)
        stream.close()
    except KeyboardInterrupt:
        stream.close()
        print(f"interrupted after {stream.count} of {args.tokens} tokens", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (e.g. | head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

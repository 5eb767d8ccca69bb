"""Print text sampled from a trained model (one process, CPU or CUDA).

    python -m hsdp.sample RUN_DIR_OR_CHECKPOINT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S]

The model: a checkpoint folder, or a run folder's latest complete checkpoint, as
`hsdp.export` exports it (θ_g when the run keeps one); a run folder whose final
`model.replica0.pt` is newer than its last checkpoint (or that has none) uses that.
The tokenizer: `--tokenizer`, else the `tokenizer.json` beside the run's
`data.path`, else bytes (byte-level runs; ids ≥ 256 are never sampled then).
Sampling: the last `model.seq_len` tokens are the context; logits / T, the top
K kept, one draw from a generator seeded with S (T = 0: the most likely token).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from hsdp.config.schema import Config, ConfigError
from hsdp.data import tokenizer_path
from hsdp.export import export
from hsdp.model import GPT
from hsdp.run.checkpoint import latest_checkpoint, read_saved_config, step_of

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

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def load_model(path: Path) -> tuple[GPT, Config, str]:
    """The model a checkpoint or run folder holds (see the module doc), its config, and what it is."""
    if not path.is_dir():
        raise ConfigError(f"path: {path} is not a run folder or checkpoint folder")
    if (path / "meta.json").is_file():
        checkpoint: Optional[Path] = path
        cfg = read_saved_config(path, key="checkpoint")
    else:
        cfg = read_saved_config(path, key="run folder")
        checkpoint = latest_checkpoint(path)
        final = path / "model.replica0.pt"
        if final.is_file() and (checkpoint is None or (step_of(checkpoint) or 0) < cfg.run.steps - 1):
            checkpoint = None
        elif checkpoint is None:
            raise ConfigError(f"path: {path} has no complete checkpoint and no model.replica0.pt to sample from")
    if checkpoint is not None:
        state, what = export(checkpoint)
        what = f"{what} of {checkpoint}"
    else:
        state, what = torch.load(path / "model.replica0.pt", map_location="cpu"), f"{path / 'model.replica0.pt'}"
    model = GPT(cfg.model)
    model.load_state_dict(state)
    return model.eval(), cfg, what


def load_codec(cfg: Config, given: Optional[Path]) -> Any:
    """The run's tokenizer (see the module doc)."""
    path = given or tokenizer_path(cfg)
    if path is not None:
        return TokenizerCodec(path)
    if cfg.data.source == "tokens" and cfg.model.vocab_size > BYTES:
        raise ConfigError(
            f"tokenizer: no tokenizer.json beside data.path {cfg.data.path!r} and the vocabulary is larger than "
            "bytes; pass --tokenizer"
        )
    return ByteCodec()


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
) -> list[int]:
    """n new ids after `prompt`, drawn only among ids < `allowed`."""
    generator = torch.Generator(device).manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    out: list[int] = []
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
        out.append(nxt)
        idx = torch.cat([idx, torch.tensor([[nxt]], device=device)], dim=1)
    return out


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path, metavar="RUN_DIR_OR_CHECKPOINT")
    p.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    p.add_argument("--tokens", type=int, default=200, help="ids to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the K most likely ids; 0 = all (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json (default: the run's)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> torch.device:
    """The flags alone (ConfigError, one line); the device to sample on."""
    if args.tokens < 1:
        raise ConfigError(f"--tokens: expected an integer >= 1, got {args.tokens}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature: expected a value >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k: expected an integer >= 0 (0 = off), got {args.top_k}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"--device: expected cpu or cuda (with a GPU), got {device!r}")
    return torch.device(device)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        device = check_args(args)
        model, cfg, what = load_model(args.path)
        codec = load_codec(cfg, args.tokenizer)
        prompt = codec.encode(args.prompt)
        if not prompt:  # a new document: what precedes every document in training
            prompt = [codec.eot] if codec.eot is not None else codec.encode("\n")
        allowed = min(cfg.model.vocab_size, BYTES) if isinstance(codec, ByteCodec) else cfg.model.vocab_size
        if max(prompt) >= cfg.model.vocab_size:
            raise ConfigError(f"--prompt: encodes to id {max(prompt)}, beyond the model's {cfg.model.vocab_size}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"sampling {what} on {device}", file=sys.stderr)
    ids = generate(model.to(device), prompt, args.tokens, args.temperature, args.top_k, args.seed, allowed, device)
    sys.stdout.write(args.prompt + codec.decode(ids) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`model.init_from`: the weights a run starts from instead of the seeded init, and their checks.

A source is one of
  - a Hugging Face folder (`config.json` + `model.safetensors`, or shards listed in
    `model.safetensors.index.json`): written by `hsdp.export --format hf`, or by
    `transformers` for a model of the same architecture (GPT-2 with exact GELU, Llama
    without GQA, as hsdp/models/hf.py describes);
  - a plain export (`hsdp.export`'s `.pt`, `--format safetensors`, or a run's
    `model.replica<m>.pt`): the project's own tensor names.
The tensors must be exactly the model's: every name, every shape (so vocab, width,
depth and arch all show), finite. `read_init_from` is called by preflight (before any
worker starts; ConfigError, one line) and by each rank's engine build (`initial_model`,
`initial_unit_initializer`: the one place initial params are made), so θ_g, copied
from the held params, starts from them too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from hsdp.config.schema import ConfigError, ModelConfig
from hsdp.models.gpt import GPT, build_model, unit_initializer
from hsdp.models.hf import CONFIG, WEIGHTS, WEIGHTS_INDEX, check_hf_config, from_hf

KEY = "model.init_from"


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out |= load_file(str(f))
        except Exception as e:  # safetensors raises its own SafetensorError (not an OSError) on a bad header
            raise ConfigError(f"{KEY}: cannot read {f} ({str(e).splitlines()[0]})") from None
    return out


def folder_weights(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder (ConfigError naming what is there instead when there are none)."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / WEIGHTS_INDEX).is_file():
        try:
            names = sorted(set(json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"{KEY}: cannot read {folder / WEIGHTS_INDEX} ({e})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ConfigError(f"{KEY}: {folder} lacks {missing[0]}, listed in {WEIGHTS_INDEX}")
        return [folder / n for n in names]
    other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    also = f" (it has {', '.join(other[:3])}: only safetensors weights are read from a folder)" if other else ""
    raise ConfigError(f"{KEY}: {folder} has no {WEIGHTS} or {WEIGHTS_INDEX}{also}")


def read_source(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors of `path` under the project's names (not yet checked against the model)."""
    source = str(path)
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise ConfigError(f"{KEY}: {path} is a folder without {CONFIG} (give an HF folder or a plain export file)")
        try:
            hf = json.loads((path / CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{KEY}: cannot read {path / CONFIG} ({e})") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{KEY}: {path / CONFIG} is not a JSON object")
        check_hf_config(hf, cfg, source)
        tensors = read_safetensors(folder_weights(path))
        return from_hf(tensors, cfg, bool(hf.get("tie_word_embeddings", hf.get("model_type") == "gpt2")), source)
    if not path.is_file():
        raise ConfigError(f"{KEY}: {path} does not exist")
    if path.suffix == ".safetensors":
        tensors = read_safetensors([path])
    else:
        try:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch.load raises many kinds (pickle, zip, EOF) for a file that is not a state dict
            raise ConfigError(f"{KEY}: cannot read {path} as a state dict ({str(e).splitlines()[0]})") from None
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise ConfigError(f"{KEY}: {path} does not hold a state dict of tensors")
    if tensors and not any(k.startswith("units.") for k in tensors):  # HF names in a bare file: no config to check
        return from_hf(tensors, cfg, tied=False, source=source)
    return tensors


def saved_arch(names: set[str]) -> str:
    """The arch a project state dict is: only gpt has learned positions."""
    return "gpt" if "units.0.wpe.weight" in names else "llama"


def check_against_model(state: dict[str, Any], cfg: ModelConfig, source: str) -> None:
    """ConfigError (one line, the first difference) unless `state` has exactly the model's tensors and shapes."""
    with torch.device("meta"):
        want = {n: tuple(p.shape) for n, p in GPT(cfg).named_parameters()}
    arch = saved_arch(set(state))
    if arch != cfg.arch:
        raise ConfigError(f"{KEY}: {source} is a {arch} model but this run has model.arch={cfg.arch}")
    for name, shape in want.items():
        if name not in state:
            raise ConfigError(f"{KEY}: {source} has no tensor {name} (this run's model has {len(want)})")
        got = tuple(state[name].shape)
        if got != shape:
            raise ConfigError(
                f"{KEY}: {source}'s {name} has shape {list(got)} but this run's model needs {list(shape)} "
                f"(model.vocab_size={cfg.vocab_size}, d_model={cfg.d_model}, n_layer={cfg.n_layer}, "
                f"seq_len={cfg.seq_len})"
            )
    extra = sorted(set(state) - set(want))
    if extra:
        raise ConfigError(f"{KEY}: {source} has tensor {extra[0]}, which this run's model does not have")
    for name, t in state.items():
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ConfigError(f"{KEY}: {source}'s {name} is not finite floating point")


def read_init_from(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checked fp32 state dict `cfg.init_from` names (ConfigError, one line, if it does not fit)."""
    assert cfg.init_from, "read_init_from without model.init_from"
    path = Path(cfg.init_from).expanduser()
    state = read_source(path, cfg)
    check_against_model(state, cfg, str(path))
    return {n: t.float() for n, t in state.items()}


def initial_model(cfg: ModelConfig, seed: int) -> GPT:
    """`build_model(cfg, seed)`, with `cfg.init_from`'s weights when it is set."""
    model = build_model(cfg, seed)
    if cfg.init_from:
        with torch.no_grad():
            model.load_state_dict(read_init_from(cfg))
    return model


def initial_unit_initializer(cfg: ModelConfig, seed: int) -> Callable[[int, nn.Module], None]:
    """`unit_initializer(cfg, seed)`, or, with `cfg.init_from`, one that gives each meta unit its loaded weights."""
    if not cfg.init_from:
        return unit_initializer(cfg, seed)
    state = read_init_from(cfg)

    def materialize(index: int, unit: nn.Module) -> None:
        unit.to_empty(device="cpu")
        prefix = f"units.{index}."
        with torch.no_grad():
            unit.load_state_dict({n[len(prefix) :]: t for n, t in state.items() if n.startswith(prefix)})

    return materialize

"""The project's GPT in Hugging Face's layout: `config.json` and tensor names, both ways.

`gpt` is GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm (eps 1e-5), exact GELU
(`activation_function: gelu`, not GPT-2's tanh `gelu_new`), an untied head
(`tie_word_embeddings: false`). GPT-2's `Conv1D` stores a weight as [in, out], the
transpose of `nn.Linear`'s; its `c_attn` is q, k, v stacked like our `qkv`. GPT-2 has
biases everywhere: `model.bias=false` is written as zero biases (exact: x + 0 = x).

`llama` is `LlamaForCausalLM`: RMSNorm (eps `NORM_EPS`), rotary base `ROPE_THETA` with
the rotate-half layout (pair (i, i + Dh/2)), which is transformers' own, so q and k
need no permutation; our `qkv` splits into q_proj, k_proj, v_proj (one kv head per
head), the SwiGLU `fc` into gate_proj (first half) and up_proj (second half).

Nothing here needs `transformers`: the folder is written with `safetensors` alone.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from hsdp.config.schema import ConfigError, ModelConfig
from hsdp.core.atomic import fsync_dir, temp_name, write_json
from hsdp.models.gpt import NORM_EPS, ROPE_THETA, ffn_hidden

LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which the gpt arch uses
HF_TYPES = {"gpt": ("gpt2", "GPT2LMHeadModel"), "llama": ("llama", "LlamaForCausalLM")}  # arch → (type, class)
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a folder whose weights are split over several files
GENERATION = "generation_config.json"


# ---------------------------------------------------------------- config.json
def hf_config(cfg: ModelConfig, eot: Optional[int]) -> dict[str, Any]:
    """config.json for `cfg` (`eot`: the end-of-text id, bos = eos, or None for a byte-level run)."""
    model_type, cls = HF_TYPES[cfg.arch]
    common = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }
    if cfg.arch == "gpt":
        return {
            **common,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": 4 * cfg.d_model,
            "activation_function": "gelu",
            "layer_norm_epsilon": LAYER_NORM_EPS,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    return {
        **common,
        "hidden_size": cfg.d_model,
        "intermediate_size": ffn_hidden(cfg.d_model),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head,
        "head_dim": cfg.d_model // cfg.n_head,
        "max_position_embeddings": cfg.seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": NORM_EPS,
        "rope_theta": ROPE_THETA,  # transformers < 5 reads this; 5 reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
    }


def generation_config(eot: Optional[int]) -> dict[str, Any]:
    """generation_config.json: end-of-text as bos/eos (none for a byte-level run)."""
    return {"bos_token_id": eot, "eos_token_id": eot}


def _mismatch(key: str, got: Any, want: Any, source: str) -> ConfigError:
    return ConfigError(f"model.init_from: {source} has {key}={got!r} but this run needs {want!r}")


# transformers' defaults for keys a config.json may leave out (GPT2Config, LlamaConfig)
GPT2_DEFAULTS = {"n_positions": 1024, "layer_norm_epsilon": 1e-5, "n_inner": None, "activation_function": "gelu_new"}
LLAMA_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "intermediate_size": 11008}


def check_hf_config(hf: dict[str, Any], cfg: ModelConfig, source: str) -> None:
    """ConfigError (one line, the first difference) unless config.json `hf` describes the model `cfg` builds.

    A folder may come from transformers itself: its keys are read with their defaults, positions
    may exceed seq_len for llama (rotary has no table), and a tied head is fine (copied, see from_hf)."""
    model_type = HF_TYPES[cfg.arch][0]
    if hf.get("model_type") != model_type:
        raise _mismatch("model_type", hf.get("model_type"), model_type, source)
    want = hf_config(cfg, None)
    if cfg.arch == "gpt":
        keys = ["vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function"]
        keys += ["layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx"]
        defaults = {**GPT2_DEFAULTS, "scale_attn_weights": True}
        got = {k: hf.get(k, defaults.get(k, False)) for k in keys}
        got["n_inner"] = got["n_inner"] or (4 * got["n_embd"] if got["n_embd"] else None)  # None: 4·n_embd
    else:
        keys = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
        keys += ["head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "attention_bias", "mlp_bias"]
        got = {k: hf.get(k, LLAMA_DEFAULTS.get(k)) for k in keys}
        got["num_key_value_heads"] = got["num_key_value_heads"] or got["num_attention_heads"]
        heads = got["num_attention_heads"]
        got["head_dim"] = got["head_dim"] or (got["hidden_size"] // heads if heads and got["hidden_size"] else None)
        got["attention_bias"] = bool(got["attention_bias"])
        got["mlp_bias"] = bool(got["mlp_bias"])
        rope = hf.get("rope_parameters") or {}
        got["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", ROPE_THETA))
        got["rope_type"] = rope.get("rope_type", "default")
        want = {**want, "rope_type": "default"}
        keys += ["rope_theta", "rope_type"]
    for k in keys:
        if got[k] != want[k]:
            raise _mismatch(k, got[k], want[k], source)


# ---------------------------------------------------------------- tensor names
def _gpt_names(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(project name, HF name, transposed) for every gpt tensor; biases listed whether or not the model has them."""
    last = cfg.n_layer + 1
    names = [
        ("units.0.wte.weight", "transformer.wte.weight", False),
        ("units.0.wpe.weight", "transformer.wpe.weight", False),
    ]
    for i in range(cfg.n_layer):
        ours, hf = f"units.{i + 1}.", f"transformer.h.{i}."
        names += [
            (ours + "ln1.weight", hf + "ln_1.weight", False),
            (ours + "ln1.bias", hf + "ln_1.bias", False),
            (ours + "attn.qkv.weight", hf + "attn.c_attn.weight", True),
            (ours + "attn.qkv.bias", hf + "attn.c_attn.bias", False),
            (ours + "attn.proj.weight", hf + "attn.c_proj.weight", True),
            (ours + "attn.proj.bias", hf + "attn.c_proj.bias", False),
            (ours + "ln2.weight", hf + "ln_2.weight", False),
            (ours + "ln2.bias", hf + "ln_2.bias", False),
            (ours + "mlp.fc.weight", hf + "mlp.c_fc.weight", True),
            (ours + "mlp.fc.bias", hf + "mlp.c_fc.bias", False),
            (ours + "mlp.proj.weight", hf + "mlp.c_proj.weight", True),
            (ours + "mlp.proj.bias", hf + "mlp.c_proj.bias", False),
        ]
    names += [
        (f"units.{last}.ln_f.weight", "transformer.ln_f.weight", False),
        (f"units.{last}.ln_f.bias", "transformer.ln_f.bias", False),
        (f"units.{last}.lm_head.weight", "lm_head.weight", False),
    ]
    return names


def _gpt_bias_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The shape GPT-2 expects for a bias the project's model.bias=false model does not have."""
    d = cfg.d_model
    widths = {"qkv": 3 * d, "fc": 4 * d}
    return (next((w for part, w in widths.items() if f".{part}." in name), d),)


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The project's full state dict (fp32) as the HF model's tensors (contiguous, ready for safetensors)."""
    out: dict[str, torch.Tensor] = {}
    if cfg.arch == "gpt":
        for ours, hf, transposed in _gpt_names(cfg):
            t = state.get(ours)
            if t is None:  # model.bias=false: GPT-2 has the bias, zero is the same function
                t = torch.zeros(_gpt_bias_shape(ours, cfg))
            out[hf] = (t.t() if transposed else t).contiguous()
        return out
    d, last = cfg.d_model, cfg.n_layer + 1
    out["model.embed_tokens.weight"] = state["units.0.wte.weight"]
    for i in range(cfg.n_layer):
        ours, hf = f"units.{i + 1}.", f"model.layers.{i}."
        q, k, v = state[ours + "attn.qkv.weight"].split(d)
        gate, up = state[ours + "mlp.fc.weight"].chunk(2)
        out |= {
            hf + "input_layernorm.weight": state[ours + "ln1.weight"],
            hf + "self_attn.q_proj.weight": q,
            hf + "self_attn.k_proj.weight": k,
            hf + "self_attn.v_proj.weight": v,
            hf + "self_attn.o_proj.weight": state[ours + "attn.proj.weight"],
            hf + "post_attention_layernorm.weight": state[ours + "ln2.weight"],
            hf + "mlp.gate_proj.weight": gate,
            hf + "mlp.up_proj.weight": up,
            hf + "mlp.down_proj.weight": state[ours + "mlp.proj.weight"],
        }
    out["model.norm.weight"] = state[f"units.{last}.ln_f.weight"]
    out["lm_head.weight"] = state[f"units.{last}.lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _take(tensors: dict[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    if name not in tensors:
        raise ConfigError(f"model.init_from: {source} has no tensor {name}")
    return tensors[name]


def _head(tensors: dict[str, torch.Tensor], embedding: str, tied: bool, source: str) -> torch.Tensor:
    """lm_head.weight, or the embedding for a tied model that stores it once (transformers' tied checkpoints)."""
    if "lm_head.weight" in tensors:
        return tensors["lm_head.weight"]
    if tied:
        return _take(tensors, embedding, source)
    return _take(tensors, "lm_head.weight", source)


def _stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' rows as one matrix; parts of unequal widths give the first alone (its shape, wrong for the
    model, is what the caller's shape check reports)."""
    return torch.cat(parts) if len({tuple(t.shape[1:]) for t in parts}) == 1 else parts[0]


def from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, tied: bool, source: str) -> dict[str, torch.Tensor]:
    """HF tensors as the project's state dict (names only: shapes are checked by the caller against the model).

    gpt without biases (model.bias=false) takes GPT-2's biases only if they are all zero (else the function
    would change); ConfigError naming the first that is not, or the first tensor missing."""
    prefix = "model." if cfg.arch == "llama" else "transformer."
    # A base model's folder (GPT2Model, LlamaModel) names its tensors without the prefix.
    tensors = {k if k.startswith((prefix, "lm_head.")) else prefix + k: v for k, v in tensors.items()}
    if cfg.arch == "gpt":
        out = {}
        for ours, hf, transposed in _gpt_names(cfg):
            t = (
                _head(tensors, "transformer.wte.weight", tied, source)
                if hf == "lm_head.weight"
                else _take(tensors, hf, source)
            )
            if ours.endswith(".bias") and not cfg.bias:
                if bool(t.any()):
                    raise ConfigError(
                        f"model.init_from: {source}'s {hf} is not zero but this run has model.bias=false; "
                        "set model.bias=true"
                    )
                continue
            out[ours] = t.t() if transposed else t
        return out
    out = {"units.0.wte.weight": _take(tensors, "model.embed_tokens.weight", source)}
    for i in range(cfg.n_layer):
        ours, hf = f"units.{i + 1}.", f"model.layers.{i}."
        qkv = [_take(tensors, f"{hf}self_attn.{p}_proj.weight", source) for p in "qkv"]
        fc = [_take(tensors, f"{hf}mlp.{p}_proj.weight", source) for p in ("gate", "up")]
        out |= {
            ours + "ln1.weight": _take(tensors, hf + "input_layernorm.weight", source),
            ours + "attn.qkv.weight": _stack_rows(qkv),
            ours + "attn.proj.weight": _take(tensors, hf + "self_attn.o_proj.weight", source),
            ours + "ln2.weight": _take(tensors, hf + "post_attention_layernorm.weight", source),
            ours + "mlp.fc.weight": _stack_rows(fc),
            ours + "mlp.proj.weight": _take(tensors, hf + "mlp.down_proj.weight", source),
        }
    last = cfg.n_layer + 1
    out[f"units.{last}.ln_f.weight"] = _take(tensors, "model.norm.weight", source)
    out[f"units.{last}.lm_head.weight"] = _head(tensors, "model.embed_tokens.weight", tied, source)
    return out


# ---------------------------------------------------------------- the folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOT = "<|endoftext|>"


def tokenizer_eot(tokenizer: Path) -> Optional[int]:
    """The id of <|endoftext|> in a tokenizer.json (read as JSON: no `tokenizers` needed), or None."""
    try:
        spec = json.loads(tokenizer.read_text(encoding="utf-8"))
        added = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", [])}
        return added.get(EOT, spec["model"]["vocab"].get(EOT))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"tokenizer: cannot read {tokenizer} ({e})") from None


def tokenizer_config(cfg: ModelConfig, eot: Optional[int]) -> dict[str, Any]:
    """tokenizer_config.json: AutoTokenizer loads tokenizer.json as a fast tokenizer, adding no tokens of its own
    (prepare encoded documents with add_special_tokens=False, and the tokenizer has no post-processor)."""
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT} if eot is not None else {}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.seq_len,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **special,
    }


def write_file(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)`, then fsync and rename to `path`: the file appears only complete."""
    tmp = temp_name(path)
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_hf_folder(out: Path, state: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: Optional[Path]) -> None:
    """config.json, model.safetensors, generation_config.json (and the tokenizer files, given a tokenizer.json)
    into the new folder `out`: written under a temporary name and renamed, so `out` appears only complete."""
    from safetensors.torch import save_file

    eot = tokenizer_eot(tokenizer) if tokenizer is not None else None
    tmp = temp_name(out)
    tmp.mkdir()
    try:
        tensors = to_hf(state, cfg)
        write_file(tmp / WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
        write_json(tmp / CONFIG, hf_config(cfg, eot))
        write_json(tmp / GENERATION, generation_config(eot))
        if tokenizer is not None:
            write_file(tmp / "tokenizer.json", lambda p: shutil.copyfile(tokenizer, p))
            write_json(tmp / "tokenizer_config.json", tokenizer_config(cfg, eot))
            special = {k: v for k, v in tokenizer_config(cfg, eot).items() if k.endswith("_token")}
            write_json(tmp / "special_tokens_map.json", special)
        if out.is_dir():  # an empty folder given as the output (checked by the caller)
            out.rmdir()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""hsdp.export --format hf / safetensors and model.init_from, checked against transformers itself.

Two small trained runs at non-default shapes (gpt on ddp, llama on hsdp; 4 steps each, a BPE corpus):
transformers' logits equal the project's GPT on the plain export, greedy generation equals
hsdp.sample's, the HF tokenizer encodes to the ids prepare wrote. Then warm starts from those
exports on hsdp (from the HF folder) and fsdp2 (from the plain .pt): the first logged loss is the
exported model's loss on that batch, and the params the run holds are the exported ones, bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hsdp.config.schema import ConfigError
from hsdp.data.shards import open_tokens, read_header
from hsdp.data.tokens import Data
from hsdp.export import main as export_main
from hsdp.models.gpt import GPT, build_model, loss_fn
from hsdp.models.hf import hf_config, to_hf, write_hf_folder
from hsdp.models.init_from import initial_model, initial_unit_initializer, read_init_from
from hsdp.prepare import main as prepare_main
from hsdp.run.checkpoint import latest_checkpoint, read_saved_config
from hsdp.run.preflight import load_checked_config
from hsdp.sample import generate
from hsdp.sample import main as sample_main
from tests.helpers import run_train

transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject.toml); exporting needs none

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))
SHAPE = ["model.seq_len=32", "model.n_layer=2", "model.n_head=2", "model.d_model=24"]  # defaults: 128, 4, 4, 128
COMMON = SHAPE + [
    "data.source=tokens",
    "model.vocab_size=null",
    "data.batch_size=4",
    "run.eval_every=0",
    "run.eval_batches=1",
    "wandb.mode=disabled",
]
# A step that leaves every param bit-identical: SGD without momentum or decay, grads clipped to norm 1e-30,
# so each update (<= lr·1e-30) is far below half an ulp of any weight of a trained model (none is exactly 0).
FROZEN_STEP = [
    "optim.name=sgd",
    "optim.momentum=0",
    "optim.weight_decay=0",
    "optim.grad_clip=1e-30",
    "run.steps=1",
    "run.save_model=true",
    "run.checkpoint_every=1",
]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared BPE corpus and two trained runs with checkpoints: gpt (ddp, 2 replicas) and llama (hsdp)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("hf")
    (tmp / "corpus.txt").write_text("<|endoftext|>".join(TEXT[i : i + 400] for i in range(0, len(TEXT), 400)))
    assert prepare_main([str(tmp / "corpus.txt"), "--out", str(tmp / "data"), "--vocab", "320"]) == 0
    data = [f"data.path={tmp / 'data'}"]
    steps = ["run.steps=4", "run.checkpoint_every=4"]
    run_train(tmp, "gpt", COMMON + data + steps + ["model.arch=gpt", "mesh.engine=ddp", "mesh.sync=2"])
    run_train(tmp, "llama", COMMON + data + steps + ["model.arch=llama"])
    for arch in ("gpt", "llama"):
        checkpoint = str(latest_checkpoint(tmp / arch))
        assert export_main([checkpoint, str(tmp / f"{arch}.pt")]) == 0
        assert export_main([checkpoint, str(tmp / f"{arch}.safetensors"), "--format", "safetensors"]) == 0
        assert export_main([checkpoint, str(tmp / f"{arch}-hf"), "--format", "hf"]) == 0
    return tmp


def project_model(work: Path, arch: str) -> GPT:
    """The project's GPT holding the plain export of the run's last checkpoint."""
    cfg = read_saved_config(latest_checkpoint(work / arch))
    model = GPT(cfg.model)
    model.load_state_dict(torch.load(work / f"{arch}.pt"))
    return model.eval()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_transformers_logits_equal_the_projects(work: Path, arch: str) -> None:
    ours = project_model(work, arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(work / f"{arch}-hf").eval()
    assert type(hf).__name__ == {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch]
    idx = torch.randint(0, ours.cfg.vocab_size, (3, ours.cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours(idx), hf(idx).logits
    assert want.abs().max() > 0.1  # a trained model's logits, not zeros
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_greedy_generation_equals_hsdp_sample(work: Path, arch: str, capsys) -> None:
    """20 greedy tokens: transformers' generate from the HF folder = hsdp.sample's generate = its command's text."""
    folder = work / f"{arch}-hf"
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tok.encode("def f1")
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    got = hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
    ours = project_model(work, arch)
    want = list(generate(ours, prompt, 20, 0.0, 0, 0, ours.cfg.vocab_size, torch.device("cpu")))
    assert got == want and len(set(want)) > 1
    argv = [str(latest_checkpoint(work / arch)), "--prompt", "def f1", "--tokens", "20", "--temperature", "0"]
    assert sample_main([*argv, "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "def f1" + tok.decode(got) + "\n"


def test_hf_tokenizer_encodes_to_the_ids_prepare_wrote(work: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(work / "llama-hf")
    first_document = TEXT[:400]  # document 0 goes to train (⌊1·0.1⌋ = ⌊0·0.1⌋), after one end-of-text id
    ids = tok.encode(first_document)
    shard = open_tokens(read_header(work / "data" / "train_000000.bin"))
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert shard[0] == eot and shard[1 + len(ids)] == eot
    assert shard[1 : 1 + len(ids)].tolist() == ids
    assert tok.decode(ids) == first_document


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_every_format_reads_back_to_the_same_tensors(work: Path, arch: str) -> None:
    """The .pt, .safetensors and HF folder of one checkpoint read back (as model.init_from reads them) bit for bit."""
    cfg = read_saved_config(latest_checkpoint(work / arch)).model
    plain = torch.load(work / f"{arch}.pt")
    assert load_file(str(work / f"{arch}.safetensors")).keys() == plain.keys()
    for source in (f"{arch}.pt", f"{arch}.safetensors", f"{arch}-hf"):
        cfg.init_from = str(work / source)
        got = read_init_from(cfg)
        assert got.keys() == plain.keys() and all(torch.equal(got[n], plain[n]) for n in plain), source
    hf = load_file(str(work / f"{arch}-hf" / "model.safetensors"))
    again = to_hf(read_init_from(cfg), cfg)
    checkpoint = str(latest_checkpoint(work / arch))
    assert export_main([checkpoint, str(work / f"{arch}-hf"), "--format", "hf"]) == 2  # an existing folder: kept
    assert not list(work.glob(f".{arch}-hf.tmp-*"))
    assert again.keys() == hf.keys() and all(torch.equal(again[n], hf[n]) for n in hf)


def spread_weights(model: GPT, seed: int) -> GPT:
    """Weights far from init (matrices ~ N(0, 2/fan_in), norms ~ 1 ± 0.3, biases ~ ±0.3): activations of order 1,
    so a wrong GELU flavour, norm eps, rotary layout or transposition changes the logits by far more than 1e-4
    (a 4-step run stays near its small init, where several of those differ by less)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (2 / p.shape[1]) ** 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.mark.parametrize(
    "overrides",
    [["model.arch=gpt"], ["model.arch=gpt", "model.bias=false"], ["model.arch=llama"]],
    ids=["gpt", "gpt-no-bias", "llama"],
)
def test_transformers_logits_equal_the_projects_far_from_init(tmp_path: Path, overrides: list[str]) -> None:
    cfg = load_checked_config(None, ["data.source=synthetic", "model.vocab_size=300", *SHAPE, *overrides]).model
    model = spread_weights(build_model(cfg, seed=3), seed=4)
    write_hf_folder(tmp_path / "hf", model.state_dict(), cfg, None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(idx)
        torch.testing.assert_close(hf(idx).logits, want, rtol=0, atol=1e-4)
    assert want.std() > 0.5


def test_gpt_without_biases_imports_only_zero_biases(tmp_path: Path) -> None:
    """model.bias=false is exported as zero biases; a folder with a nonzero one is refused (it would change)."""
    cfg = load_checked_config(None, ["model.bias=false", "data.source=synthetic", *SHAPE]).model
    write_hf_folder(tmp_path / "hf", build_model(cfg, seed=3).state_dict(), cfg, None)
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert not tensors["transformer.h.0.attn.c_attn.bias"].any()
    cfg.init_from = str(tmp_path / "hf")
    assert read_init_from(cfg).keys() == build_model(cfg, seed=3).state_dict().keys()
    tensors["transformer.h.1.mlp.c_fc.bias"][0] = 1.0
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ConfigError, match="h.1.mlp.c_fc.bias is not zero"):
        read_init_from(cfg)


def test_initial_params_are_the_loaded_ones_unit_by_unit() -> None:
    """Both ways the engines build params (whole model: fsdp2, ddp; unit by unit: hsdp) give init_from's tensors."""
    cfg = load_checked_config(None, ["model.arch=llama", "data.source=synthetic", *SHAPE]).model
    source = build_model(cfg, seed=11).state_dict()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hsdp.models.init_from.read_init_from", lambda _: source)
        cfg.init_from = "given"
        whole = initial_model(cfg, seed=0).state_dict()
        materialize = initial_unit_initializer(cfg, seed=0)
        meta = build_model(cfg, 0, materialize=False)
        for i, unit in enumerate(meta.units):
            materialize(i, unit)
    assert all(torch.equal(whole[n], source[n]) for n in source)
    assert all(torch.equal(meta.state_dict()[n], source[n]) for n in source)
    cfg.init_from = ""
    assert not torch.equal(initial_model(cfg, seed=0).state_dict()["units.0.wte.weight"], source["units.0.wte.weight"])


@pytest.mark.parametrize(
    ("arch", "source", "engine"),
    [("llama", "llama-hf", ["mesh.shard=2"]), ("gpt", "gpt.pt", ["mesh.engine=fsdp2", "mesh.shard=2"])],
    ids=["llama-hf-on-hsdp", "gpt-pt-on-fsdp2"],
)
def test_warm_start_round_trip(work: Path, arch: str, source: str, engine: list[str]) -> None:
    """export → model.init_from → the first loss is the exported model's on batch 0; the run holds the exported
    params bit for bit (a frozen step, then export hf again: every tensor equal); summary.json names the source."""
    data = [f"data.path={work / 'data'}", f"model.arch={arch}"]
    warm = run_train(work, f"warm-{arch}", COMMON + data + FROZEN_STEP + engine + [f"model.init_from={work / source}"])
    assert warm.summary["init_from"] == str(work / source)
    cfg = read_saved_config(warm.run_dir)
    cfg.data.batch_size *= cfg.world_size  # one process reading every rank's rows of the step-0 batch
    x, y = Data(cfg, 0, 1).train_batch(0, 0)
    with torch.no_grad():
        want = float(loss_fn(project_model(work, arch)(x), y))
    assert warm.losses[0] == pytest.approx(want, abs=1e-5)
    plain = torch.load(work / f"{arch}.pt")
    held = warm.params()
    assert all(torch.equal(held[n], plain[n]) for n in plain)
    again = work / f"warm-{arch}-hf"
    assert export_main([str(latest_checkpoint(warm.run_dir)), str(again), "--format", "hf"]) == 0
    first, second = (
        load_file(str(work / f"{arch}-hf" / "model.safetensors")),
        load_file(str(again / "model.safetensors")),
    )
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)


def bad(work: Path, *overrides: str) -> str:
    """The one-line ConfigError preflight gives for a llama config with these overrides."""
    data = [f"data.path={work / 'data'}", f"run.out_dir={work / 'bad'}"]
    with pytest.raises(ConfigError) as info:
        load_checked_config(None, [*COMMON, *data, "model.arch=llama", *overrides])
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("model.init_from:"), msg
    return msg


def test_bad_init_from_is_one_line_before_any_worker(work: Path, tmp_path: Path) -> None:
    hf, plain = work / "llama-hf", work / "llama.pt"
    assert "model_type='gpt2'" in bad(work, f"model.init_from={work / 'gpt-hf'}")  # wrong arch, HF folder
    assert "gpt model" in bad(work, f"model.init_from={work / 'gpt.pt'}")  # wrong arch, plain export
    assert "vocab_size=320" in bad(work, f"model.init_from={hf}", "model.vocab_size=384")
    assert "hidden_size=24" in bad(work, f"model.init_from={hf}", "model.d_model=32")
    assert "[320, 24]" in bad(work, f"model.init_from={plain}", "model.d_model=32")  # a plain export: shapes
    assert "num_hidden_layers=2" in bad(work, f"model.init_from={hf}", "model.n_layer=3")
    no_weights = tmp_path / "no-weights"
    shutil.copytree(hf, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    assert "has no model.safetensors" in bad(work, f"model.init_from={no_weights}")
    assert "without config.json" in bad(work, f"model.init_from={tmp_path}")
    assert "does not exist" in bad(work, f"model.init_from={tmp_path / 'nothing.pt'}")
    (tmp_path / "junk.pt").write_bytes(b"not a state dict")
    assert "cannot read" in bad(work, f"model.init_from={tmp_path / 'junk.pt'}")
    edited = tmp_path / "rope"
    shutil.copytree(hf, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_theta": 5e5}}))
    assert "rope_theta=500000.0" in bad(work, f"model.init_from={edited}")


def test_train_exits_2_with_one_line(work: Path) -> None:
    data = [f"data.path={work / 'data'}", "model.arch=llama", "model.d_model=32"]
    result = run_train(work, "bad-run", COMMON + data + [f"model.init_from={work / 'llama-hf'}"], check=False)
    assert result.returncode == 2
    assert "model.init_from:" in result.stderr and not result.run_dir.exists()


def test_hf_config_is_what_transformers_reads(work: Path) -> None:
    """The written config.json round-trips through transformers' config classes with our values."""
    cfg = read_saved_config(latest_checkpoint(work / "llama")).model
    loaded = transformers.AutoConfig.from_pretrained(work / "llama-hf")
    assert loaded.intermediate_size == hf_config(cfg, 0)["intermediate_size"]
    assert loaded.rope_parameters["rope_theta"] == 10000.0 and loaded.rms_norm_eps == 1e-5
    assert not loaded.tie_word_embeddings


def test_theta_g_starts_from_init_from(work: Path) -> None:
    """DiLoCo from step 0 (H = 4): after one real step and no sync yet, θ_g is still init_from's weights bit for
    bit, while the replicas' own params have moved."""
    data = [f"data.path={work / 'data'}", "model.arch=llama", f"model.init_from={work / 'llama-hf'}"]
    sync = ["mesh.sync=2", "sync.method=diloco", "sync.warmup_steps=0", "sync.every=4"]
    run = run_train(work, "warm-diloco", COMMON + data + sync + ["run.steps=1", "run.checkpoint_every=1"])
    checkpoint = str(latest_checkpoint(run.run_dir))
    assert export_main([checkpoint, str(work / "theta_g.pt"), "--global"]) == 0
    assert export_main([checkpoint, str(work / "replica0.pt"), "--replica", "0"]) == 0
    start, theta_g, replica = (torch.load(work / f) for f in ("llama.pt", "theta_g.pt", "replica0.pt"))
    assert all(torch.equal(theta_g[n], start[n]) for n in start)
    assert not all(torch.equal(replica[n], start[n]) for n in start)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_init_from_a_folder_transformers_saved(tmp_path: Path, arch: str) -> None:
    """A folder written by transformers' own save_pretrained (a tied GPT-2 head, as GPT-2's checkpoints have it;
    GPT-2's exact-GELU variant) is read as the same function: our model on its tensors gives its logits."""
    cfg = load_checked_config(None, ["data.source=synthetic", "model.vocab_size=300", *SHAPE, f"model.arch={arch}"])
    hf_cfg = {k: v for k, v in hf_config(cfg.model, None).items() if k not in ("architectures", "model_type")}
    hf_cfg["tie_word_embeddings"] = arch == "gpt"
    config_class = transformers.GPT2Config if arch == "gpt" else transformers.LlamaConfig
    torch.manual_seed(0)
    hf = getattr(transformers, hf_config(cfg.model, None)["architectures"][0])(config_class(**hf_cfg)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "saved")
    cfg.model.init_from = str(tmp_path / "saved")
    ours = initial_model(cfg.model, seed=0).eval()
    idx = torch.randint(0, 300, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=0, atol=1e-4)

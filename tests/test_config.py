"""Config: YAML loading, `--set` overrides, validation errors, the CLI's exit code, save/load round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from hsdp.config.loader import from_dict, load_config, parse_override, save_config
from hsdp.config.schema import Config, ConfigError, ModelConfig, OptimConfig, RunConfig, to_dict
from hsdp.config.validate import validate
from hsdp.run.preflight import load_checked_config, preflight
from hsdp.sync.schedule import steps_after_last_sync
from tests.helpers import REPO, RunResult, run_train

TINY = str(REPO / "configs" / "tiny.yaml")


def one_line_error(fn, *args, **kwargs) -> str:
    """Call fn, expect ConfigError, and return its (checked single-line) message."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg.strip(), "empty ConfigError message"
    assert "\n" not in msg and "\r" not in msg, f"message is not one line: {msg!r}"
    return msg


# ------------------------------------------------------------------ loading + defaults
def test_defaults_are_valid_and_documented_values():
    cfg = Config()
    validate(cfg)  # the built-in defaults must be a valid run
    assert cfg.run.steps == 200 and cfg.run.seed == 0
    assert cfg.model == ModelConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128, bias=True)
    assert cfg.data.source == "stdlib" and cfg.data.path == ""
    assert (cfg.mesh.sync, cfg.mesh.shard, cfg.mesh.engine) == (1, 1, "hsdp")
    assert cfg.sync.warmup_steps is None and cfg.sync.every == 1 and cfg.sync.method == "average"
    assert cfg.world_size == 1
    assert cfg.run_dir == Path("runs") / "tiny"
    # load_checked_config(None) is exactly the defaults
    assert load_checked_config(None) == Config()


def test_load_tiny_yaml_into_dataclasses():
    cfg = load_checked_config(TINY)
    assert isinstance(cfg.run, RunConfig) and isinstance(cfg.optim, OptimConfig)
    # values from the file
    assert cfg.run.steps == 600 and cfg.run.eval_every == 100 and cfg.run.eval_batches == 8
    assert (cfg.mesh.sync, cfg.mesh.shard) == (2, 2) and cfg.world_size == 4
    assert cfg.optim.lr_warmup == 30
    assert cfg.optim.lr == pytest.approx(3e-3) and cfg.optim.min_lr == pytest.approx(3e-4)
    # the default run's cycle: a grad-sync warmup, then DiLoCo (its default outer lr / momentum) every 20 steps,
    # ending on a param sync; checkpoints every 100 steps, the last after the final step (step_599)
    assert (cfg.sync.warmup_steps, cfg.sync.method, cfg.sync.every) == (100, "diloco", 20)
    assert cfg.sync.outer_lr is None and cfg.sync.outer_momentum is None
    assert 0 < cfg.sync.warmup_steps < cfg.run.steps and steps_after_last_sync(cfg.run.steps, cfg.sync) == 0
    assert cfg.run.checkpoint_every == 100 and cfg.run.steps % cfg.run.checkpoint_every == 0
    # keys absent from the file keep their defaults
    assert cfg.optim.beta1 == 0.9 and cfg.optim.beta2 == 0.95
    assert cfg.data.val_fraction == 0.1 and cfg.run.save_model is False
    assert cfg.sync.fragments == 1 and cfg.sync.quantize == "none"
    # types follow the annotations, not YAML's guesses
    assert type(cfg.run.steps) is int and type(cfg.optim.lr) is float and type(cfg.optim.grad_clip) is float
    # the file agrees with itself when read as plain YAML
    raw = yaml.safe_load(Path(TINY).read_text())
    for section, values in raw.items():
        for key, value in values.items():
            got = getattr(getattr(cfg, section), key)
            assert got == (pytest.approx(value) if isinstance(value, float) else value), f"{section}.{key}"


def test_yaml_file_scientific_notation_without_dot(tmp_path):
    # PyYAML reads `3e-4` (no dot) as a *string*; the loader must still give a float.
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 3e-4\n  min_lr: 1e-5\nrun:\n  steps: 7\n")
    cfg = load_checked_config(str(p))
    assert type(cfg.optim.lr) is float and cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.optim.min_lr == pytest.approx(1e-5)
    assert cfg.run.steps == 7


@pytest.mark.parametrize(
    "override, section, key, expected, tp",
    [
        ("run.steps=7", "run", "steps", 7, int),
        ("optim.lr=3e-4", "optim", "lr", 3e-4, float),
        ("optim.lr=0.002", "optim", "lr", 0.002, float),
        ("optim.grad_clip=0", "optim", "grad_clip", 0.0, float),  # YAML int → float field
        ("run.save_model=true", "run", "save_model", True, bool),
        ("model.bias=false", "model", "bias", False, bool),
        ("run.name=my_run", "run", "name", "my_run", str),
        ("mesh.engine=ddp", "mesh", "engine", "ddp", str),
        ("sync.warmup_steps=null", "sync", "warmup_steps", None, type(None)),
        ("sync.warmup_steps=5", "sync", "warmup_steps", 5, int),
        ("sync.outer_lr=0.5", "sync", "outer_lr", 0.5, float),
        ("sync.outer_lr=null", "sync", "outer_lr", None, type(None)),
        ("wandb.entity=null", "wandb", "entity", None, type(None)),
        ("wandb.entity=team", "wandb", "entity", "team", str),
    ],
)
def test_set_override_is_parsed_to_the_field_type(override, section, key, expected, tp):
    # outer_* are diloco-only; exact HSDP (warmup null) so that the baseline engines load too
    cfg = load_checked_config(TINY, ["sync.method=diloco", "sync.warmup_steps=null", override])
    got = getattr(getattr(cfg, section), key)
    assert type(got) is tp, f"{override}: got {got!r} of type {type(got).__name__}"
    assert got == (pytest.approx(expected) if tp is float else expected)


def test_later_override_wins_and_file_values_are_overridden():
    cfg = load_checked_config(TINY, ["run.steps=10", "run.steps=11", "mesh.sync=1"])
    assert cfg.run.steps == 11 and cfg.mesh.sync == 1 and cfg.mesh.shard == 2


def test_parse_override_splits_at_first_equals():
    assert parse_override("run.name=a=b") == ("run.name", "a=b")
    # The raw text is kept; the field's type decides how it is read (see test_str_override_keeps_the_text).
    assert parse_override(" run.steps =5") == ("run.steps", "5")
    assert parse_override("wandb.entity=null") == ("wandb.entity", "null")
    assert parse_override("run.name=") == ("run.name", "")


# ------------------------------------------------------------------ bad inputs
# (overrides applied on top of configs/tiny.yaml, substring the one-line message must contain)
BAD_OVERRIDES = [
    pytest.param(["nosuch.key=1"], "nosuch", id="unknown-section"),
    pytest.param(["optim.nosuch=1"], "optim.nosuch", id="unknown-key"),
    pytest.param(["steps=5"], "steps", id="key-without-section"),
    pytest.param(["run.steps=ten"], "run.steps", id="str-for-int"),
    pytest.param(["run.steps=true"], "run.steps", id="bool-for-int"),
    pytest.param(["run.steps=2.5"], "run.steps", id="float-for-int"),
    pytest.param(["optim.lr=fast"], "optim.lr", id="str-for-float"),
    pytest.param(["optim.lr=true"], "optim.lr", id="bool-for-float"),
    pytest.param(["run.save_model=maybe"], "run.save_model", id="str-for-bool"),
    pytest.param(["sync.warmup_steps=soon"], "sync.warmup_steps", id="str-for-optional-int"),
    pytest.param(["run.steps=0"], "run.steps", id="steps-zero"),
    pytest.param(["optim.lr=0"], "optim.lr", id="lr-zero"),
    pytest.param(["optim.lr=-1"], "optim.lr", id="lr-negative"),
    pytest.param(["optim.lr_warmup=-1"], "optim.lr_warmup", id="negative-lr-warmup"),
    pytest.param(["sync.warmup_steps=-3"], "sync.warmup_steps", id="negative-sync-warmup"),
    pytest.param(["data.batch_size=0"], "data.batch_size", id="batch-size-zero"),
    pytest.param(["optim.min_lr=0.1"], "optim.min_lr", id="min-lr-above-lr"),
    pytest.param(["data.val_fraction=1.5"], "data.val_fraction", id="val-fraction-out-of-range"),
    pytest.param(["mesh.engine=megatron"], "mesh.engine", id="bad-engine"),
    pytest.param(["precision.param_dtype=fp64"], "precision.param_dtype", id="bad-dtype"),
    pytest.param(["precision.reduce_dtype=int8"], "precision.reduce_dtype", id="bad-reduce-dtype"),
    pytest.param(["data.source=web"], "data.source", id="bad-data-source"),
    pytest.param(["sync.method=gossip"], "sync.method", id="bad-sync-method"),
    pytest.param(["data.source=text"], "data.path", id="text-without-path"),
    pytest.param(["data.source=text", "data.path=/nonexistent/dir/*.txt"], "data.path", id="text-glob-no-match"),
    pytest.param(["data.source=tokens"], "data.path", id="tokens-without-path"),
    pytest.param(["data.source=tokens", "data.path=/nonexistent/train.bin"], "data.path", id="tokens-missing-file"),
    pytest.param(["model.n_head=3"], "model.n_head", id="n-head-not-dividing-d-model"),
    pytest.param(["sync.every=4", "sync.fragments=3"], "sync.fragments", id="fragments-not-dividing-every"),
    pytest.param(["sync.warmup_steps=10", "mesh.engine=fsdp2"], "mesh.engine", id="periodic-sync-with-fsdp2"),
    pytest.param(["sync.warmup_steps=0", "mesh.engine=ddp"], "mesh.engine", id="periodic-sync-with-ddp"),
    pytest.param(["run.name=a/b"], "run.name", id="run-name-with-slash"),
    pytest.param(
        ["compile.enabled=true", "compile.scope=blocks", "compile.passes=none"], "compile.passes", id="blocks-passes"
    ),
    pytest.param(
        ["compile.enabled=true", "compile.scope=blocks", "compile.bucket_mb=4"], "compile.bucket_mb", id="blocks-bucket"
    ),
    pytest.param(["optim.lr"], "optim.lr", id="set-without-equals"),
]


@pytest.mark.parametrize("overrides, key", BAD_OVERRIDES)
def test_bad_override_raises_one_line_error_naming_the_key(overrides, key):
    msg = one_line_error(load_checked_config, TINY, overrides)
    assert key in msg, f"message does not name {key!r}: {msg!r}"


def test_blocks_scope_takes_the_default_step_graph_options_and_fsdp2_any():
    """The refusal is for values that would do nothing: defaults pass, and fsdp2 (always per block) is not hsdp."""
    load_checked_config(TINY, ["compile.enabled=true", "compile.scope=blocks"])
    fsdp2 = ["mesh.engine=fsdp2", "sync.warmup_steps=null"]
    load_checked_config(TINY, [*fsdp2, "compile.enabled=true", "compile.scope=blocks", "compile.passes=none"])
    load_checked_config(TINY, ["compile.scope=blocks", "compile.passes=none"])  # compile off: nothing to refuse


def test_the_default_scope_is_blocks_and_a_step_graph_option_names_the_step_scope():
    """compile.enabled alone compiles the blocks (FSDP2's compile cost); an option of the step graph without
    compile.scope=step says, in its one line, which scope takes it."""
    assert load_checked_config(TINY, ["compile.enabled=true"]).compile.scope == "blocks"
    msg = one_line_error(load_checked_config, TINY, ["compile.enabled=true", "compile.passes=inductor"])
    assert "compile.passes" in msg and "compile.scope=step" in msg, msg
    load_checked_config(TINY, ["compile.enabled=true", "compile.scope=step", "compile.passes=inductor"])


def test_wrong_type_message_says_what_was_expected():
    assert "int" in one_line_error(load_checked_config, TINY, ["run.steps=ten"])
    assert "float" in one_line_error(load_checked_config, TINY, ["optim.lr=fast"])
    msg = one_line_error(load_checked_config, TINY, ["mesh.engine=megatron"])
    assert "hsdp" in msg and "fsdp2" in msg and "ddp" in msg and "megatron" in msg


def test_periodic_sync_with_hsdp_or_full_warmup_with_fsdp2_is_fine():
    # the engine restriction is only for periodic sync (warmup_steps < steps)
    assert load_checked_config(TINY, ["sync.warmup_steps=10", "mesh.engine=hsdp"]).sync.warmup_steps == 10
    assert load_checked_config(TINY, ["sync.warmup_steps=600", "mesh.engine=fsdp2"]).mesh.engine == "fsdp2"
    # tiny.yaml syncs periodically after its warmup: a baseline engine runs it as exact HSDP
    assert load_checked_config(TINY, ["mesh.engine=fsdp2", "sync.warmup_steps=null"]).sync.warmup_steps is None
    assert "mesh.engine" in one_line_error(load_checked_config, TINY, ["mesh.engine=fsdp2"])
    assert load_checked_config(TINY, ["sync.every=4", "sync.fragments=2"]).sync.fragments == 2


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    msg = one_line_error(load_checked_config, str(missing))
    assert "--config" in msg and "nope.yaml" in msg


@pytest.mark.parametrize(
    "text, key",
    [
        ("nosuch:\n  a: 1\n", "nosuch"),
        ("run:\n  stepz: 3\n", "run.stepz"),
        ("run:\n  steps: ten\n", "run.steps"),
        ("run:\n  steps: true\n", "run.steps"),
        ("run: 5\n", "run"),
        ("model:\n  d_model: 100\n  n_head: 3\n", "model.n_head"),
        ("run: [unclosed\n", "--config"),
    ],
)
def test_bad_yaml_file_raises_one_line_error(tmp_path, text, key):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    msg = one_line_error(load_checked_config, str(p))
    assert key in msg, f"message does not name {key!r}: {msg!r}"


def test_load_config_checks_values_only_and_the_checked_load_the_machine(tmp_path):
    """`load_config` parses and validates (no disk, no devices); `load_checked_config` adds the preflight."""
    missing = ["data.source=text", f"data.path={tmp_path}/none-*.txt"]
    assert load_config(TINY, missing).data.source == "text"  # the data files are preflight's business
    assert "data.path" in one_line_error(load_checked_config, TINY, missing)
    assert "mesh.engine" in one_line_error(load_config, TINY, ["mesh.engine=megatron"])  # values: both


def test_world_size_mismatch():
    cfg = load_checked_config(TINY)  # 2 x 2 mesh
    preflight(cfg, world_size=4)  # matches: fine
    msg = one_line_error(preflight, cfg, world_size=3)
    assert "mesh" in msg and "3" in msg and "4" in msg


def test_data_path_present_is_accepted(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world\n" * 100)
    short = "model.seq_len=8"  # the splits must hold one window (see tests/test_robustness.py)
    assert load_checked_config(TINY, ["data.source=text", f"data.path={txt}", short]).data.path == str(txt)
    assert load_checked_config(TINY, ["data.source=text", f"data.path={tmp_path}/*.txt", short]).data.source == "text"
    binf = tmp_path / "train.bin"
    binf.write_bytes(b"\x01\x00" * 100)  # uint16 little-endian 1 (0x0100 = 256 is beyond tiny's vocab)
    assert load_checked_config(TINY, ["data.source=tokens", f"data.path={binf}", short]).data.source == "tokens"


# ------------------------------------------------------------------ the CLI
def _run_cli(tmp_path: Path, *sets: str) -> RunResult:
    """`train.py --config configs/tiny.yaml --set …` (served by the suite's warm launcher: the same main)."""
    result = run_train(tmp_path / "out", "cli", list(sets), config="configs/tiny.yaml", timeout=60, check=False)
    # no worker ran: nothing was written to the run directory
    assert not result.run_dir.parent.exists(), "a config error must fail before the run directory is created"
    return result


@pytest.mark.parametrize(
    "bad, key", [("optim.lr=-1", "optim.lr"), ("optim.nosuch=1", "optim.nosuch"), ("run.steps=ten", "run.steps")]
)
def test_cli_config_error_exits_2_with_one_line(tmp_path, bad, key):
    proc = _run_cli(tmp_path, bad)
    assert proc.returncode == 2, f"rc={proc.returncode}\nstderr:\n{proc.stderr}"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"stderr is not one line:\n{proc.stderr}"
    assert key in lines[0]
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ save / load round trip
def test_save_config_round_trip(tmp_path):
    cfg = load_checked_config(
        TINY,
        [
            "run.name=roundtrip",
            "run.steps=123",
            "optim.lr=3e-4",
            "optim.min_lr=1e-5",
            "optim.eps=1e-10",
            "sync.warmup_steps=10",
            "sync.every=4",
            "sync.fragments=2",
            "sync.method=diloco",
            "sync.outer_lr=0.5",
            "wandb.entity=team",
            "model.bias=false",
            "run.save_model=true",
        ],
    )
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    text = path.read_text()
    assert "roundtrip" in text
    back = load_checked_config(str(path))
    assert back == cfg
    assert from_dict(yaml.safe_load(text)) == cfg
    # types survive (equality alone would accept 1 == 1.0)
    for section in dataclasses.fields(cfg):
        a, b = getattr(cfg, section.name), getattr(back, section.name)
        for f in dataclasses.fields(a):
            assert type(getattr(a, f.name)) is type(getattr(b, f.name)), f"{section.name}.{f.name}"


def test_round_trip_of_defaults_and_dict_form():
    cfg = Config()
    assert from_dict(to_dict(cfg)) == cfg
    d = to_dict(cfg)
    sections = {"run", "model", "data", "mesh", "precision", "optim", "sync", "compile", "kernels", "wandb", "elastic"}
    assert set(d) == sections
    d["run"]["steps"] = 5
    assert from_dict(d).run.steps == 5  # a real change is seen
    assert from_dict(d) != cfg


def test_from_dict_rejects_unknown_key():
    d = to_dict(Config())
    d["mesh"]["shards"] = 2
    msg = one_line_error(from_dict, d)
    assert "mesh.shards" in msg


# ------------------------------------------------------------------ known library bugs (see report)
@pytest.mark.parametrize(
    "override, key", [("optim.lr=nan", "optim.lr"), ("optim.lr=.inf", "optim.lr"), ("optim.min_lr=nan", "optim.min_lr")]
)
def test_non_finite_values_rejected(override, key):
    assert key in one_line_error(load_checked_config, TINY, [override])


def test_text_path_matching_only_a_directory_is_rejected(tmp_path):
    assert "data.path" in one_line_error(load_checked_config, TINY, ["data.source=text", f"data.path={tmp_path}"])


@pytest.mark.parametrize("name", ["2024-01-01", "010", "1.50"])
def test_str_override_keeps_the_text(name):
    assert load_checked_config(TINY, [f"run.name={name}"]).run.name == name


def test_bool_override_accepts_1_and_0():
    assert load_checked_config(TINY, ["run.save_model=1"]).run.save_model is True
    assert load_checked_config(TINY, ["model.bias=0"]).model.bias is False


def test_llama_takes_its_own_bias_default_and_refuses_an_explicit_bias():
    """model.arch=llama alone loads with model.bias false (the llama block has none); gpt keeps true; asking
    llama for biases is refused naming the key, not ignored."""
    assert load_config(None, ["model.arch=llama"]).model.bias is False
    assert load_config(None, []).model.bias is True
    with pytest.raises(ConfigError, match="model.bias"):
        load_config(None, ["model.arch=llama", "model.bias=true"])


# ------------------------------------------------------------------ the ablations keep their meaning
ABLATIONS = sorted((REPO / "configs" / "ablations").glob("*.yaml"))


def _spec_runs(path: Path) -> tuple[str, dict[str, list[str]]]:
    """A sweep or slow-link spec's base and each run's overrides (shared, then its own; nocomm twins too)."""
    from hsdp.bench.plan import with_nocomm_twins
    from hsdp.bench.spec import load_link_spec, load_sweep

    if "rates" in yaml.safe_load(path.read_text()):
        link = load_link_spec(str(path))
        assert link.base is not None
        return link.base, {run: [*link.shared, *spec.overrides] for run, spec in link.runs.items()}
    sweep = load_sweep(str(path))
    runs = with_nocomm_twins(sweep["runs"]) if sweep["nocomm"] else sweep["runs"]
    return sweep["base"], {run: [*sweep["set"], *own] for run, own in runs.items()}


@pytest.mark.parametrize("path", ABLATIONS, ids=lambda p: p.stem)
def test_ablation_runs_do_not_depend_on_the_default_runs_cycle(path, tmp_path):
    """configs/tiny.yaml's default run warms up, syncs with DiLoCo and keeps checkpoints; every ablation run
    resolves to the config it has with none of that in its base (the schema's defaults: exact HSDP, no
    checkpoints), i.e. what it computed when it was measured, and a run that sets no sync is exact HSDP (and
    keeps no checkpoints unless it sets run.checkpoint_every itself, as the chaos runs do)."""
    base, runs = _spec_runs(path)
    raw = yaml.safe_load(Path(base).read_text())
    raw.pop("sync", None)
    raw["run"].pop("checkpoint_every", None)
    neutral = tmp_path / "base.yaml"
    neutral.write_text(yaml.safe_dump(raw))
    for run, overrides in runs.items():
        cfg = load_config(base, overrides)
        assert cfg == load_config(str(neutral), overrides), f"{path.name}: {run} depends on {base}'s sync/checkpoints"
        if not any(o.startswith("sync.") for o in overrides if o not in _PINS):
            assert cfg.sync.warmup_steps is None and cfg.sync.method == "average", f"{run}: not exact HSDP"
        pinned = any(o.startswith("run.checkpoint_every=") for o in overrides)  # a run that measures them sets them
        assert cfg.run.checkpoint_every == 0 or pinned, f"{path.name}: {run} keeps checkpoints"


_PINS = {"sync.warmup_steps=null", "sync.method=average", "sync.every=1", "run.checkpoint_every=0"}


@pytest.mark.parametrize("path", ABLATIONS, ids=lambda p: p.stem)
def test_ablation_files_plan(path, tmp_path, monkeypatch):
    """Each sweep / slow-link file plans as its command would (every run's config checked against this machine)."""
    from hsdp.bench.plan import LinkOptions, make_plan, plan_sweep

    monkeypatch.chdir(tmp_path)  # run.out_dir (runs/) is relative to where the command starts
    if "rates" in yaml.safe_load(path.read_text()):
        assert make_plan(LinkOptions(spec=str(path))).runs
    else:
        assert plan_sweep(str(path), [], set(), no_run=True).configs
    assert not (tmp_path / "runs").exists()

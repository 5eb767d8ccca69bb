"""The commands' usage: `python -m hsdp.<name>`, every argument explained, train.py's config keys listed."""

from __future__ import annotations

import pytest

from hsdp import export, prepare, sample


@pytest.mark.parametrize("name,module", [("prepare", prepare), ("sample", sample), ("export", export)])
def test_usage_names_the_module_command(name: str, module, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m hsdp.{name} ") and ".py" not in out.splitlines()[0]


def test_sample_explains_its_path_and_seed(capsys) -> None:
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a run folder (its newest complete checkpoint or final model)" in out
    assert "--seed SEED the sampling generator's seed" in out


def test_prepare_help_states_the_split_rule(capsys) -> None:
    with pytest.raises(SystemExit):
        prepare.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "val is the last F of the last document's text" in out
    assert f"pre-tokens are cut to {prepare.MAX_PRETOKEN_BYTES} bytes" in out


def test_train_help_lists_every_config_key(capsys) -> None:
    """`python train.py --help` names every SECTION.KEY that --set takes, with its default."""
    import dataclasses

    import train
    from hsdp.config.schema import Config

    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    for section in dataclasses.fields(Config):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{section.name}:"))
        for key in dataclasses.fields(getattr(Config(), section.name)):
            assert f"{key.name}=" in line, (section.name, key.name)

"""Every experiment config loads; bad configs give one error naming the key."""
import pathlib

import pytest

from osdp_jax.cli import config
from osdp_jax.cli.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "experiments").rglob("*.toml"))


def test_there_are_configs():
    names = {p.name for p in CONFIGS}
    assert {"gpt2_mini.toml", "opt_mini.toml", "bert_mini.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_loads(path):
    cfg = config.load(path)
    assert cfg.model.preset
    assert config.from_dict(config.to_dict(cfg)) == cfg


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,match", [
    ('[model]\npreset = "gpt2-mini"\n[plan]\nbudgt = "1GB"\n', r"plan\.budgt: unknown key; did you mean plan\.budget"),
    ('[model]\npreset = "gpt2-mini"\n[plann]\nbudget = "1GB"\n', r"\[plann\]: unknown section; did you mean \[plan\]"),
    ('[model]\npreset = "gpt2-mini"\n[train]\nsteps = "ten"\n', r"train\.steps: expected int, got str"),
    ('[model]\npreset = "gpt2-mni"\n', r"model\.preset: unknown preset 'gpt2-mni'; did you mean 'gpt2-mini'"),
    ('[model]\npreset = "gpt2-mini"\n[mesh]\nshape = [2, 4]\naxes = ["data"]\n',
     r"mesh\.shape: \[2, 4\] and mesh\.axes"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nbatch_sizes = [12]\n',
     r"plan\.batch_sizes: 12 is not a positive multiple of the mesh's 8"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nbudget = "lots"\n', r"plan\.budget: invalid byte size"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nsplits = [0, 2]\n', r"plan\.splits: splits must be positive integers"),
    ('[model]\npreset = "gpt2-mini"\n[train]\ncheckpoint_every = -1\n', r"train\.checkpoint_every: must be >= 0"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nstrategies = ["zero4"]\n', r"plan\.strategies: unknown strategy 'zero4'"),
    ('[model]\npreset = "gpt2-mini"\n[data]\ntask = "chars"\n', r"data\.path: task 'chars' needs"),
    ('[model]\npreset = "gpt2-mini"\n[model]\n', r"invalid TOML"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nremat = ["dot"]\n', r"plan\.remat: unknown remat policy 'dot'"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nremat = []\n', r"plan\.remat: give at least one remat policy"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nper_layer = "yes"\n', r"plan\.per_layer: expected bool"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nunits = ["auto", "blocks_*"]\n',
     r"plan\.units: 'auto' .* cannot be combined"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nunit_remat = "dot"\n', r"plan\.unit_remat: unknown remat policy 'dot'"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nsegment_gain = -0.01\n',
     r"plan\.segment_gain: segment_gain must be a number >= 0"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\ntensor = "auto"\n', r"plan\.tensor: must be 'off' or 'on'"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nsequence = "yes"\n', r"plan\.sequence: must be 'off', 'on' or 'auto'"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\ntensor = "on"\n', r"plan\.model_axis: tensor = 'on' needs a mesh"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nmodel_sizes = [2]\n', r"plan\.model_sizes: applies to the OSDP\+TP row"),
    ('[model]\npreset = "gpt2-mini"\n[plan]\nmodel_sizes = [0]\n', r"plan\.model_sizes: sizes must be positive"),
    ('[model]\npreset = "gpt2-mini"\n[mesh]\nshape = [2, 4]\naxes = ["data", "model"]\n[plan]\ntensor = "on"\n'
     'model_sizes = [3]\n', r"plan\.model_sizes: model_sizes must be .* some of \(1, 2, 4\)"),
])
def test_bad_configs(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as info:
        config.load(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_overrides_are_typed(tmp_path):
    path = write(tmp_path, '[model]\npreset = "gpt2-mini"\n')
    cfg = config.load(path, {"plan.batch_sizes": "16,32", "optim.learning_rate": "3e-4", "train.steps": "7"})
    assert cfg.plan.batch_sizes == (16, 32) and cfg.optim.learning_rate == 3e-4 and cfg.train.steps == 7
    cfg = config.load(path, {"plan.remat": "full,dots", "plan.per_layer": "false"})
    assert cfg.plan.remat == ("full", "dots") and cfg.plan.per_layer is False
    assert config.load(path, {"plan.segment_gain": "0.01"}).plan.segment_gain == 0.01
    assert config.load(path, {"plan.units": "blocks_*,head"}).plan.units == ("blocks_*", "head")
    with pytest.raises(ConfigError, match=r"--train\.stepz: unknown key; did you mean --train\.steps"):
        config.load(path, {"train.stepz": "7"})
    with pytest.raises(ConfigError, match=r"--train\.steps: expected int, got 'x'"):
        config.load(path, {"train.steps": "x"})
    # lists as TOML writes them too
    cfg = config.load(path, {"plan.batch_sizes": "[16, 32]", "plan.strategies": '["zero3", "hsdp"]'})
    assert cfg.plan.batch_sizes == (16, 32) and cfg.plan.strategies == ("zero3", "hsdp")
    with pytest.raises(ConfigError,
                       match=r"--mesh\.shape \(a comma-separated list, e\.g\. 2,4\): expected int, got 'x'"):
        config.load(path, {"mesh.shape": "2,x"})

"""Config loading: YAML + overrides, validation, round trip."""

import pytest
import yaml

from steadydiff.config import Config, ConfigError, config_from_dict, dump_config, load_config


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["train.lr=1e-4", "model.channel_mult=[1,2]", "train.grad_clip=null",
                             "data.hflip=true", "model.skip_scaling=ls_ns", "train.steps=10"])
    assert cfg.train.lr == 1e-4 and cfg.model.channel_mult == [1, 2] and cfg.train.grad_clip is None
    assert cfg.data.hflip is True and cfg.model.skip_scaling == "ls_ns" and cfg.train.steps == 10


def test_file_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  skip_scaling: cs\n  kappa: 0.7\ntrain:\n  steps: 5\n")
    cfg = load_config(p, ["train.steps=7"])
    assert (cfg.model.skip_scaling, cfg.model.kappa, cfg.train.steps) == ("cs", 0.7, 7)


def test_round_trip_through_yaml():
    cfg = load_config(None, ["model.skip_scaling=cs", "train.betas=[0.99, 0.999]"])
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg and isinstance(again, Config)


@pytest.mark.parametrize("override, needle", [
    ("train.bf16=yes please", "expected true or false"),
    ("train.betas=[0.9]", "two numbers"),
    ("train.grad_accum=3", "divisible"),
    ("trian.steps=3", "unknown config key trian"),
    ("train.lr", "expected KEY=VALUE"),
    ("model.channel_mult=3", "expected a list"),
])
def test_invalid_values(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_invalid_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_shipped_configs_load():
    for name in sorted(str(p) for p in __import__("pathlib").Path("configs").glob("*.yaml")):
        load_config(name)

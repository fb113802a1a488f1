"""Config loading: YAML + dotted overrides; every mistake is a ConfigError naming the key."""

from pathlib import Path

import pytest

from async_rl.config import ConfigError, config_from_yaml_text, load_config, save_config, to_yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.mode in ("async", "sync")


def test_overrides_apply_and_round_trip(tmp_path):
    cfg = load_config(CONFIGS / "debug_cpu.yaml", ["trainer.lr=1e-5", "max_staleness=4", "mode=sync"])
    assert cfg.trainer.lr == 1e-5 and cfg.max_staleness == 4 and cfg.mode == "sync"
    path = save_config(cfg, tmp_path)
    assert config_from_yaml_text(path.read_text()) == cfg
    assert "max_staleness: 4" in to_yaml(cfg)


@pytest.mark.parametrize("overrides,needle", [
    (["bogus=1"], "bogus: unknown key"),
    (["trainer.bogus=1"], "trainer.bogus: unknown key"),
    (["trainer.lr=fast"], "trainer.lr"),
    (["max_staleness=-1"], "max_staleness"),
    (["mode=turbo"], "mode: must be one of async|sync"),
    (["trainer.batch_size=12"], "trainer.batch_size: must be a multiple"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["novalue"], "expected key=value"),
    (["trainer.tensor_parallel=2", "trainer.world_size=2"], "trainer.tensor_parallel: only trainer.backend=megatron"),
    (["trainer.backend=megatron", "trainer.world_size=3", "trainer.tensor_parallel=2"],
     "trainer.tensor_parallel: must divide trainer.world_size (3"),
    (["trainer.backend=megatron", "trainer.tensor_parallel=0"], "trainer.tensor_parallel: must be >= 1"),
    (["trainer.backend=megatron", "trainer.megatron_spec=fast"], "trainer.megatron_spec: must be one of auto|local|te"),
    (["trainer.pack_sequences=auto"], "trainer.pack_sequences"),  # null is auto
])
def test_bad_overrides_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "debug_cpu.yaml", overrides)
    assert needle in str(info.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trainer:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match="trainer.learning_rate: unknown key"):
        load_config(unknown)


def _choice_keys(cls=None, prefix=""):
    import dataclasses
    import typing

    from async_rl.config import Config, choices

    cls = cls or Config
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            yield from _choice_keys(hint, f"{prefix}{name}.")
        elif choices(prefix + name):
            yield prefix + name


def test_every_choice_field_refuses_a_value_outside_its_literal_naming_the_key():
    keys = sorted(_choice_keys())
    assert {"mode", "launcher", "engine.backend", "weight_sync.transport", "trainer.backend"} <= set(keys)
    for key in keys:
        with pytest.raises(ConfigError, match=rf"^{key}: must be one of .*, got 'bogus'$"):
            load_config(CONFIGS / "debug_cpu.yaml", [f"{key}=bogus"])

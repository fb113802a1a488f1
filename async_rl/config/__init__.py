"""One typed config tree for a run: a dataclass per component, composed in `Config`.

Loaded from a YAML file in `configs/` and overridden from the command line with dotted
keys (`trainer.lr=1e-5`). OmegaConf structured configs do the merging and the type
checks; `load_config` turns every failure into a `ConfigError` whose message names the
dotted key, so the command line can print one clear line. The top-level keys `mode`,
`max_staleness`, `total_steps`, `run_dir` and `seed` are a frozen surface.

This package is that surface; import from here. Its parts: components.py (the sections of model,
engine, task, rollout, agent, trainer), run.py (the run-wide sections and `Config`), load.py (YAML,
overrides, back to YAML), validate.py (what the types alone cannot check), secrets.py (api key and
CURVE key files).
"""

from async_rl.config.components import (
    AgentConfig,
    ConfigError,
    Dtype,
    EngineConfig,
    ModelConfig,
    RolloutConfig,
    TaskConfig,
    TrainerConfig,
)
from async_rl.config.load import choices, config_from_yaml_text, load_config, save_config, to_yaml
from async_rl.config.run import (
    ClusterConfig,
    Config,
    CoresConfig,
    LogConfig,
    RayConfig,
    SuperviseConfig,
    TransportConfig,
    WeightSyncConfig,
)
from async_rl.config.secrets import CURVE_KEY_FILES, REDACTED, missing_curve_files, resolve_secret
from async_rl.config.validate import validate

__all__ = [
    "CURVE_KEY_FILES", "REDACTED", "AgentConfig", "ClusterConfig", "Config", "ConfigError", "CoresConfig", "Dtype",
    "EngineConfig", "LogConfig", "ModelConfig", "RayConfig", "RolloutConfig", "SuperviseConfig", "TaskConfig",
    "TrainerConfig", "TransportConfig", "WeightSyncConfig", "choices", "config_from_yaml_text", "load_config",
    "missing_curve_files", "resolve_secret", "save_config", "to_yaml", "validate",
]

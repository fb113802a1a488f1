"""Load a config: YAML over the defaults, dotted `key=value` overrides, and back to YAML.

OmegaConf structured configs do the merging and the type checks; every failure becomes a ConfigError
whose message names the dotted key (a choice field's allowed values read from its `Literal`).
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from async_rl.config.components import ConfigError
from async_rl.config.run import Config
from async_rl.config.secrets import REDACTED
from async_rl.config.validate import validate


def choices(dotted: str) -> tuple[str, ...]:
    """The values a choice field (typed `Literal[...]`) allows, e.g. choices("weight_sync.transport"); () otherwise."""
    hint: Any = Config
    for part in dotted.split("."):
        hints = get_type_hints(hint) if isinstance(hint, type) else {}
        if part not in hints:
            return ()
        hint = hints[part]
    return get_args(hint) if get_origin(hint) is Literal else ()


def _explain(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
    msg = str(exc).splitlines()[0]
    allowed = choices(str(key)) if key else ()
    got = re.match(r"Invalid value (.+), expected one of", msg)
    if allowed and got:  # a Literal field: the type is the one place its choices are written
        return f"{key}: must be one of {'|'.join(allowed)}, got {got.group(1)}"
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        return f"{key}: unknown key"
    return f"{key}: {msg}" if key else msg


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load `path` (YAML) over the defaults, apply `key=value` overrides, validate."""
    base = OmegaConf.structured(Config)
    try:
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            try:
                loaded = OmegaConf.load(p)
            except Exception as exc:  # YAML syntax errors come in many types
                raise ConfigError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
            base = OmegaConf.merge(base, loaded)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value")
        if overrides:
            base = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        cfg: Config = OmegaConf.to_object(base)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None
    validate(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config next to the run's outputs (a literal engine.api_key redacted)."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    if cfg.engine.api_key and not cfg.engine.api_key.startswith(("env:", "file:")):
        cfg = replace(cfg, engine=replace(cfg.engine, api_key=REDACTED))
    out.write_text(to_yaml(cfg))
    return out


def config_from_yaml_text(text: str) -> Config:
    """Rebuild a Config from `to_yaml` output (used to hand a config to a child process)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text))
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None
    validate(cfg)
    return cfg

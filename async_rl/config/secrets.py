"""Secrets a config names: the api key's "env:"/"file:" forms, and the CURVE key files each side needs."""

from __future__ import annotations

import os
from pathlib import Path

from async_rl.config.components import ConfigError


# Files of transport.curve_keys_dir each side needs (the layout `async-rl keys` writes).
CURVE_KEY_FILES: dict[str, tuple[str, ...]] = {
    "trainer": ("server.key_secret", "authorized_clients"),  # its key pair; public keys of admitted producers
    "rollout": ("server.key", "client.key_secret"),  # the trainer's public key; its own key pair
}
REDACTED = "<redacted>"


def missing_curve_files(keys_dir: str | os.PathLike, side: str) -> list[str]:
    """The files of CURVE_KEY_FILES[side] that `keys_dir` lacks."""
    return [name for name in CURVE_KEY_FILES[side] if not (Path(keys_dir) / name).exists()]


def resolve_secret(value: str, key: str) -> str:
    """A secret config value: itself, for "env:NAME" the environment variable NAME, for "file:PATH" the
    file's first line (ConfigError if unset, missing or empty)."""
    if value.startswith("file:"):
        path = Path(value[len("file:"):])
        secret = path.read_text().strip() if path.is_file() else ""
        if not secret:
            raise ConfigError(f"{key}: {path} is missing or empty (`async-rl keys --out DIR` writes DIR/api_key)")
        return secret
    if not value.startswith("env:"):
        return value
    name = value[len("env:"):]
    secret = os.environ.get(name, "")
    if not name or not secret:
        raise ConfigError(f"{key}: environment variable {name!r} is not set (or empty); export it, "
                          "or give the token itself")
    return secret

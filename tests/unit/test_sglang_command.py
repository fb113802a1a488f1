"""The SGLang server command line carries what the run configures (no GPU or SGLang needed to check it)."""

from async_rl.config import load_config
from launch.sglang_server import sglang_command


def test_api_key_reaches_sglang_and_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("ASYNC_RL_TEST_TOKEN", "s3cret")
    cfg = load_config(None, ["engine.backend=sglang", "model.name=/models/x", "engine.api_key=env:ASYNC_RL_TEST_TOKEN"])
    cmd = sglang_command(cfg, 30000)
    assert cmd[cmd.index("--api-key") + 1] == "s3cret"
    assert "--api-key" not in sglang_command(load_config(None, ["model.name=/models/x"]), 30000)

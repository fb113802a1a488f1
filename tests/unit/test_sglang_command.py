"""The SGLang server command line carries what the run configures (no GPU or SGLang needed to check it).

Where SGLang's source is installed (`make install`), every flag is also checked against SGLang's own
server-argument definitions: `sglang/srt/arg_groups/fields/*.py` (a flag is `--` + the field name with
dashes, `arg_utils._field_to_cli_name`). Those modules import triton, so they are read, not imported.
"""

import ast

import pytest

import sglang_source
from async_rl.config import load_config
from async_rl.launch.sglang_server import sglang_command


def test_api_key_reaches_sglang_and_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("ASYNC_RL_TEST_TOKEN", "s3cret")
    cfg = load_config(None, ["engine.backend=sglang", "model.name=/models/x", "engine.api_key=env:ASYNC_RL_TEST_TOKEN"])
    cmd = sglang_command(cfg, 30000)
    assert cmd[cmd.index("--api-key") + 1] == "s3cret"
    assert "--api-key" not in sglang_command(load_config(None, ["model.name=/models/x"]), 30000)


def _everything():
    cfg = load_config(None, ["engine.backend=sglang", "model.name=/models/x", "model.dtype=bfloat16",
                             "engine.api_key=k", "engine.incremental_streaming_output=true",
                             "engine.deterministic_inference=true", "engine.gpu_memory_fraction=0.45",
                             "engine.tp_size=2"])
    return sglang_command(cfg, 30000)


def test_streaming_shape_seeds_and_memory_share_reach_sglang():
    cmd = _everything()
    assert "--incremental-streaming-output" in cmd and "--enable-deterministic-inference" in cmd
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.45"
    plain = sglang_command(load_config(None, ["model.name=/models/x"]), 30000)
    assert not {"--incremental-streaming-output", "--enable-deterministic-inference", "--mem-fraction-static"} & set(plain)


@pytest.mark.skipif(sglang_source.source_dir() is None, reason=sglang_source.SKIP)
def test_every_flag_is_one_sglang_defines():
    fields = set()
    for path in (sglang_source.source_dir() / "srt" / "arg_groups" / "fields").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                fields.add("--" + node.target.id.replace("_", "-"))
    cmd = _everything()
    flags = [a for a in cmd[cmd.index("sglang.launch_server") + 1:] if a.startswith("--")]
    assert len(flags) >= 10 and set(flags) <= fields, set(flags) - fields

"""vLLM's shapes as this project reads and writes them (async_rl/engine/vllm_api.py), and the server's command.

Pure functions over the JSON vLLM 0.32 sends (entrypoints/scale_out/token_in_token_out/protocol.py,
serving.py); the bodies are also held to vLLM's own request and response models in
tests/integration/test_vllm_contract.py, and a real server runs the conformance suite.
"""

from pathlib import Path

import pytest

from async_rl.config import load_config
from async_rl.engine.sglang_api import output_from_response
from async_rl.engine.vllm_api import generate_body, merge_chunk, sglang_shaped, unsupported_field
from async_rl.types import RequestRefused, SamplingParams
from async_rl.launch.vllm_server import engine_python, start_vllm, vllm_command
from tests.e2e.test_run import DEBUG


def choice(ids, lps, **extra):
    return {"index": 0, "token_ids": ids, "finish_reason": extra.pop("finish_reason", None),
            "logprobs": {"content": [{"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                                     for t, lp in zip(ids, lps)]}, **extra}


@pytest.mark.parametrize("field,value", [("top_p", 0.9), ("top_k", 20), ("min_p", 0.1),
                                         ("repetition_penalty", 1.2), ("presence_penalty", 0.5),
                                         ("logit_bias", {3: 1.0})])
def test_what_would_change_vllms_log_probs_is_refused_naming_the_field(field, value):
    params = SamplingParams(**{field: value})
    assert unsupported_field(params) == field
    with pytest.raises(ValueError, match=rf"^sampling_params.{field}: engine.backend=vllm reports log-probs after"):
        generate_body([1, 2], params, "r")


def test_neutral_values_pass_and_the_body_uses_vllms_names():
    body = generate_body([1, 2], SamplingParams(max_new_tokens=9, min_new_tokens=2, temperature=0.7, top_k=-1,
                                                seed=-5, stop_token_ids=(4,), top_logprobs=3), "r1", stream=True)
    sp = body["sampling_params"]
    assert body["token_ids"] == [1, 2] and body["request_id"] == "r1" and body["output_mode"] == "tokens"
    assert (sp["max_tokens"], sp["min_tokens"], sp["temperature"], sp["logprobs"]) == (9, 2, 0.7, 3)
    assert sp["stop_token_ids"] == [4] and sp["seed"] >= 0 and not sp["detokenize"] and body["stream"]


def test_an_answer_reads_as_sglangs_shape_with_vllms_version_spans():
    body = {"usage": {"prompt_tokens": 2}, "choices": [choice([5, 6, 7], [-0.1, -0.2, -0.3], finish_reason="length",
                                                              weight_versions=[{"version": "3", "start": 0, "end": 2},
                                                                               {"version": "4", "start": 2, "end": 3}])]}
    out = output_from_response("r", sglang_shaped(body, "r"))
    assert out.output_ids == [5, 6, 7] and out.output_logprobs == [-0.1, -0.2, -0.3]
    assert out.output_versions == [3, 3, 4] and out.finish_reason == "length" and out.prompt_len == 2


@pytest.mark.parametrize("body,match", [
    ({"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}, "prompt too long"),
    ({"choices": [choice([5], [-9999.0], finish_reason="stop")]}, "no log-prob for output token 0"),
    ({"choices": [choice([5, 6], [-0.1], finish_reason="stop")]}, "1 log-probs for 2 tokens"),
    ({"choices": [choice([5], [-0.1], finish_reason="error")]}, "finish_reason error"),
])
def test_an_error_or_a_missing_log_prob_is_a_refused_request_never_a_made_up_value(body, match):
    with pytest.raises(RequestRefused, match=match):
        sglang_shaped(body, "r")


def test_stream_chunks_accumulate_and_the_last_brings_the_spans():
    acc = None
    for chunk in ({"choices": [choice([5], [-0.1])]}, {"choices": [choice([6], [-0.2])]},
                  {"choices": [choice([7], [-0.3], finish_reason="stop",
                                      weight_versions=[{"version": "1", "start": 0, "end": 3}])]},
                  {"usage": {"prompt_tokens": 4}, "choices": []}):
        acc = merge_chunk(acc, chunk)
    out = output_from_response("r", sglang_shaped(acc, "r"))
    assert out.output_ids == [5, 6, 7] and out.output_versions == [1, 1, 1] and out.finish_reason == "stop"
    with pytest.raises(RequestRefused, match="over the context"):
        merge_chunk(acc, {"error": {"message": "over the context", "code": 400}})


def test_the_server_command_on_a_cpu(tmp_path):
    def command(*overrides):
        cfg = load_config(DEBUG, [f"run_dir={tmp_path}", "engine.backend=vllm", "model.tiny_heads=2",
                                  "engine.kv_cache_mb=1", *overrides])
        cmd, env = vllm_command(cfg, "/x/python", tmp_path, 8000)
        return dict(zip(cmd, cmd[1:])), cmd, env

    flags, cmd, env = command("model.dtype=bfloat16")
    assert flags["--dtype"] == "bfloat16" and "-rotary_embedding" in flags["--compilation-config"]
    assert flags["--kv-cache-memory-bytes"] == str(2**20) and "--enforce-eager" in cmd
    assert int(flags["--max-model-len"]) <= 64  # the tiny model's positions, and what 1 MB of KV holds
    assert flags["--logprobs-mode"] == "processed_logprobs" and "--enable-scale-out" in cmd
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    extension = Path(env["PYTHONPATH"]) / (flags["--worker-extension-cls"].split(".")[0] + ".py")
    assert extension.is_file()  # what vLLM imports from that path
    flags, cmd, _ = command("model.dtype=float32")
    assert flags["--dtype"] == "float32" and "--compilation-config" not in cmd


def test_a_routable_host_or_a_missing_environment_is_one_error_naming_the_key(tmp_path):
    cfg = load_config(DEBUG, [f"run_dir={tmp_path}", "engine.backend=vllm", "engine.host=0.0.0.0"])
    with pytest.raises(ValueError, match="^engine.host: engine.backend=vllm binds loopback only"):
        start_vllm(cfg, 0, {}, None)
    with pytest.raises(RuntimeError, match="^engine.python: '/nowhere/python' does not exist"):
        engine_python(load_config(DEBUG, ["engine.python=/nowhere/python"]))

"""The bodies the vLLM client sends, held to vLLM 0.32's own models, in vLLM's own environment (.venv-vllm).

vLLM parses `sampling_params` with `cls(**value)` and drops unknown keys silently (VLLM.md 1.2:
`{"max_new_tokens": 5}` gives max_tokens=16), so a misspelt key would change sampling without an
error: every key the client sends must be a field of vLLM's `SamplingParams`, and the whole body one
vLLM's `GenerateRequest` accepts (entrypoints/scale_out/token_in_token_out/protocol.py). What the
client reads from an answer must be fields of vLLM's response models. Skipped, saying why, where
the environment is missing (`make install` builds it).
"""

import json
import subprocess

import pytest

from async_rl.config import load_config
from async_rl.engine.vllm_api import generate_body
from async_rl.types import SamplingParams
from async_rl.launch.vllm_server import engine_python
from tests.e2e.test_run import DEBUG

CHECK = """
import json, sys
from vllm.entrypoints.scale_out.token_in_token_out import protocol
from vllm.sampling_params import SamplingParams
bodies = json.load(sys.stdin)
fields = set(SamplingParams.__struct_fields__) if hasattr(SamplingParams, "__struct_fields__") else set(vars(SamplingParams()))
out = {"unknown": [sorted(set(b["sampling_params"]) - fields) for b in bodies], "errors": []}
for b in bodies:
    try:
        protocol.GenerateRequest.model_validate(b)
    except Exception as exc:
        out["errors"].append(str(exc)[:300])
out["choice_fields"] = sorted(protocol.GenerateTokensChoice.model_fields) + sorted(protocol.GenerateTokensStreamChoice.model_fields)
out["logprob_fields"] = sorted(protocol.GenerateLogProbsContent.model_fields)
bad = {**bodies[0], "token_ids": [-1]}
try:
    protocol.GenerateRequest.model_validate(bad)
    out["refuses"] = False
except Exception:
    out["refuses"] = True
print(json.dumps(out))
"""


def test_every_body_is_one_vllms_models_accept_with_no_key_it_would_drop():
    try:
        python = engine_python(load_config(DEBUG, ["engine.backend=vllm"]))
    except RuntimeError as exc:
        pytest.skip(str(exc))
    bodies = [generate_body([1, 2, 3], SamplingParams(max_new_tokens=4, min_new_tokens=1, temperature=0.7, seed=3,
                                                       top_logprobs=2, stop_token_ids=(5,), stop=("\n",),
                                                       ignore_eos=True), "r1", stream=s) for s in (False, True)]
    res = subprocess.run([python, "-c", CHECK], input=json.dumps(bodies), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["unknown"] == [[], []] and got["errors"] == [], got
    assert got["refuses"]  # the model does refuse a bad body: the check can fail
    read = {"token_ids", "finish_reason", "stop_reason", "logprobs", "weight_versions"}  # vllm_api.sglang_shaped
    assert read <= set(got["choice_fields"]) and {"token_id", "logprob", "top_logprobs"} <= set(got["logprob_fields"])

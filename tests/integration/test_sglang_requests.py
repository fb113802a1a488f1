"""Every request body the client sends, checked by SGLang 0.5.23's own request models.

The client drives a real embedded server through every call it has (generation, streaming,
pauses in each mode, updates from disk, aborts, the distributed-update routes with their
session); an httpx hook records each body as it leaves. Each is then checked the way SGLang's
HTTP server checks it (`sglang_source`): a /generate body by its JSON schema gate
(srt/entrypoints/api_contract.py), every other by the request class its route takes
(srt/managers/io_struct.py, built from that file's own definitions). Keys SGLang does not
declare are accepted and ignored there; the ones the client sends are listed below with the
reason, so a new one is a decision, not an accident. Skipped where sglang is not installed.
"""

import asyncio
import json

import pytest
import torch

import sglang_source
from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.types import SamplingParams
from async_rl.launch.common import free_port
from async_rl.launch.serve import BackgroundServer
from served_weights import save_weights_dir

pytestmark = pytest.mark.skipif(sglang_source.source_dir() is None, reason=sglang_source.SKIP)

MODELS = {  # route -> the request class http_server.py takes there (io_struct.py)
    "/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput", "/abort_request": "AbortReq",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput",
}
IGNORED_BY_SGLANG = {  # keys the client sends that SGLang's models do not declare, and why they are sent
    "/init_weights_update_group": {"timeout_s"},  # the embedded server's join deadline; SGLang has its own
}


@pytest.fixture(scope="module")
def sent(tmp_path_factory):
    """(route, body) of every request the client sent while driving a real server through all its calls."""
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
    weights = save_weights_dir(model, tmp_path_factory.mktemp("w") / "v000001")
    bodies: list[tuple[str, dict]] = []

    async def record(request):
        if request.method == "POST":
            bodies.append((request.url.path, json.loads(request.content or b"{}")))

    async def drive(url):
        client = HttpGenerationClient(url, timeout_s=60)
        client._http.event_hooks["request"].append(record)
        params = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=20, seed=3, top_logprobs=2,
                                stop_token_ids=(5,), min_new_tokens=1)
        try:
            prompt = tok.encode("2+2=")
            await client.generate(prompt, params)
            async for _ in client.generate_stream(prompt, params, "streamed"):
                pass
            for version, mode in enumerate(("retract", "abort", "in_place"), start=1):
                await client.pause_generation(mode)
                await client.update_weights_from_disk(weights, version)
                await client.continue_generation()
            await client.abort_request("gone")
            in_place = HttpGenerationClient(url, timeout_s=60, pause_mode="in_place")
            in_place._http.event_hooks["request"].append(record)
            in_place.weight_updated(3)
            await in_place.generate(prompt, params)
            async for _ in in_place.generate_stream(prompt, params, "salted"):
                pass
            await in_place.close()
            with pytest.raises(ValueError):
                await client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "g", "gloo", timeout_s=1)
            await client.begin_weight_update()  # a version goes in one session, one request per bucket
            with pytest.raises(ValueError):  # no such group: refused inside the session
                await client.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]], "g", None,
                                                             load_format="flattened_bucket")
            with pytest.raises(ValueError):
                await client.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]], "g", 9,
                                                             load_format="flattened_bucket", flush_cache=True)
            await client.end_weight_update()
            await client.destroy_weights_update_group("g")
        finally:
            await client.close()

    with BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=16), model_name="tiny") as url:
        asyncio.run(drive(url))
    return bodies


def test_every_route_the_client_posts_to_was_driven(sent):
    assert {route for route, _ in sent} == set(MODELS) | {"/generate"}


def test_generate_bodies_pass_sglangs_schema_gate(sent):
    bodies = [body for route, body in sent if route == "/generate"]
    assert bodies and all(sglang_source.generate_contract_error(b) is None for b in bodies), bodies
    # the gate does refuse: a rid that is not a string
    assert sglang_source.generate_contract_error({**bodies[0], "rid": 5}) is not None


def test_in_place_requests_keep_off_prefixes_cached_under_older_weights(sent):
    """Under an in_place pause SGLang keeps its radix cache across the update (it cannot flush while the paused
    requests hold KV), so requests that started later reused prefixes the old weights computed. They now carry
    the loaded version as SGLang's cache_salt (a cache namespace), which its schema gate takes."""
    salted = [b for route, b in sent if route == "/generate" and "cache_salt" in b]
    assert len(salted) == 2 and {b["cache_salt"] for b in salted} == {"v3"}
    assert all(sglang_source.generate_contract_error(b) is None for b in salted)
    assert all("cache_salt" not in b for route, b in sent if route == "/generate" and b not in salted)


def test_every_other_body_is_one_sglangs_route_model_accepts(sent):
    models = sglang_source.io_struct_models(*sorted(set(MODELS.values())))
    for route, body in sent:
        if route == "/generate":
            continue
        model = models[MODELS[route]]
        sglang_source.validate(model, body)  # pydantic.ValidationError (naming the field) if SGLang would 400
        assert sglang_source.ignored_keys(model, body) <= IGNORED_BY_SGLANG.get(route, set()), (route, body)


def test_the_models_refuse_what_sglang_refuses():
    """A check that cannot fail proves nothing: an int weight_version (what the client sent to
    /update_weights_from_distributed before) and an unknown pause mode are 400s on SGLang."""
    import pydantic

    models = sglang_source.io_struct_models("UpdateWeightsFromDistributedReqInput", "PauseGenerationReqInput")
    with pytest.raises(pydantic.ValidationError, match="weight_version"):
        sglang_source.validate(models["UpdateWeightsFromDistributedReqInput"],
                               {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": 3})
    with pytest.raises(pydantic.ValidationError, match="mode"):
        sglang_source.validate(models["PauseGenerationReqInput"], {"mode": "freeze"})

"""The SGLang contract: one set of tests that drives the embedded server and a real SGLang server alike.

Each contract test runs against every backend: `embedded` (always: a tiny model served for
real on a free port) and `sglang` (`@pytest.mark.gpu`; it also needs SGLang importable and
ASYNC_RL_SGLANG_MODEL naming a Hugging Face checkpoint directory, else it is skipped with
the reason). Covered: the /generate answer's shape (finish_reason objects, [logprob,
token_id, text] log-probs, weight_version, prompt/completion counts), the frontend's
null-filled sampling_params, n > 1 as a list, and a weight update under each pause mode
through `HttpGenerationClient`: `retract` (requests keep their tokens, per-token versions
split at the update), `abort` (partial answers at once; the client re-submits and joins the
pieces) and `in_place` (nothing steps while paused). On the embedded server the continued
sequences must equal uninterrupted ones token for token; on SGLang (GPU numerics, a batch
that changes) only their shape is checked. Tests after the contract are embedded-only:
what the engine refuses (naming the field), penalties and the log-prob rule over HTTP,
text trimming, /flush_cache.
"""

import asyncio
import glob
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch

from async_rl.config import EngineConfig, ModelConfig, load_config
from async_rl.engine.client import HttpGenerationClient
from async_rl.engine.sglang_api import generate_body, piece_rid
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.rollout.server_pool import ServerPool
from async_rl.types import SamplingParams, new_id
from async_rl.weight_sync.versions import version_dir
from launch.serve import BackgroundServer
from served_weights import save_weights_dir

TEXTS = ["The quick brown fox", "jumps over", "the lazy dog and keeps running", "Hello, world!"]
LONG = 160  # tokens per request in the interruption tests: long enough to be paused mid-way


@dataclass
class Target:
    url: str
    weights: str  # what /update_weights_from_disk loads: the weights being served, so sequences continue
    prompts: list[list[int]]
    exact: bool  # continued sequences equal uninterrupted ones token for token
    name: str = "tiny"  # model.name of a run that uses this server
    version: int = 0
    model: Any = None
    extra: dict = field(default_factory=dict)


def _sglang_skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed"
    if not os.environ.get("ASYNC_RL_SGLANG_MODEL"):
        return "set ASYNC_RL_SGLANG_MODEL to a Hugging Face checkpoint directory SGLang can serve"
    try:
        import sglang  # noqa: F401  (the server side needs the whole package, triton included)
    except Exception as exc:
        return f"sglang does not import here: {type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="module", params=["embedded", pytest.param("sglang", marks=pytest.mark.gpu)])
def target(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "embedded":
        torch.set_num_threads(1)
        tok = build_tiny_tokenizer(PRINTABLE)
        model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
        weights = save_weights_dir(model, version_dir(tmp / "weights", 1))  # as a run publishes them
        bg = BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=16), model_name="tiny")
        url = bg.start()
        yield Target(url, weights, [tok.encode(t) for t in TEXTS], exact=True, model=model,
                     extra={"tok": tok, "engine": bg.engine})
        bg.stop()
        return
    reason = _sglang_skip_reason()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    from launch.procs import stop_all
    from launch.sglang_server import start_sglang

    path = os.environ["ASYNC_RL_SGLANG_MODEL"]
    cfg = load_config(None, [f"model.name={path}", f"run_dir={tmp}", "engine.port=0"])
    proc, url = start_sglang(cfg, 0)
    tok = AutoTokenizer.from_pretrained(path)
    try:
        yield Target(url, path, [tok.encode(t) for t in TEXTS], exact=False, name=path)
    finally:
        stop_all([proc])


def run(target: Target, body, pause_mode: str = "retract"):
    async def main():
        client = HttpGenerationClient(target.url, timeout_s=120, pause_mode=pause_mode)
        try:
            return await body(client)
        finally:
            await client.close()
    return asyncio.run(main())


def greedy(n: int = LONG) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


async def streamed_until(url: str, body: dict, tokens: int) -> tuple[asyncio.Event, asyncio.Task]:
    """Stream `body`; the event is set once an answer chunk holds `tokens` output tokens (or it ended)."""
    reached = asyncio.Event()

    async def consume():
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
            async with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
                last = None
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and line.strip() != "data: [DONE]":
                        last = json.loads(line[5:])
                        if len(last["output_ids"]) >= tokens:
                            reached.set()
                reached.set()
                return last

    task = asyncio.create_task(consume())
    await asyncio.wait_for(reached.wait(), 60)
    return reached, task


# --------------------------------------------------------------------------- the contract
def test_generate_answer_has_sglangs_shape(target):
    prompt = target.prompts[0]
    with httpx.Client(base_url=target.url, timeout=60, trust_env=False) as http:
        resp = http.post("/generate", json={**generate_body(prompt, greedy(8), "shape-0"),
                                            "top_logprobs_num": 2, "return_text_in_logprobs": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == meta["completion_tokens"] == 8 and isinstance(body["text"], str)
    assert meta["id"] == "shape-0" and meta["prompt_tokens"] == len(prompt)
    assert meta["finish_reason"]["type"] == "length" and meta["finish_reason"].get("length") == 8
    assert "weight_version" in meta
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == body["output_ids"] and all(len(e) == 3 for e in entries)
    assert all(isinstance(e[0], float) and e[0] <= 0 and isinstance(e[2], str) for e in entries)
    assert all(len(pos) == 2 and pos[0][0] >= pos[1][0] for pos in meta["output_top_logprobs"])
    if target.model is not None:  # greedy: the reported log-prob is the top one of a fresh forward
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + body["output_ids"]])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits, -1).max(-1).values
        torch.testing.assert_close(torch.tensor([e[0] for e in entries]), want, atol=1e-4, rtol=0)


def test_frontend_style_null_params_and_n_samples(target):
    # what SGLang's frontend (RuntimeEndpoint + sgl.gen) sends: every key, unset ones null or empty
    frontend = {"max_new_tokens": 6, "min_new_tokens": None, "n": None, "stop": [], "stop_token_ids": [],
                "stop_regex": [], "temperature": 1.0, "top_p": None, "top_k": None, "min_p": None,
                "frequency_penalty": None, "presence_penalty": None, "ignore_eos": True, "regex": None,
                "json_schema": None, "skip_special_tokens": True, "spaces_between_special_tokens": True}
    with httpx.Client(base_url=target.url, timeout=60, trust_env=False) as http:
        one = http.post("/generate", json={"input_ids": target.prompts[1], "sampling_params": frontend})
        assert one.status_code == 200, one.text
        assert len(one.json()["output_ids"]) == 6
        many = http.post("/generate", json={"input_ids": target.prompts[1], "rid": "grp", "return_logprob": True,
                                            "sampling_params": {**frontend, "n": 3, "sampling_seed": 7}})
        assert many.status_code == 200, many.text
    answers = many.json()
    assert isinstance(answers, list) and [a["meta_info"]["id"] for a in answers] == ["grp_0", "grp_1", "grp_2"]
    assert all(len(a["output_ids"]) == 6 == len(a["meta_info"]["output_token_logprobs"]) for a in answers)


def _check_continued(target: Target, ref, outs, old: int, new: int) -> None:
    for r, o in zip(ref, outs):
        assert o.finish_reason == "length" and len(o.output_ids) == LONG
        assert o.output_versions[0] == old and o.output_versions[-1] == new
        assert o.output_versions == sorted(o.output_versions), "versions go forward along a response"
        assert o.num_interruptions >= 1
        if target.exact:  # same weights reloaded: the sequences continue exactly, with the same log-probs
            assert o.output_ids == r.output_ids
            assert max(abs(a - b) for a, b in zip(o.output_logprobs, r.output_logprobs)) <= 1e-4


@pytest.mark.parametrize("mode", ["retract", "abort", "in_place"])
def test_weight_update_under_each_pause_mode(target, mode):
    async def body(c):
        ref = await asyncio.gather(*(c.generate(p, greedy()) for p in target.prompts))
        old, new = target.version, target.version + 1
        tasks = [asyncio.create_task(c.generate(p, greedy(), f"{mode}-{i}")) for i, p in enumerate(target.prompts)]
        _, probe = await streamed_until(target.url, generate_body(target.prompts[0], greedy(), f"probe-{mode}"), 20)
        retractions = c.retractions_total
        await c.pause_generation()
        if mode == "in_place":  # nothing steps while paused
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in tasks)
        update = await c.update_weights_from_disk(target.weights, new)
        await c.continue_generation()
        outs = await asyncio.gather(*tasks)
        await probe
        return ref, update, outs, retractions, c.retractions_total

    ref, update, outs, before, after = run(target, body, pause_mode=mode)
    target.version += 1
    assert update["success"]
    _check_continued(target, ref, outs, target.version - 1, target.version)
    if mode == "retract":
        assert after - before >= len(outs), "every request in flight was retracted once"


def test_an_update_asking_to_flush_under_an_in_place_pause_with_requests_running_fails(target):
    """SGLang refuses to flush the cache while requests run (scheduler.py, flush_cache: `is_fully_idle`), and an
    update that asks for the flush then fails, after loading (scheduler_components/weight_updater.py,
    flush_cache_after_weight_update). Under `in_place` the paused requests keep running, so only
    `flush_cache: false` updates; the client sends that under its in_place pauses."""
    async def body(c):
        _, probe = await streamed_until(target.url, generate_body(target.prompts[2], greedy(), "in-place-probe"), 5)
        await c.pause_generation("in_place")
        try:
            update = {"model_path": target.weights, "weight_version": str(target.version + 1)}
            flushing = await c._http.post("/update_weights_from_disk", json=update)
            kept = await c._http.post("/update_weights_from_disk", json={**update, "flush_cache": False})
        finally:
            await c.continue_generation()
        await probe
        return flushing, kept

    flushing, kept = run(target, body)
    target.version += 1  # SGLang loaded it even though the first call failed
    assert flushing.status_code == 400 and "flush" in flushing.text.lower(), flushing.text
    assert kept.status_code == 200, kept.text


def test_health_gets_no_answer_while_paused_but_model_info_does(target):
    """SGLang's /health generates one token (sglang/srt/entrypoints/http_server.py, health_generate, with
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION on, srt/environ.py), which waits while generation is paused;
    /model_info answers at once. So a client that paused a server probes /model_info (see test_server_pool)."""
    async def body(c):
        await c.pause_generation("retract")
        try:
            with pytest.raises(httpx.TimeoutException):
                await c._http.get("/health", timeout=2.0)
            assert await c.health()  # the client asks /model_info while it holds the pause
            return (await c._http.get("/model_info", timeout=2.0)).status_code
        finally:
            await c.continue_generation()

    assert run(target, body) == 200
    with httpx.Client(base_url=target.url, timeout=30, trust_env=False) as http:
        assert http.get("/health").status_code == 200


def test_pause_in_abort_mode_answers_at_once_with_the_partial_output(target):
    async def body(c):
        pending = asyncio.create_task(c._request("POST", "/generate", generate_body(target.prompts[2], greedy(),
                                                                                     "partial")))
        _, probe = await streamed_until(target.url, generate_body(target.prompts[3], greedy(), "probe-ab"), 10)
        await c.pause_generation("abort")
        try:
            answer = await asyncio.wait_for(pending, 30)
            held = asyncio.create_task(c.generate(target.prompts[0], greedy(4), "held"))
            await asyncio.sleep(0.3)
            assert not held.done(), "new requests wait while paused"
        finally:
            await c.continue_generation()
        await probe
        return answer, await held

    answer, held = run(target, body)
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < len(answer["output_ids"]) < LONG
    assert len(meta["output_token_logprobs"]) == len(answer["output_ids"])
    assert held.finish_reason == "length" and len(held.output_ids) == 4


@pytest.mark.parametrize("route", ["/update_weights_from_disk", "/update_weights_from_distributed"])
def test_weight_version_must_be_a_string(target, route):
    """SGLang declares `weight_version: Optional[str]` in every update request (sglang/srt/managers/io_struct.py,
    UpdateWeightFromDiskReqInput, UpdateWeightsFromDistributedReqInput) and pydantic v2 does not turn an int
    into a str: an int is a 400 before anything runs. The client sends a string (checked against SGLang's
    own request models in test_sglang_requests.py)."""
    body = {"model_path": target.weights} if route.endswith("disk") else {"names": [], "dtypes": [], "shapes": []}
    with httpx.Client(base_url=target.url, timeout=60, trust_env=False) as http:
        resp = http.post(route, json={**body, "weight_version": target.version + 1})
    # pydantic's own words, which both servers pass on (SGLang in str(RequestValidationError))
    assert resp.status_code == 400 and "weight_version" in resp.text and "valid string" in resp.text, resp.text


def test_abort_request_aborts_every_rid_it_prefixes_so_pieces_never_share_one(target):
    """SGLang aborts every request whose rid starts with the given one (sglang/srt/managers/scheduler.py,
    Scheduler.abort_request: `req.rid.startswith(recv_req.rid)`). The names failover gave a request's
    pieces (the rid, then "<rid>-m1") let the abort of a first piece kill the moved one; `piece_rid`'s
    cannot prefix each other."""
    rid = new_id()
    old_first, old_moved = rid, f"{rid}-m1"
    first, moved = piece_rid(rid, 0), piece_rid(rid, 1)

    async def main():
        tasks = {}
        for name in (old_first, old_moved, first, moved):
            _, tasks[name] = await streamed_until(target.url, generate_body(target.prompts[0], greedy(), name), 3)
        async with httpx.AsyncClient(base_url=target.url, timeout=60, trust_env=False) as http:
            for name in (old_first, first):
                assert (await http.post("/abort_request", json={"rid": name})).status_code == 200
        return {name: (await task)["meta_info"]["finish_reason"]["type"] for name, task in tasks.items()}

    ends = asyncio.run(main())
    assert ends[old_first] == "abort" and ends[old_moved] == "abort", ends  # SGLang's rule, on both servers
    assert ends[first] == "abort" and ends[moved] == "length", ends  # a piece's abort stays with that piece


def test_a_distributed_update_runs_only_inside_a_weight_update_session(target):
    """SGLang 0.5.23 (sglang/srt/managers/scheduler_components/weight_updater.py, SchedulerWeightUpdaterManager):
    /update_weights_from_distributed outside /begin_weight_update ... /end_weight_update is refused, and so
    are a second begin and an end without a begin; each a 400 with success false. (0.5.17 had no session.)"""
    update = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "no_such_group",
              "weight_version": str(target.version + 1)}
    with httpx.Client(base_url=target.url, timeout=60, trust_env=False) as http:
        outside = http.post("/update_weights_from_distributed", json=update)
        assert outside.status_code == 400 and "begin_weight_update" in outside.text, outside.text
        assert http.post("/begin_weight_update", json={}).status_code == 200
        again = http.post("/begin_weight_update", json={})
        assert again.status_code == 400 and "already open" in again.text, again.text
        inside = http.post("/update_weights_from_distributed", json=update)  # past the session: the group is unknown
        assert inside.status_code == 400 and "begin_weight_update" not in inside.text, inside.text
        assert http.post("/end_weight_update", json={}).status_code == 200
        closed = http.post("/end_weight_update", json={})
        assert closed.status_code == 400 and "no weight-update session" in closed.text, closed.text


def test_update_from_disk_takes_a_directory_which_is_then_the_model_it_reports(target):
    """SGLang loads a local checkpoint only from a directory (sglang/srt/model_loader/loader.py,
    `os.path.isdir` in DefaultModelLoader._prepare_weights; a file path goes to the hub and fails), and
    reports the directory it loaded as `model_path` afterwards (tokenizer_manager._update_model_path_info):
    the rollout side's model check must still pass on such a server (a restarted rollout side meets one)."""
    a_file = sorted(glob.glob(os.path.join(target.weights, "*.safetensors")))[0]

    async def body(c):
        with pytest.raises(ValueError, match="update_weights_from_disk"):
            await c.update_weights_from_disk(a_file, target.version + 1)
        await c.update_weights_from_disk(target.weights, target.version + 1)
        info = await c.get_model_info()
        pool = ServerPool([c])
        await pool.check_model(model_name=target.name, min_vocab=1)
        return info

    info = run(target, body)
    target.version += 1
    assert info["model_path"] == target.weights and str(info["weight_version"]) == str(target.version)


# --------------------------------------------------------------------------- embedded engine only
@pytest.fixture(scope="module")
def emb(tmp_path_factory):
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
    bg = BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=16), model_name="tiny")
    url = bg.start()
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        yield Target(url, "", [tok.encode(t) for t in TEXTS], exact=True, model=model,
                     extra={"tok": tok, "http": http, "engine": bg.engine})
    bg.stop()


REFUSED = [
    ({"sampling_params": {"regex": "[0-9]+"}}, "sampling_params.regex"),
    ({"sampling_params": {"json_schema": '{"type": "object"}'}}, "sampling_params.json_schema"),
    ({"sampling_params": {"stop_regex": ["a+"]}}, "sampling_params.stop_regex"),
    ({"sampling_params": {"ebnf": "root ::= 'a'"}}, "sampling_params.ebnf"),
    ({"sampling_params": {"beam_width": 4}}, "sampling_params.beam_width"),
    ({"sampling_params": {"frequency_penalty": 3.0}}, "sampling_params.frequency_penalty"),
    ({"sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "sampling_params.min_new_tokens"),
    ({"sampling_params": {"n": 2}, "stream": True}, "sampling_params.n"),
    ({"sampling_params": {"logit_bias": {"99999": 1.0}}}, "sampling_params.logit_bias"),
    ({"sampling_params": {"sampling_seed": 1, "seed": 2}}, "sampling_params.sampling_seed"),
    ({"image_data": "http://x/cat.png"}, "image_data"),
    ({"lora_path": "adapter"}, "lora_path"),
    ({"logprob_start_len": 0, "return_logprob": True}, "logprob_start_len"),
    ({"wat": 1}, "wat"),
]


@pytest.mark.parametrize("extra,field", REFUSED, ids=[f for _, f in REFUSED])
def test_what_the_engine_cannot_honour_is_refused_naming_it(emb, extra, field):
    body = {"input_ids": emb.prompts[0], **extra}
    body["sampling_params"] = {"max_new_tokens": 2, **extra.get("sampling_params", {})}
    resp = emb.extra["http"].post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith(field), resp.text
    ok = emb.extra["http"].post("/generate", json={"input_ids": emb.prompts[0], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def _forward_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def test_penalties_shape_the_draw_but_log_probs_stay_the_policys(emb):
    prompt, http = emb.prompts[3], emb.extra["http"]
    sp = {"max_new_tokens": 40, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 11}
    plain = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": sp}).json()
    pen = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": {
        **sp, "presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 2.0}}).json()
    ids = pen["output_ids"]
    assert len(set(ids)) > len(set(plain["output_ids"])), "penalties make the draw avoid repeats"
    got = torch.tensor([e[0] for e in pen["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, _forward_logprobs(emb.model, prompt, ids, 0.8), atol=1e-4, rtol=0)
    # min_new_tokens: the stop token (EOS) cannot come before it; logit_bias forces a token
    eos = sorted(emb.extra["engine"].engine.eos_token_ids)[0]
    forced = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "logit_bias": {str(eos): 100.0}, "min_new_tokens": 3}}).json()
    assert forced["output_ids"][3] == eos and eos not in forced["output_ids"][:3] and len(forced["output_ids"]) == 4
    assert forced["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_text_trimming_prefill_only_and_flush_cache(emb):
    http, tok, prompt = emb.extra["http"], emb.extra["tok"], emb.prompts[0]
    free = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}).json()
    stop = tok.decode(free["output_ids"][3:5])
    cut = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}}).json()
    kept = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop": [stop], "no_stop_trim": True}}).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["output_ids"] == kept["output_ids"] and kept["text"].endswith(stop) and not cut["text"].endswith(stop)
    empty = http.post("/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 0}}).json()
    assert empty["output_ids"] == [] and empty["meta_info"]["prompt_tokens"] == len(tok.encode("1+1="))
    assert http.post("/flush_cache").status_code == 200

    async def flush_while_running():
        async with httpx.AsyncClient(base_url=emb.url, timeout=60, trust_env=False) as c:
            _, probe = await streamed_until(emb.url, generate_body(prompt, greedy(), "flushed"), 5)
            refused = await c.get("/flush_cache")
            await c.post("/abort_request", json={"rid": "flushed"})
            await probe
            return refused.status_code

    assert asyncio.run(flush_while_running()) == 400

"""The SGLang contract: one set of tests that states SGLang 0.5.23's behaviour and holds both servers to it.

Each test runs against every backend (`sglang_targets.target`): `embedded` (always: a tiny
model served for real on a free port) and `sglang` (`@pytest.mark.gpu`; it also needs SGLang
importable and ASYNC_RL_SGLANG_MODEL naming a Hugging Face checkpoint directory, else it is
skipped with the reason). Covered: the /generate answer's shape (finish_reason objects,
[logprob, token_id, text] log-probs, weight_version, prompt/completion counts), the
frontend's null-filled sampling_params, n > 1 as a list, and a weight update under each pause
mode through `HttpGenerationClient`: `retract` (requests keep their tokens, per-token versions
split at the update), `abort` (partial answers at once; the client re-submits and joins the
pieces) and `in_place` (nothing steps while paused). On the embedded server the continued
sequences must equal uninterrupted ones token for token; on SGLang (GPU numerics, a batch that
changes) only their shape is checked. Then SGLang's rules, each naming the source that makes it
(and held to that line by tests/unit/test_sglang_source_rules.py): no flush under an `in_place`
pause with requests running, /health silent while paused, `weight_version` a string, prefix
aborts, the begin/end session around distributed updates, and /update_weights_from_disk taking
a directory that /model_info then reports. The embedded server's own refusals are in
test_generate_route.py.
"""

import asyncio
import glob
import os

import httpx
import pytest
import torch

from async_rl.engine.sglang_api import generate_body, piece_rid
from async_rl.rollout.server_pool import ServerPool
from async_rl.types import new_id
from sglang_targets import LONG, Target, greedy, run, streamed_until


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


def test_a_stream_gathers_stream_interval_tokens_per_chunk(target):
    """SGLang's per-request `sampling_params.stream_interval` (managers/scheduler_components/output_streamer.py):
    the first token at once, then a chunk whenever that many tokens are unsent, and the end; the answer is
    the one an interval of 1 streams. What the rollout side asks for with `rollout.stream_interval`."""
    async def body(c):
        c.stream_interval = 4
        chunked = [len(out.output_ids) async for out, _ in c.generate_stream(target.prompts[1], greedy(14))]
        c.stream_interval = 1
        every = [out async for out, _ in c.generate_stream(target.prompts[1], greedy(14))]
        return chunked, every

    chunked, every = run(target, body)
    assert [len(o.output_ids) for o in every] == list(range(1, 15))
    if target.exact:  # one token a step: the cadence is exact
        assert chunked == [1, 5, 9, 13, 14], chunked
    assert chunked[-1] == 14 and len(chunked) < len(every)
    with httpx.Client(base_url=target.url, timeout=60, trust_env=False) as http:
        for bad in (0, "4", True):
            body = generate_body(target.prompts[1], greedy(4), f"bad-interval-{bad}", stream=True)
            body["sampling_params"]["stream_interval"] = bad
            if target.exact:  # the embedded server names the field (SGLang's own refusal differs)
                resp = http.post("/generate", json=body)
                assert resp.status_code == 400 and "stream_interval" in resp.text, resp.text


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

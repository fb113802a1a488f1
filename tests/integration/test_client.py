"""`HttpGenerationClient` against a real embedded server: the `GenerationClient` contract end to end.

Many concurrent sessions on one client, errors mapped to ValueError (4xx, the server's
message) / ServerUnreachableError (nobody listening, fast, naming the address), pause ->
update weights -> continue through the client, abort by id, and a cancelled call
aborting its request on the server.
"""

import asyncio
import socket
import time
from types import SimpleNamespace

import pytest
import torch

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine.client import HttpGenerationClient, ServerUnreachableError
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.protocols import GenerationClient
from async_rl.types import SamplingParams
from async_rl.launch.serve import BackgroundServer
from served_weights import save_weights_dir


@pytest.fixture(scope="module")
def srv():
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
    bg = BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=16), model_name="tiny")
    with bg as url:
        yield SimpleNamespace(url=url, engine=bg.engine, tok=tok, model=model)


def run_with_client(url, body, **kw):
    """Run `body(client)` in a fresh event loop with a client that is closed afterwards."""
    async def main():
        client = HttpGenerationClient(url, **kw)
        try:
            return await body(client)
        finally:
            await client.close()
    return asyncio.run(main())


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wait_ready_on_a_closed_port_fails_fast_naming_the_address():
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(ServerUnreachableError) as err:
        run_with_client(url, lambda c: c.wait_ready(1.0))
    assert "not reachable after 1s" in str(err.value)  # its own timeout ended the wait (no clock bound: load)
    assert url in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ServerUnreachableError, match=url):
        run_with_client(url, lambda c: c.generate([1, 2], SamplingParams(max_new_tokens=2)))
    assert run_with_client(url, lambda c: c.health()) is False


def test_client_is_a_generation_client_and_reports_the_server(srv):
    async def body(c):
        await c.wait_ready(10)
        return isinstance(c, GenerationClient), await c.health(), await c.get_model_info()

    is_client, healthy, info = run_with_client(srv.url, body)
    assert is_client and healthy and info["vocab_size"] == len(srv.tok) and info["max_context"] == 512


def test_32_concurrent_generations_on_one_client(srv):
    prompts = [srv.tok.encode(f"{i}+{i}=") for i in range(32)]

    async def body(c):
        return await asyncio.gather(*(c.generate(p, SamplingParams(max_new_tokens=6 + i % 3, ignore_eos=True,
                                                                   seed=i, top_logprobs=2), f"cli-{i}")
                                      for i, p in enumerate(prompts)))

    outs = run_with_client(srv.url, body)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert out.request_id == f"cli-{i}" and out.prompt_len == len(p) and out.finish_reason == "length"
        assert len(out.output_ids) == len(out.output_logprobs) == len(out.output_versions) == 6 + i % 3
        assert all(lp <= 0 for lp in out.output_logprobs) and len(out.output_top_logprobs[0]) == 2
        assert out.output_versions == [srv.engine.weight_version] * len(out.output_ids)


def test_server_4xx_becomes_value_error_with_the_servers_message(srv):
    async def body(c):
        with pytest.raises(ValueError, match=r"input_ids\[1\].*outside the vocabulary"):
            await c.generate([1, 10**6], SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="model_path"):
            await c.update_weights_from_disk("/nonexistent.safetensors", 5)
        return await c.generate([1, 2], SamplingParams(max_new_tokens=2))  # still serving

    assert len(run_with_client(srv.url, body).output_ids) <= 2


def test_pause_update_continue_and_abort_through_the_client(srv, tmp_path):
    weights = save_weights_dir(srv.model, tmp_path / "w")
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    new_version = srv.engine.weight_version + 1

    async def body(c):
        await c.pause_generation()
        kept = asyncio.create_task(c.generate([5, 6, 7], params, "kept"))
        victim = asyncio.create_task(c.generate([5, 6, 8], params, "victim"))
        while (await c.metrics())["engine/in_flight"] < 2:
            await asyncio.sleep(0.01)
        await c.abort_request("victim")
        aborted = await victim
        update = await c.update_weights_from_disk(str(weights), new_version)
        await c.continue_generation()
        return aborted, update, await kept

    aborted, update, kept = run_with_client(srv.url, body)
    assert aborted.finish_reason == "abort" and aborted.output_ids == []
    assert update["success"] and update["weight_version"] == new_version
    assert kept.finish_reason == "length" and kept.output_versions == [new_version] * 60


def test_a_cancelled_call_aborts_its_request_on_the_server(srv):
    async def body(c):
        before = (await c.metrics())["engine/aborted_total"]
        await c.pause_generation()
        try:
            task = asyncio.create_task(c.generate([5, 6, 7], SamplingParams(max_new_tokens=8), "cancelled"))
            while (await c.metrics())["engine/in_flight"] < 1:
                await asyncio.sleep(0.01)
            task.cancel()
            deadline = time.monotonic() + 10
            while (m := await c.metrics())["engine/in_flight"] > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return before, m
        finally:
            await c.continue_generation()

    before, after = run_with_client(srv.url, body)
    assert after["engine/in_flight"] == 0 and after["engine/aborted_total"] == before + 1


def test_a_call_longer_than_the_timeout_raises_timeout_error(srv):
    async def body(c):
        await c.pause_generation()
        try:
            with pytest.raises(TimeoutError, match=srv.url):
                await c.generate([5, 6], SamplingParams(max_new_tokens=4))
        finally:
            await c.continue_generation()

    run_with_client(srv.url, body, timeout_s=0.5)


def test_streams_of_either_shape_give_the_same_output(srv):
    """SGLang streams the output so far in every chunk, or with --incremental-streaming-output only what is
    new (O(n) bytes instead of O(n^2)); the embedded server does either (`engine.incremental_streaming_output`)
    and the client reads both into the same outputs, log-probs, top log-probs and versions."""
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True, top_logprobs=2)
    prompt = srv.tok.encode("stream me")
    cfg = EngineConfig(kv_cache_mb=16, incremental_streaming_output=True)

    async def stream(url):
        chunks, last, sent = 0, None, 0
        client = HttpGenerationClient(url)
        try:
            async with client._http.stream("POST", "/generate", json={
                    "input_ids": prompt, "stream": True, "sampling_params": params.to_wire()}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data:") and "[DONE]" not in line:
                        chunks, sent = chunks + 1, sent + line.count(",")
            async for out, finished in client.generate_stream(prompt, params):
                last = out
            return last, sent, chunks, await client.generate(prompt, params)
        finally:
            await client.close()

    with BackgroundServer.for_model(srv.model, srv.tok, cfg, model_name="tiny") as url:
        deltas, delta_size, delta_chunks, whole = asyncio.run(stream(url))
    sofar, sofar_size, _, sofar_whole = asyncio.run(stream(srv.url))
    assert delta_chunks > 2 and delta_size < sofar_size / 2  # far fewer bytes for the same tokens
    assert sofar.output_ids == deltas.output_ids
    for out, whole in ((deltas, whole), (sofar, sofar_whole)):  # the servers may hold different versions
        assert out.output_ids == whole.output_ids and out.output_logprobs == whole.output_logprobs
        assert out.output_top_logprobs == whole.output_top_logprobs and out.output_versions == whole.output_versions
        assert out.finish_reason == "length"


def test_concurrent_streams_spread_over_the_connection_pools(srv):
    """httpcore walks every connection of a pool whenever a request starts or a response closes, so one pool
    holding every stream cost the rollout process most of its CPU (ShardedTransport's docstring). With 24
    streams in flight each of the 8 pools holds 3 connections, and every answer is whole."""
    from async_rl.engine.client import POOL_SHARDS

    async def body(c):
        params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)

        async def one(i):
            outs = [out async for out, _ in c.generate_stream(srv.tok.encode(f"{i}+1="), params)]
            return outs[-1]

        outs = await asyncio.gather(*(one(i) for i in range(3 * POOL_SHARDS)))
        per_pool = [len(pool._pool.connections) for pool in c._http._transport._pools]
        return outs, per_pool

    outs, per_pool = run_with_client(srv.url, body)
    assert all(len(o.output_ids) == 12 for o in outs)
    assert len(per_pool) == POOL_SHARDS and max(per_pool) <= 3, per_pool

"""What the client reads, held to SGLang 0.5.23's own response types (sglang/api/v1/api_types.py).

The request side is held to SGLang's models in test_sglang_requests.py; here the answers are:
every /generate answer of the embedded server (whole, and each chunk of a stream) decodes as
SGLang's `GenerateResponse` (its generated decoder raises JsonContractError on a violation), the
meta-info keys the client reads are SGLang's (or the embedded server's own extras, listed), and
SGLang's stream error chunk — HTTP 200, then `data: {"error": {...}}` (srt/entrypoints/http_server.py,
`serve_generate_request.stream_results`: a ValueError raised once the stream started, e.g. a prompt
plus max_new_tokens over the context) — is one per-request refusal in the client, not a KeyError
that stops the rollout side. Skipped where sglang is not installed.
"""

import asyncio
import json

import httpx
import pytest

import sglang_source
from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine.client import HttpGenerationClient
from async_rl.engine.sglang_api import META_KEYS_READ, generate_body
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.types import RequestRefused, SamplingParams
from async_rl.launch.serve import BackgroundServer

pytestmark = pytest.mark.skipif(sglang_source.source_dir() is None, reason=sglang_source.SKIP)
OURS = {"output_token_versions", "num_interruptions", "num_retractions"}  # the embedded server's extras


def api_types():
    return sglang_source.load("sglang.api.v1.api_types")


def test_every_answer_decodes_as_sglangs_generate_response_and_the_client_reads_sglangs_keys():
    types = api_types()
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
    params = SamplingParams(max_new_tokens=6, seed=1, top_logprobs=2)
    with BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=16), model_name="tiny") as url:
        whole = httpx.post(f"{url}/generate", json=generate_body(tok.encode("2+2="), params, "a"), timeout=60).json()
        with httpx.stream("POST", f"{url}/generate", timeout=60,
                          json=generate_body(tok.encode("2+2="), params, "b", stream=True)) as resp:
            chunks = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")
                      and line.strip() != "data: [DONE]"]
    assert len(chunks) >= 2
    for answer in [whole, *chunks]:
        types.GenerateResponse.from_json_value(answer)  # JsonContractError where SGLang's type would refuse it
    declared = set(types.GenerateMetaInfo.__struct_fields__)
    assert set(META_KEYS_READ) - OURS <= declared, set(META_KEYS_READ) - OURS - declared
    with pytest.raises(Exception, match="expected a sequence"):  # the decoder does refuse
        types.GenerateResponse.from_json_value({**whole, "output_ids": "1 2"})


def test_sglangs_stream_error_chunk_is_one_refused_request():
    types = api_types()
    chunk = {"error": {"message": "the input (200 tokens) plus max_new_tokens exceeds the context length",
                       "type": "invalid_request_error", "code": 400, "retryable": False}}
    types.GenerateStreamError.from_json_value(chunk)  # the shape is SGLang's

    async def serve(reader, writer):  # a real HTTP server answering as SGLang's stream_results does
        await reader.readuntil(b"\r\n\r\n")
        body = b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    async def go():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = HttpGenerationClient(f"http://127.0.0.1:{port}")
        try:
            with pytest.raises(RequestRefused, match="exceeds the context length"):
                async for _ in client.generate_stream([1, 2, 3], SamplingParams(max_new_tokens=4), "r1"):
                    pass
        finally:
            await client.close()
            server.close()

    asyncio.run(go())

"""The servers the SGLang contract tests drive, and helpers they share.

    def test_x(target): ...   # runs on `embedded` (always) and `sglang` (GPU, SGLang, ASYNC_RL_SGLANG_MODEL)

`target` is module-scoped: `embedded` serves a tiny model for real on a free port (its weights
saved as a weight-version directory, as a run publishes them); `sglang` starts a real SGLang
server (`async_rl.launch.sglang_server.start_sglang`) on ASYNC_RL_SGLANG_MODEL and is skipped, with the
reason, where that cannot run. `Target.version` tracks the weight version tests have loaded.
"""

import asyncio
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
from async_rl.engine.sglang_api import cumulative_chunk
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.types import SamplingParams
from async_rl.weight_sync.versions import version_dir
from async_rl.launch.serve import BackgroundServer
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

    from async_rl.launch.procs import stop_all
    from async_rl.launch.sglang_server import start_sglang

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
                        last = cumulative_chunk(last, json.loads(line[5:]))  # either streaming shape
                        if len(last["output_ids"]) >= tokens:
                            reached.set()
                reached.set()
                return last

    task = asyncio.create_task(consume())
    await asyncio.wait_for(reached.wait(), 60)
    return reached, task

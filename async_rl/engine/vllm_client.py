"""HTTP client of one vLLM server (`engine.backend=vllm`): the same `GenerationClient` as the others.

    client = VllmGenerationClient("http://127.0.0.1:8000")
    out = await client.generate(prompt_ids, SamplingParams(max_new_tokens=32))
    await client.pause_generation(); await client.update_weights_from_disk(path, 1)
    await client.continue_generation()

It speaks vLLM's token-in/token-out route and its RL routes (vLLM >= 0.32, server started with
`--enable-scale-out` and VLLM_SERVER_DEV_MODE=1 by `async_rl.launch.vllm_server`); `vllm_api` holds the
shapes. Everything else (abort-and-resubmit, piece joining, version labels from update times,
retries) is `HttpGenerationClient`'s. The pause modes map onto vLLM's
(entrypoints/rl/online/api_router.py, v1/engine/core.py `pause_scheduler`):

- `retract`: `/pause?mode=keep&clear_cache=true`: running requests are preempted (their KV freed)
  and, after `/resume`, recompute prompt + tokens so far under the weights loaded then; the
  stream goes on, and vLLM's per-token version spans say which weights sampled each token;
- `abort`: `/pause?mode=abort`: requests come back at once with their partial output
  (finish_reason abort) and this client re-submits them when generation continues;
- `in_place`: `/pause?mode=keep&clear_cache=false`: the KV is kept, requests continue over keys
  and values the old weights computed. So that no later request reuses a prefix cached under older
  weights, every request carries `cache_salt` = the version this client last loaded (prefix
  blocks are never shared across salts).

A weight update loads a version directory in place: `/collective_rpc` calls the worker extension
`reload_version` (`async_rl/engine/vllm_worker/async_rl_vllm_worker.py`: vLLM's
`reload_weights`, then the LM head re-packed where it is tied to the embeddings), then
`/update_weight_version` labels what follows, before `/resume`. /health answers while paused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx

from async_rl.engine import vllm_api
from async_rl.engine.client import HttpGenerationClient
from async_rl.engine.sglang_api import output_from_response
from async_rl.types import GenerationOutput, SamplingParams, new_id

RELOAD_METHOD = "reload_version"  # the worker extension's method (vllm_worker/async_rl_vllm_worker.py)
PAUSE_QUERIES = {"retract": "mode=keep&clear_cache=true", "abort": "mode=abort&clear_cache=true",
                 "in_place": "mode=keep&clear_cache=false"}


class VllmGenerationClient(HttpGenerationClient):
    """`GenerationClient` over a vLLM server's HTTP API (see the module docstring)."""

    def _body(self, input_ids: list[int], params: SamplingParams, rid: str, stream: bool) -> dict[str, Any]:
        body = vllm_api.generate_body(input_ids, params, rid, stream=stream)
        if (salt := self.cache_salt()) is not None:  # vLLM's cache_salt: the same namespacing as SGLang's
            body["cache_salt"] = salt
        return body

    async def _generate_answer(self, input_ids: list[int], params: SamplingParams, rid: str) -> dict[str, Any]:
        resp = await self._send("POST", vllm_api.GENERATE_PATH, self._body(input_ids, params, rid, stream=False))
        body = self._check(vllm_api.GENERATE_PATH, resp, per_request=True)
        return vllm_api.sglang_shaped(body, rid, top_logprobs=bool(params.top_logprobs))

    async def generate_stream(self, input_ids: list[int], sampling_params: SamplingParams,
                              request_id: str | None = None) -> AsyncIterator[tuple[GenerationOutput, bool]]:
        """`generate` streamed: (output so far, finished) after every chunk. vLLM sends the per-token version
        spans with the last chunk only; until then tokens carry the version this client last loaded."""
        rid = request_id or new_id()
        updates = self._updates
        acc: dict[str, Any] | None = None
        top = bool(sampling_params.top_logprobs)
        async for chunk in self._sse(vllm_api.GENERATE_PATH, self._body(input_ids, sampling_params, rid, True)):
            acc = vllm_api.merge_chunk(acc, chunk)
            finished = acc["choices"][0].get("finish_reason") is not None
            shaped = vllm_api.sglang_shaped(acc, rid, top_logprobs=top, finished=finished)
            if not finished:
                shaped["meta_info"]["finish_reason"] = "abort"
            yield output_from_response(rid, shaped, version=self.weight_version,
                                       interruptions=self._updates - updates), finished

    async def _pause_call(self, mode: str) -> None:
        await self._request("POST", f"/pause?{PAUSE_QUERIES[mode]}")

    async def _continue_call(self) -> None:
        await self._request("POST", "/resume")

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> dict[str, Any]:
        """Load the version in directory `model_path` into every worker, then label what follows with it."""
        body = await self._request("POST", "/collective_rpc",
                                   {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(model_path)},
                                    "timeout": self.timeout_s}, timeout_s=self.timeout_s + 10.0)
        await self.label(weight_version)
        self.weight_updated(weight_version)
        return {"success": True, "workers": len(body.get("results") or [])}

    async def label(self, weight_version: int) -> None:
        """Tag what the server samples from now on with `weight_version` (vLLM's label starts as "default")."""
        body = await self._request("POST", "/update_weight_version", {"new_version": str(int(weight_version))})
        if not body.get("success", False):
            raise RuntimeError(f"{self.address}/update_weight_version: {body}")

    async def abort_request(self, request_id: str) -> None:
        self._aborted.add(request_id)
        await self._request("POST", vllm_api.ABORT_PATH, {"request_ids": [vllm_api.ID_PREFIX + request_id]})

    async def health(self) -> bool:
        """vLLM's /health answers 200 while paused too (it fails only once the engine is dead)."""
        try:
            return (await self._http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def get_model_info(self) -> dict[str, Any]:
        """The served model's name (`--served-model-name`: model.name) and the weights' version label."""
        models = await self._request("GET", "/v1/models", timeout_s=30.0)
        data = (models.get("data") or [{}])[0] if isinstance(models, dict) else {}
        info = await self._request("GET", "/weight_info", timeout_s=30.0)
        return {"served_model_name": data.get("id"), "max_model_len": data.get("max_model_len"),
                "weight_version": info.get("weight_version")}

    async def tp_size(self) -> int:
        return 1

    async def init_weights_update_group(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise ValueError("weight_sync.transport=dist: not available with engine.backend=vllm (its weight-transfer "
                         "engines need CUDA on both ends); use weight_sync.transport=disk or zmq")

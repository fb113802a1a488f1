"""HTTP client of one generation server (the embedded engine or SGLang): `GenerationClient` over httpx.

    client = HttpGenerationClient("http://127.0.0.1:30000")
    await client.wait_ready(60)
    out = await client.generate(prompt_ids, SamplingParams(max_new_tokens=32))
    await client.close()

One client serves many concurrent sessions (a pooled `httpx.AsyncClient`). Failures
come back as: `ValueError` for a 4xx answer (carrying the server's message, which names
the field), `ServerUnreachableError` when the server cannot be reached, `TimeoutError`
when it does not answer in time, `RuntimeError` for a 5xx answer. Cancelling a call
closes its connection, which makes the embedded server abort the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from async_rl.types import GenerationOutput, SamplingParams, new_id


class ServerUnreachableError(ConnectionError):
    """The generation server at an address does not answer."""


def output_from_response(rid: str, body: dict[str, Any]) -> GenerationOutput:
    """A /generate answer (SGLang's shape, with our per-token versions when present) as GenerationOutput."""
    meta = body["meta_info"]
    ids = [int(t) for t in body["output_ids"]]
    lps = [float(e[0]) for e in meta.get("output_token_logprobs") or []]
    versions = meta.get("output_token_versions")
    if versions is None:  # a server without per-token versions: every token has its current version
        versions = [int(meta.get("weight_version") or 0)] * len(ids)
    top = meta.get("output_top_logprobs")
    reason = meta["finish_reason"]
    return GenerationOutput(
        request_id=str(meta.get("id", rid)), prompt_len=int(meta.get("prompt_tokens", 0)), output_ids=ids,
        output_logprobs=lps if len(lps) == len(ids) else [0.0] * len(ids),
        output_versions=[int(v) for v in versions],
        finish_reason=reason["type"] if isinstance(reason, dict) else str(reason),
        num_interruptions=int(meta.get("num_interruptions", 0)),
        output_top_logprobs=None if top is None else [[(int(e[1]), float(e[0])) for e in pos] for pos in top],
        prefix_cached_tokens=int(meta.get("cached_tokens", 0)),
    )


class HttpGenerationClient:
    """`GenerationClient` over HTTP. `timeout_s` bounds one call (a whole generation)."""

    def __init__(self, address: str, timeout_s: float = 600.0):
        if not address.startswith(("http://", "https://")):
            raise ValueError(f"generation server address must start with http:// or https://, got {address!r}")
        self.address = address.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.address, timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256), trust_env=False)

    # ------------------------------------------------------------------ plumbing
    async def _request(self, method: str, path: str, payload: dict[str, Any] | None = None,
                       timeout_s: float | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        try:
            if method == "GET":
                resp = await self._http.get(path, **kwargs)
            else:
                resp = await self._http.post(path, json=payload or {}, **kwargs)
        except httpx.TimeoutException:
            raise TimeoutError(f"generation server {self.address}{path}: no answer within "
                               f"{timeout_s or self.timeout_s:g}s") from None
        except httpx.TransportError as exc:
            raise ServerUnreachableError(f"generation server {self.address} unreachable "
                                         f"({type(exc).__name__}: {exc})") from None
        return self._check(path, resp)

    def _check(self, path: str, resp: httpx.Response) -> dict[str, Any]:
        if resp.status_code < 400:
            return resp.json()
        try:
            body = resp.json()
            message = body["error"]["message"] if "error" in body else body.get("message", body.get("detail"))
        except Exception:
            message = resp.text[:300]
        if resp.status_code < 500:
            raise ValueError(f"{self.address}{path}: {message}")
        raise RuntimeError(f"{self.address}{path}: HTTP {resp.status_code}: {message}")

    # ------------------------------------------------------------------ GenerationClient
    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerationOutput:
        rid = request_id or new_id()
        body = await self._request("POST", "/generate", {
            "input_ids": [int(t) for t in input_ids], "rid": rid, "return_logprob": True,
            "sampling_params": sampling_params.to_wire()})
        return output_from_response(rid, body)

    async def pause_generation(self) -> None:
        await self._request("POST", "/pause_generation")

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation")

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> dict[str, Any]:
        body = await self._request("POST", "/update_weights_from_disk",
                                   {"model_path": str(model_path), "weight_version": int(weight_version)})
        if not body.get("success", False):
            raise RuntimeError(f"{self.address}/update_weights_from_disk: {body.get('message', body)}")
        return body

    async def abort_request(self, request_id: str) -> None:
        await self._request("POST", "/abort_request", {"rid": request_id})

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def get_model_info(self) -> dict[str, Any]:
        return await self._request("GET", "/get_model_info", timeout_s=30.0)

    async def close(self) -> None:
        await self._http.aclose()

    # ------------------------------------------------------------------ extras
    async def generate_stream(self, input_ids: list[int], sampling_params: SamplingParams,
                              request_id: str | None = None) -> AsyncIterator[tuple[GenerationOutput, bool]]:
        """`generate` over SSE (`stream: true`): yields (output so far, finished) after every chunk, so the
        tokens sampled so far are known even if the server dies mid-request (then ServerUnreachableError).
        Chunks carry the whole output so far (SGLang's default streaming shape); an unfinished one is
        reported with finish_reason "abort" until the last chunk says how it ended."""
        rid = request_id or new_id()
        payload = {"input_ids": [int(t) for t in input_ids], "rid": rid, "return_logprob": True, "stream": True,
                   "sampling_params": sampling_params.to_wire()}
        try:
            async with self._http.stream("POST", "/generate", json=payload) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._check("/generate", resp)
                async for line in resp.aiter_lines():
                    data = line[len("data:"):].strip() if line.startswith("data:") else ""
                    if not data or data == "[DONE]":
                        continue
                    body = json.loads(data)
                    finished = body["meta_info"].get("finish_reason") is not None
                    if not finished:
                        body["meta_info"]["finish_reason"] = "abort"
                    yield output_from_response(rid, body), finished
        except httpx.TimeoutException:
            raise TimeoutError(f"generation server {self.address}/generate: no chunk within {self.timeout_s:g}s") from None
        except httpx.TransportError as exc:
            raise ServerUnreachableError(f"generation server {self.address} lost mid-stream "
                                         f"({type(exc).__name__}: {exc})") from None

    async def metrics(self) -> dict[str, float]:
        """The server's engine/* metrics (embedded engine only)."""
        return await self._request("GET", "/metrics", timeout_s=30.0)

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll /health until it answers 200; ServerUnreachableError naming the address after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        why = "no answer"
        while True:
            try:
                resp = await self._http.get("/health", timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                if resp.status_code == 200:
                    return
                why = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                why = type(exc).__name__
            if time.monotonic() >= deadline:
                raise ServerUnreachableError(
                    f"generation server {self.address} not reachable after {timeout_s:g}s ({why}); "
                    "is it running and is the address right?")
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ distributed weight updates (SGLang's routes)
    async def _weight_call(self, path: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        body = await self._request("POST", path, payload, timeout_s=timeout_s)
        if not body.get("success", False):
            raise RuntimeError(f"{self.address}{path}: {body.get('message', body)}")
        return body

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "gloo", *,
                                        timeout_s: float = 120.0) -> dict[str, Any]:
        """Join the trainer's weight-update group (returns once the whole group has formed)."""
        return await self._weight_call("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend, "timeout_s": timeout_s},
            timeout_s + 10.0)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: int, *, load_format: str | None = None,
                                              bucket_bytes: int | None = None,
                                              timeout_s: float = 120.0) -> dict[str, Any]:
        """Receive one version broadcast by the trainer over `group_name` and load it."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "weight_version": int(weight_version), "load_format": load_format,
                                   "flush_cache": True}
        if bucket_bytes is not None:
            payload["bucket_bytes"] = int(bucket_bytes)
        return await self._weight_call("/update_weights_from_distributed", payload, timeout_s + 10.0)

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name},
                                   timeout_s=30.0)

"""HTTP client of one generation server (the embedded engine or SGLang): `GenerationClient` over httpx.

    client = HttpGenerationClient("http://127.0.0.1:30000")
    await client.wait_ready(60)
    out = await client.generate(prompt_ids, SamplingParams(max_new_tokens=32))
    await client.pause_generation(); await client.update_weights_from_disk(path, 1)
    await client.continue_generation(); await client.close()

One client drives both servers with SGLang's native API (`sglang_api` holds the shapes).
A weight update is pause -> load -> continue; the pause mode is the client's `pause_mode`:
- `retract` (default): requests in flight keep their tokens and recompute their KV under the
  new weights; each answer is one piece, its tokens labelled with the version that sampled
  them (`output_token_versions` of the embedded server, `meta_info.weight_versions` spans of
  SGLang >= 0.5.19);
- `abort`: requests in flight come back at once with their partial output; this client then
  re-submits prompt + tokens so far (for the remaining max_new_tokens, with a fresh seed)
  once generation continues and joins the pieces; every piece is sampled by one version.
  This is what AReaL, slime and verl do, and it works with any SGLang that has
  /pause_generation. Penalties then see only the current piece's tokens as output;
- `in_place`: stepping stops, the KV is kept. SGLang refuses to flush the cache while those requests
  run and fails an update that asks for it, so updates under this pause send `flush_cache: false`;
  SGLang then continues them on KV computed with the old weights (the embedded engine recomputes it).
Where a server reports no per-token versions, the client labels tokens from the update
times it saw: every token of a request gets the version in use when it was submitted, so a
request that lived through an update is counted as old as it can be (sound for the
staleness bound, never younger than it is).

With `api_key` every request carries `Authorization: Bearer <api_key>` (the server's
`engine.api_key`; a refused one is a ValueError naming the Authorization header).

One client serves many concurrent sessions (a pooled `httpx.AsyncClient`). Failures
come back as: `ValueError` for a 4xx answer (carrying the server's message, which names
the field), `ServerUnreachableError` when the server cannot be reached, `TimeoutError`
when it does not answer in time, `RuntimeError` for a 5xx answer. Cancelling a call
closes its connection, which makes the embedded server abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from async_rl.engine.sglang_api import cumulative_chunk, generate_body, joined_output, output_from_response
from async_rl.types import GenerationOutput, RequestRefused, SamplingParams, new_id
from async_rl.utils.seeding import derive_seed

__all__ = ["PAUSE_MODES", "HttpGenerationClient", "RequestRefused", "ServerUnreachableError", "output_from_response"]

PAUSE_MODES = ("retract", "abort", "in_place")


class ServerUnreachableError(ConnectionError):
    """The generation server at an address does not answer."""


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message or body)


def _resumed(params: SamplingParams, done: int) -> SamplingParams:
    # a fresh seed per resume point: re-using the request's seed would replay the draws of its first tokens
    return dataclasses.replace(params, max_new_tokens=params.max_new_tokens - done,
                               min_new_tokens=max(0, params.min_new_tokens - done),
                               seed=None if params.seed is None else derive_seed(params.seed, "resume", done))


POOL_SHARDS = 8  # connection pools behind one client (ShardedTransport)


class ShardedTransport(httpx.AsyncBaseTransport):
    """Requests dealt round-robin over `shards` httpx connection pools (each unbounded, keeping up to 256
    idle connections alive). httpcore's pool walks all its connections, asking each whether it is idle or
    expired (a getpeername apiece), whenever a request starts or a response closes; with a hundred
    streams in flight on one pool that walk took ~45% of the rollout process's CPU (py-spy, 128 streams,
    2026-11-27), on the cores the generation server needs. Eight pools walk an eighth as many each."""

    def __init__(self, shards: int):
        if shards < 1:
            raise ValueError(f"shards: must be >= 1, got {shards}")
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._pools = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(shards)]
        self._next = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pool = self._pools[self._next]
        self._next = (self._next + 1) % len(self._pools)
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()


class HttpGenerationClient:
    """`GenerationClient` over HTTP. `timeout_s` bounds one call (a whole generation); `pause_mode`
    is how `pause_generation` stops the server (see the module docstring); `api_key` is its bearer token;
    `stream_interval` how many tokens `generate_stream` lets the server gather per chunk."""

    def __init__(self, address: str, timeout_s: float = 600.0, pause_mode: str = "retract", api_key: str = "",
                 stream_interval: int = 1):
        if not address.startswith(("http://", "https://")):
            raise ValueError(f"generation server address must start with http:// or https://, got {address!r}")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode: must be one of {'|'.join(PAUSE_MODES)}, got {pause_mode!r}")
        self.address = address.rstrip("/")
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval: must be a positive number of tokens, got {stream_interval!r}")
        self.stream_interval = stream_interval  # tokens per streamed chunk (SGLang's sampling_params.stream_interval)
        self.weight_version: int | None = None  # last version loaded through this client (None: the server's)
        self.retractions_total = 0  # meta_info.num_retractions summed over answers
        self._updates = 0  # weight updates done through this client
        self._abort_pauses = 0  # pauses in mode abort done through this client
        self.paused: str | None = None  # the mode of this client's pause in effect (None: not paused by it)
        self._aborted: set[str] = set()  # request ids aborted on purpose: never re-submitted
        self._running = asyncio.Event()  # cleared while this client holds the server paused
        self._running.set()
        self._http = httpx.AsyncClient(
            base_url=self.address, timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            transport=ShardedTransport(POOL_SHARDS), trust_env=False,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None)

    # ------------------------------------------------------------------ plumbing
    async def _request(self, method: str, path: str, payload: dict[str, Any] | None = None,
                       timeout_s: float | None = None) -> Any:
        return self._check(path, await self._send(method, path, payload, timeout_s))

    async def _send(self, method: str, path: str, payload: dict[str, Any] | None = None,
                    timeout_s: float | None = None) -> httpx.Response:
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
        return resp

    def _check(self, path: str, resp: httpx.Response, per_request: bool = False) -> Any:
        """The JSON of a successful answer; else ValueError (4xx: RequestRefused where `per_request` and the
        request itself was refused, 400/413/422) or RuntimeError (5xx) carrying the server's message."""
        if resp.status_code < 400:
            return resp.json() if resp.content else {}
        try:
            body = resp.json()
            error = body.get("error") if isinstance(body, dict) else None
            message = error.get("message", error) if isinstance(error, dict) else error
            message = message or body.get("message") or body.get("detail") or body
        except Exception:
            message = resp.text[:300]
        if per_request and resp.status_code in (400, 413, 422):
            raise RequestRefused(f"{self.address}{path}: request refused: {message}")
        if resp.status_code < 500:
            raise ValueError(f"{self.address}{path}: {message}")
        raise RuntimeError(f"{self.address}{path}: HTTP {resp.status_code}: {message}")

    # ------------------------------------------------------------------ GenerationClient
    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerationOutput:
        """One sample of `input_ids` (sampling_params.n must be 1: a group is n calls)."""
        if sampling_params.n != 1:
            raise ValueError(f"sampling_params.n: generate returns one sample, got n={sampling_params.n}")
        rid = request_id or new_id()
        updates_at_start = self._updates
        pieces: list[GenerationOutput] = []
        while True:
            done = [t for p in pieces for t in p.output_ids]
            params = _resumed(sampling_params, len(done)) if pieces else sampling_params
            version, updates, pauses = self.weight_version, self._updates, self._abort_pauses
            body = await self._generate_answer(list(input_ids) + done, params, rid)
            out = output_from_response(rid, body, version=version, interruptions=self._updates - updates)
            self.retractions_total += int(body["meta_info"].get("num_retractions") or 0)
            pieces.append(out)
            if not self._paused_us(out, pauses) or len(done) + len(out.output_ids) >= sampling_params.max_new_tokens:
                break
            await self._running.wait()
        self._aborted.discard(rid)
        if len(pieces) == 1:
            return pieces[0]
        return dataclasses.replace(joined_output(rid, len(input_ids), pieces),
                                   num_interruptions=self._updates - updates_at_start)

    async def _generate_answer(self, input_ids: list[int], params: SamplingParams, rid: str) -> dict[str, Any]:
        """One /generate answer in SGLang's native shape (a backend with another wire format translates)."""
        body = generate_body(input_ids, params, rid, cache_salt=self.cache_salt())
        return self._check("/generate", await self._send("POST", "/generate", body), per_request=True)

    def cache_salt(self) -> str | None:
        """Under pause mode in_place, the namespace of this request's prefix-cache entries: the version this client
        last loaded. In-flight requests keep KV the old weights computed across an in_place update (that is the
        mode); a request that starts later must not reuse a prefix cached under older weights, and SGLang keeps its
        radix cache across the update (it cannot flush while the paused requests hold KV). Other modes flush."""
        return f"v{self.weight_version or 0}" if self.pause_mode == "in_place" else None

    async def _pause_call(self, mode: str) -> None:
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def _continue_call(self) -> None:
        await self._request("POST", "/continue_generation")

    def _paused_us(self, out: GenerationOutput, pauses_at_submit: int) -> bool:
        """Was this answer cut short by a pause in mode abort of this client (so it is to be continued)?"""
        return (out.finish_reason == "abort" and out.request_id not in self._aborted
                and (self._abort_pauses != pauses_at_submit or self.paused == "abort"))

    async def pause_generation(self, mode: str | None = None) -> None:
        """Pause the server in `mode` (default: this client's `pause_mode`)."""
        mode = mode or self.pause_mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode: must be one of {'|'.join(PAUSE_MODES)}, got {mode!r}")
        self._running.clear()
        self.paused = mode
        if mode == "abort":
            self._abort_pauses += 1
        await self._pause_call(mode)

    async def continue_generation(self) -> None:
        try:
            await self._continue_call()
        finally:
            self.paused = None
            self._running.set()

    @property
    def flush_cache(self) -> bool:
        """Whether an update may flush the cache: not while this client holds the server paused in mode
        in_place, whose requests keep their KV (SGLang refuses the flush then and fails the update)."""
        return self.paused != "in_place"

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> dict[str, Any]:
        """Load the version in directory `model_path` (SGLang loads every *.safetensors of a directory)."""
        body = await self._request("POST", "/update_weights_from_disk",
                                   {"model_path": str(model_path), "weight_version": str(int(weight_version)),
                                    "flush_cache": self.flush_cache})
        if not body.get("success", False):
            raise RuntimeError(f"{self.address}/update_weights_from_disk: {body.get('message', body)}")
        self.weight_updated(weight_version)
        return body

    def weight_updated(self, weight_version: int) -> None:
        """Record that the server now samples with `weight_version` (call after any weight update made
        on it): answers without per-token versions are labelled from these times."""
        self.weight_version = int(weight_version)
        self._updates += 1

    async def abort_request(self, request_id: str) -> None:
        self._aborted.add(request_id)
        await self._request("POST", "/abort_request", {"rid": request_id})

    async def health(self) -> bool:
        """Whether the server answers. SGLang's /health runs a one-token generation, which gets no answer while
        generation is paused (http_server.health_generate), so while this client holds the server paused it
        asks /model_info, which answers then; a weight update's own deadline judges a paused server."""
        try:
            return (await self._http.get("/model_info" if self.paused else "/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def get_model_info(self) -> dict[str, Any]:
        return await self._request("GET", "/model_info", timeout_s=30.0)  # /get_model_info is deprecated

    async def close(self) -> None:
        await self._http.aclose()

    # ------------------------------------------------------------------ extras
    async def generate_stream(self, input_ids: list[int], sampling_params: SamplingParams,
                              request_id: str | None = None) -> AsyncIterator[tuple[GenerationOutput, bool]]:
        """`generate` over SSE (`stream: true`): yields (output so far, finished) after every chunk, so the
        tokens sampled so far are known even if the server dies mid-request (then ServerUnreachableError).
        Chunks carry the whole output so far (SGLang's default) or only what is new (a server started with
        --incremental-streaming-output, `engine.incremental_streaming_output`): both are read
        (`sglang_api.cumulative_chunk`). An unfinished output is reported with finish_reason "abort" until
        the last chunk says how it ended."""
        rid = request_id or new_id()
        updates = self._updates  # weight updates through this client while the request runs: its interruptions
        body: dict[str, Any] | None = None
        async for chunk in self._sse("/generate", generate_body(input_ids, sampling_params, rid, stream=True,
                                                                stream_interval=self.stream_interval,
                                                                cache_salt=self.cache_salt())):
            if chunk.get("error") is not None:  # SGLang streams a refused request as HTTP 200 + this chunk
                raise RequestRefused(f"{self.address}/generate: request {rid} refused: {_message(chunk)}")
            body = cumulative_chunk(body, chunk)
            finished = body["meta_info"].get("finish_reason") is not None
            if not finished:
                body["meta_info"]["finish_reason"] = "abort"
            yield output_from_response(rid, body, version=self.weight_version,
                                       interruptions=self._updates - updates), finished

    async def _sse(self, path: str, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The JSON payloads of a server-sent-event answer to POST `path` ("[DONE]" left out); a 4xx/5xx
        answer raises as `_check` does, a lost connection ServerUnreachableError, silence TimeoutError."""
        try:
            async with self._http.stream("POST", path, json=payload) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._check(path, resp, per_request=True)
                async for line in resp.aiter_lines():
                    data = line[len("data:"):].strip() if line.startswith("data:") else ""
                    if data and data != "[DONE]":
                        yield json.loads(data)
        except httpx.TimeoutException:
            raise TimeoutError(f"generation server {self.address}{path}: no chunk within {self.timeout_s:g}s") from None
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
        return self._succeeded(path, await self._request("POST", path, payload, timeout_s=timeout_s))

    def _succeeded(self, path: str, body: Any) -> dict[str, Any]:
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

    async def begin_weight_update(self) -> dict[str, Any]:
        """Open SGLang's weight-update session (0.5.23 refuses distributed updates outside one; a server
        without the route, as SGLang before it, needs none). A session left open (a client that died
        between begin and end) is closed first: this side drives the server."""
        try:
            return await self._session_call("/begin_weight_update")
        except ValueError as exc:
            if "already open" not in str(exc):
                raise
            await self.end_weight_update()
            return await self._session_call("/begin_weight_update")

    async def end_weight_update(self) -> dict[str, Any]:
        return await self._session_call("/end_weight_update")

    async def _session_call(self, path: str) -> dict[str, Any]:
        resp = await self._send("POST", path, {}, 30.0)
        if resp.status_code == 404:
            return {"success": True, "message": f"{path}: no such route here (no session to open)"}
        return self._succeeded(path, self._check(path, resp))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: int | None, *,
                                              load_format: str | None = None, flush_cache: bool = True,
                                              timeout_s: float = 120.0) -> dict[str, Any]:
        """Receive the tensors named (one bucket, or a whole version) broadcast by the trainer over
        `group_name` and load them, inside a session the caller holds (`begin_weight_update` ...
        `end_weight_update`); `weight_version` (sent as a string) marks the version complete. The cache
        is flushed only where asked and allowed (never under an in_place pause: SGLang fails the update)."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "weight_version": None if weight_version is None else str(int(weight_version)),
                                   "load_format": load_format, "flush_cache": flush_cache and self.flush_cache}
        body = await self._weight_call("/update_weights_from_distributed", payload, timeout_s + 10.0)
        if weight_version is not None:
            self.weight_updated(weight_version)
        return body

    async def tp_size(self) -> int:
        """The server's tensor-parallel ranks (SGLang's `/server_info` tp_size; 1 where it has none)."""
        info = await self._request("GET", "/server_info", timeout_s=30.0)
        return int(info.get("tp_size") or 1) if isinstance(info, dict) else 1

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name},
                                   timeout_s=30.0)

"""A `GenerationClient` over a `ServerPool` whose requests survive the loss of their server.

    client = PooledGenerationClient(pool, sticky=True)   # what an agent loop talks to
    out = await client.generate(prompt_ids, SamplingParams(max_new_tokens=64))

Each request runs on the least-loaded server in rotation, streamed, so the tokens sampled
so far are always known here. When its server leaves rotation (killed, unhealthy, fenced
for missing a weight update's deadline) or the server aborts the request without being
asked to, the request is re-issued to another server from where it stopped: the prompt
plus the tokens so far, with `max_new_tokens` reduced by their number. The outputs are
concatenated, so every token keeps the log-prob and policy version it was sampled with;
the continuation carries the versions of the server that finished it. `num_interruptions`
adds up over the pieces.

`sticky=True` makes the client one *session* (build one client per episode): its first
request goes to the least-loaded server and every later one to that same server, whose
prefix cache holds the conversation so far. The session moves, and the next request is sent
whole to rebuild the prefix elsewhere, only when its server leaves rotation or has more than
`overload_margin` requests in flight beyond the least-loaded one (None: never for load);
see `server_pool.py`. With `sticky=False` every request goes to the least-loaded server.

Limits: a stop string that straddles the place where a request moved is not seen; a
request that loses its server after its last token but before the server's final chunk
ends with finish_reason "length" (the stop token, if it was one, is in the output).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import weakref
from typing import Any

# the client's own rule for continuing a request (fresh seed, remaining lengths), so both resume alike
from async_rl.engine.client import ServerUnreachableError, _resumed
from async_rl.engine.sglang_api import joined_output, piece_rid
from async_rl.rollout.server_pool import Server, ServerPool, Session
from async_rl.types import GenerationOutput, SamplingParams, new_id

logger = logging.getLogger(__name__)

_LOST = (ServerUnreachableError, TimeoutError, ConnectionError, RuntimeError)  # 5xx answers are RuntimeError


class _Piece:
    """What one server produced for one request (updated as chunks arrive)."""

    def __init__(self) -> None:
        self.out: GenerationOutput | None = None
        self.finished = False


class PooledGenerationClient:
    """`GenerationClient` that places each request on the pool and moves it when its server is lost."""

    def __init__(self, pool: ServerPool, *, sticky: bool = False, acquire_timeout_s: float = 60.0,
                 max_moves: int = 8, overload_margin: int | None = None):
        if overload_margin is not None and overload_margin < 0:
            raise ValueError(f"rollout.sticky_overload_margin: must be >= 0, got {overload_margin}")
        self.pool = pool
        self.sticky = sticky
        self.acquire_timeout_s = acquire_timeout_s
        self.max_moves = max_moves
        self.overload_margin = overload_margin
        self.address = "pool(" + ",".join(s.address for s in pool.servers) + ")"
        self.session = Session() if sticky else None
        if self.session is not None:  # an episode dropped without close() still frees its place
            weakref.finalize(self, pool.end_session, self.session)
        self._running: dict[str, tuple[Server, str, int, _Piece]] = {}  # rid -> (server, piece id, carried, piece)
        self._aborted: set[str] = set()
        self._aborts: set[asyncio.Future] = set()  # fire-and-forget aborts still on their way

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerationOutput:
        rid = request_id or new_id()
        prompt = [int(t) for t in input_ids]
        pieces: list[GenerationOutput] = []
        try:
            for move in range(self.max_moves + 1):
                done = sum(len(p.output_ids) for p in pieces)
                if done >= sampling_params.max_new_tokens:
                    return _joined(rid, len(prompt), pieces, "length")
                params = sampling_params if not move else _resumed(sampling_params, done)
                server = await self.pool.acquire(timeout_s=self.acquire_timeout_s, session=self.session,
                                                 overload_margin=self.overload_margin)
                piece_id = piece_rid(rid, move)
                piece = _Piece()
                self._running[rid] = (server, piece_id, done, piece)
                try:
                    why = await self._run_on(server, prompt + _ids(pieces), params, rid, piece_id, piece)
                finally:
                    self.pool.release(server)
                if piece.out is not None:
                    pieces.append(piece.out)
                if why is None:
                    return _joined(rid, len(prompt), pieces, piece.out.finish_reason)
                carried = sum(len(p.output_ids) for p in pieces)
                self.pool.counts["pool/reissued"] += 1
                self.pool.counts["pool/reissued_tokens"] += carried
                logger.info("request %s moves from %s after %d tokens: %s", rid, server.address, carried, why)
            logger.warning("request %s lost its server %d times; ending it as aborted", rid, self.max_moves + 1)
            return _joined(rid, len(prompt), pieces, "abort")
        finally:
            self._running.pop(rid, None)
            self._aborted.discard(rid)

    async def _run_on(self, server: Server, ids: list[int], params: SamplingParams, rid: str, piece_id: str,
                      piece: _Piece) -> str | None:
        """Run one piece on `server`; returns why the request must move (None when it ended for good)."""
        work = asyncio.ensure_future(self._consume(server, ids, params, piece_id, piece))
        gone = asyncio.ensure_future(server.gone.wait())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                self._abort_later(server, piece_id)
                await asyncio.gather(work, return_exceptions=True)
        if not work.cancelled() and work.exception() is None and piece.finished:
            if piece.out.finish_reason == "abort" and rid not in self._aborted:
                return f"the server aborted it ({server.address})"
            return None
        if work.cancelled() or not work.done():
            return server.reason or "its server left rotation"
        exc = work.exception()
        if exc is None:  # the stream ended without its final chunk
            exc = ServerUnreachableError(f"generation server {server.address} ended the stream early")
        if isinstance(exc, _LOST):
            self.pool.mark_unhealthy(server, f"request failed: {exc}")
            return str(exc)
        raise exc  # bad input (ValueError naming the field) and bugs are not a reason to move

    def _abort_later(self, server: Server, piece_id: str) -> None:
        """Tell a server we stopped listening (best effort): it then frees the request instead of finishing it."""
        async def abort() -> None:
            try:
                await asyncio.wait_for(server.client.abort_request(piece_id), 5.0)
            except Exception as exc:  # the server may be dead or frozen: that is why we left it
                logger.debug("abort of %s on %s failed: %s", piece_id, server.address, exc)

        task = asyncio.ensure_future(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _consume(self, server: Server, ids: list[int], params: SamplingParams, piece_id: str,
                       piece: _Piece) -> None:
        stream = getattr(server.client, "generate_stream", None)
        if stream is None:  # a client without streaming: only a finished (or aborted) answer tells the tokens
            piece.out, piece.finished = await server.client.generate(ids, params, piece_id), True
            return
        async for out, finished in stream(ids, params, piece_id):
            piece.out, piece.finished = out, finished

    def running(self) -> dict[str, tuple[Server, int]]:
        """Requests in flight: request id -> (the server it runs on, tokens it has so far)."""
        return {rid: (srv, carried + (len(p.out.output_ids) if p.out is not None else 0))
                for rid, (srv, _, carried, p) in self._running.items()}

    # ------------------------------------------------------------------ the rest of GenerationClient
    async def abort_request(self, request_id: str) -> None:
        self._aborted.add(request_id)
        where = self._running.get(request_id)
        if where is not None:
            await where[0].client.abort_request(where[1])

    async def pause_generation(self) -> None:
        await asyncio.gather(*(s.client.pause_generation() for s in self.pool.servers if s.in_rotation))

    async def continue_generation(self) -> None:
        await asyncio.gather(*(s.client.continue_generation() for s in self.pool.servers if s.in_rotation))

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> dict[str, Any]:
        results = await asyncio.gather(*(s.client.update_weights_from_disk(model_path, weight_version)
                                         for s in self.pool.servers if s.in_rotation))
        return {"success": True, "servers": len(results)}

    async def health(self) -> bool:
        return any(s.in_rotation for s in self.pool.servers)

    async def get_model_info(self) -> dict[str, Any]:
        server = await self.pool.acquire(timeout_s=self.acquire_timeout_s)
        try:
            return await server.client.get_model_info()
        finally:
            self.pool.release(server)

    async def close(self) -> None:
        """Ends the session (the pool owns the servers' clients: they stay open)."""
        if self.session is not None:
            self.pool.end_session(self.session)


def _ids(pieces: list[GenerationOutput]) -> list[int]:
    return [t for p in pieces for t in p.output_ids]


def _joined(rid: str, prompt_len: int, pieces: list[GenerationOutput], finish_reason: str) -> GenerationOutput:
    """One output from the pieces of a request that moved: tokens, log-probs and versions in order."""
    if not pieces:
        return GenerationOutput(request_id=rid, prompt_len=prompt_len, output_ids=[], output_logprobs=[],
                                output_versions=[], finish_reason=finish_reason)
    return dataclasses.replace(joined_output(rid, prompt_len, pieces), finish_reason=finish_reason)

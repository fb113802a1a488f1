"""Where an engine step's output goes: per-request records on the loop thread (`Stream`) and the
caller's async iterator over its deltas (`RequestHandle`), with the helpers that cross from the
loop thread to a caller's event loop. `AsyncEngine` (async_engine.py) owns and feeds them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from async_rl.engine.llm_engine import StepOutput
from async_rl.types import GenerationOutput


class Stream:
    """Loop-thread record of one request: where its deltas go and what it has produced so far."""

    __slots__ = ("loop", "queue", "prompt_len", "output_ids", "logprobs", "versions", "top", "updates_at_start")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, prompt_len: int, top: bool,
                 updates: int):
        self.loop, self.queue, self.prompt_len = loop, q, prompt_len
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.top: list[list[tuple[int, float]]] | None = [] if top else None
        self.updates_at_start = updates

    def record(self, out: StepOutput, version: int) -> None:
        self.output_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.versions += [version] * len(out.new_token_ids)
        if self.top is not None and out.new_top_logprobs is not None:
            self.top += out.new_top_logprobs

    def aborted(self, request_id: str, updates_now: int) -> GenerationOutput:
        return GenerationOutput(
            request_id=request_id, prompt_len=self.prompt_len, output_ids=list(self.output_ids),
            output_logprobs=list(self.logprobs), output_versions=list(self.versions), finish_reason="abort",
            num_interruptions=updates_now - self.updates_at_start,
            output_top_logprobs=None if self.top is None else list(self.top))


class RequestHandle:
    """One submitted request. Async-iterate it for `StepOutput` deltas (the last has `finished`
    and `output`); `output_ids`/`logprobs`/`versions`/`top` accumulate as deltas are consumed.
    `aclose()` aborts the request if it has not finished."""

    def __init__(self, abort: Callable[[], None], request_id: str, prompt_len: int):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # policy version that sampled each token
        self.top: list[list[tuple[int, float]]] | None = None  # top log-probs per token, when asked for
        self.output: GenerationOutput | None = None
        self._abort = abort  # asks the engine's loop thread to abort this request
        self._queue: asyncio.Queue[tuple[StepOutput, int]] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return self.output is not None

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> StepOutput:
        if self.output is not None:
            raise StopAsyncIteration
        out, version = await self._queue.get()
        self.output_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.versions += [version] * len(out.new_token_ids)
        if out.new_top_logprobs is not None:
            self.top = (self.top or []) + out.new_top_logprobs
        if out.finished:
            self.output = out.output
        return out

    async def wait(self) -> GenerationOutput:
        """Consume the remaining deltas and return the finished output."""
        async for _ in self:
            pass
        assert self.output is not None
        return self.output

    async def aclose(self) -> None:
        if self.output is None:
            self._abort()


def post_to(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that caller's event loop is closed: nobody is waiting any more
        pass


def put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

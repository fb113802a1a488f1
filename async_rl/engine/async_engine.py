"""The asyncio face of the engine: one background thread runs the `LLMEngine` step loop.

    engine = AsyncEngine(LLMEngine(model, EngineConfig(), tokenizer=tok, eos_token_ids=[2])).start()
    out = await engine.generate("r0", prompt_ids, SamplingParams(max_new_tokens=16))
    async for delta in engine.generate_stream("r1", prompt_ids, params): ...
    await engine.pause(); await engine.update_weights_from_disk("w.safetensors", 1); await engine.resume()

Every call into `LLMEngine` happens on the loop thread. asyncio callers post commands
(closures) to it and await futures; commands run between steps, so `pause()` returns
once the loop has stopped at a step boundary (requests in flight stay in flight), and a
weight update lands at a step boundary whether or not generation is paused. An idle or
paused loop sleeps on an event; it never spins.

An abort finishes the request at once from what the caller has already received (the
engine's own abort report, which comes with its next step, is then dropped), so aborts
also answer while generation is paused.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from async_rl.engine.llm_engine import LLMEngine, StepOutput
from async_rl.engine.streams import RequestHandle, Stream, post_to, put_all, set_exception, set_result
from async_rl.types import GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine loop is not running (never started, shut down, or crashed)."""


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state_dict from one .safetensors file, or from every .safetensors file in a directory."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model_path: no .safetensors file in directory {str(p)!r}")
    elif p.is_file():
        files = [p]
    else:
        raise FileNotFoundError(f"model_path: {str(p)!r} does not exist")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


class AsyncEngine:
    def __init__(self, engine: LLMEngine, cores: Any = None):
        self.engine = engine
        self.cores = cores  # a utils.cores.CoreShare when this process shares its machine's cores
        self._idle_s = 0.0  # seconds the loop waited with nothing to step
        self.weight_version = engine.policy_version
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # (fn, future | None, loop | None)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._paused = False
        self._keep_kv = False  # paused in SGLang's mode in_place: an update now keeps the KV in flight
        self._partial: set[str] | None = None  # names loaded of a version that arrives in parts (loop thread)
        self._held = False  # the loop was paused for that version and resumes once it is complete
        self._streams: dict[str, Stream] = {}  # loop thread only
        self._stale_aborts: Counter[str] = Counter()  # early-finished aborts whose engine report is still due
        self._counts = Counter({"requests": 0, "finished": 0, "aborted": 0, "steps": 0, "weight_updates": 0,
                                "step_errors": 0})
        self._snapshot: dict[str, float] = {}
        self._deliveries: list[tuple[asyncio.AbstractEventLoop, tuple]] = []  # a step's deltas, sent at its end
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests still in flight finish with finish_reason "abort"."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def paused_by_request(self) -> bool:
        """Paused by /pause_generation (not only held for a version arriving in parts)."""
        return self._paused and not self._held

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def max_new_tokens_limit(self) -> int:
        return self.engine.config.max_new_tokens_limit

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands()
                if self._stop.is_set():
                    break
                if self._paused or not self.engine.has_unfinished():
                    self._refresh_stats()
                    if self.cores is not None:
                        self.cores.idle()  # lend our cores while there is nothing to decode
                    t0 = time.perf_counter()
                    self._wake.wait(1.0)
                    self._idle_s += time.perf_counter() - t0
                    self._wake.clear()  # commands posted after this set it again
                    continue
                if self.cores is not None:
                    self.cores.busy()  # take our share, plus the cores of processes that wait
                self._step()
        except BaseException:
            logger.exception("engine loop crashed")
            raise
        finally:
            self._stop.set()
            for rid in list(self._streams):
                self._abort(rid)
            self._run_commands(fail=EngineStoppedError("the engine is shut down"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # one bad step must not kill the server: fail the requests in flight
            logger.exception("engine step failed; aborting %d requests in flight", len(self._streams))
            self._counts["step_errors"] += 1
            for rid in list(self._streams):
                self._abort(rid)
            return
        self._counts["steps"] += 1
        version = self.engine.policy_version
        for out in outputs:
            self._deliver(out, version)
        self._send_deliveries()
        self._refresh_stats()

    def _send_deliveries(self) -> None:
        """One wake-up per caller loop per step for all its streams' deltas (not one per stream: with a
        hundred streams that was a hundred cross-thread wake-ups of the server's event loop a step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, item in self._deliveries:
            by_loop.setdefault(loop, []).append(item)
        self._deliveries.clear()
        for loop, items in by_loop.items():
            post_to(loop, put_all, items)

    def _run_commands(self, fail: BaseException | None = None) -> None:
        while True:
            try:
                fn, fut, loop = self._commands.get_nowait()
            except queue.Empty:
                return
            if fail is not None:
                if fut is not None:
                    post_to(loop, set_exception, fut, fail)
                continue
            try:
                result = fn()
            except Exception as exc:
                if fut is None:
                    logger.exception("engine command failed")
                else:
                    post_to(loop, set_exception, fut, exc)
            else:
                if fut is not None:
                    post_to(loop, set_result, fut, result)

    def _deliver(self, out: StepOutput, version: int) -> None:
        rid = out.request_id
        if out.finished and self._stale_aborts[rid] and out.output.finish_reason == "abort":
            self._stale_aborts[rid] -= 1  # already finished for the caller by _abort
            if not self._stale_aborts[rid]:
                del self._stale_aborts[rid]
            return
        stream = self._streams.get(rid)
        if stream is None:
            return
        stream.record(out, version)
        if out.finished:
            del self._streams[rid]
            self._counts["aborted" if out.output.finish_reason == "abort" else "finished"] += 1
        self._deliveries.append((stream.loop, (stream.queue, (out, version))))

    def _abort(self, request_id: str) -> bool:
        """Loop thread: abort in the engine and finish the caller's stream now."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        if self.engine.abort_request(request_id):
            self._stale_aborts[request_id] += 1
        self._counts["aborted"] += 1
        output = stream.aborted(request_id, self._counts["weight_updates"])
        final = StepOutput(request_id, [], [], None, True, output)
        post_to(stream.loop, stream.queue.put_nowait, (final, self.weight_version))
        return True

    def _refresh_stats(self) -> None:
        self._snapshot = self.engine.stats()

    # ------------------------------------------------------------------ posting commands
    def _post(self, fn: Callable[[], Any], fut: asyncio.Future | None = None,
              loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._commands.put((fn, fut, loop))
        self._wake.set()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.alive:
            raise EngineStoppedError("the engine loop is not running (not started, shut down, or crashed)")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post(fn, fut, loop)
        return await fut

    # ------------------------------------------------------------------ requests
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Add a request; raises EngineInputError (naming the field) if the engine refuses it.
        Accepted while paused: the request then waits for `resume()`."""
        loop = asyncio.get_running_loop()
        prompt = list(prompt_ids)
        handle = RequestHandle(lambda: self._post(lambda: self._abort(request_id)), request_id, len(prompt))

        def add() -> None:
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = Stream(loop, handle._queue, len(prompt), params.top_logprobs > 0,
                                                self._counts["weight_updates"])
            self._counts["requests"] += 1

        try:
            await self._call(add)
        except asyncio.CancelledError:  # the add may still run: make sure nobody waits on it
            self._post(lambda: self._abort(request_id))
            raise
        return handle

    async def generate_stream(self, request_id: str, prompt_ids: list[int],
                              params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Deltas of one request as they are sampled; the last one has `finished` and `output`.
        Leaving the iteration early aborts the request."""
        handle = await self.submit(request_id, prompt_ids, params)
        try:
            async for out in handle:
                yield out
        finally:
            await handle.aclose()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        handle = await self.submit(request_id, prompt_ids, params)
        try:
            return await handle.wait()
        finally:
            await handle.aclose()

    async def abort(self, request_id: str) -> bool:
        """Finish a request with finish_reason "abort"; False if it is not in flight."""
        return await self._call(lambda: self._abort(request_id))

    async def abort_prefix(self, prefix: str) -> int:
        """Abort every request whose id starts with `prefix`, as SGLang's /abort_request matches; how many."""
        return await self._call(lambda: sum(self._abort(rid) for rid in list(self._streams) if rid.startswith(prefix)))

    async def abort_all(self) -> int:
        return await self._call(lambda: sum(self._abort(rid) for rid in list(self._streams)))

    # ------------------------------------------------------------------ control
    async def pause(self, keep_kv: bool = False) -> None:
        """Return once the loop has stopped at a step boundary; requests in flight stay in flight. With
        `keep_kv` (SGLang's pause mode in_place) a weight update made before `resume` leaves the requests
        that hold KV going on over it, instead of recomputing it under the new weights."""
        def stop() -> None:
            self._paused, self._keep_kv = True, keep_kv

        await self._call(stop)

    async def resume(self) -> None:
        def go() -> None:
            self._paused, self._keep_kv = False, False

        await self._call(go)

    async def retract_all(self) -> list[str]:
        """Free the KV of every started request; it is recomputed when stepping resumes (SGLang's `retract`)."""
        return await self._call(self.engine.retract_all)

    async def running(self) -> int:
        """Requests that hold KV now (0 after a pause in mode retract or abort; any after in_place)."""
        return await self._call(lambda: len(self.engine.scheduler.running))

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False (nothing done) while running requests hold KV."""
        return await self._call(self.engine.flush_cache)

    async def update_weights_from_disk(self, path: str, version: int) -> dict[str, float]:
        """Load weights from a .safetensors file (or a directory of them) at a step boundary;
        sequences in flight recompute their KV and continue (keep it, paused with `keep_kv`). Works
        paused or not."""
        t0 = time.perf_counter()
        state = await asyncio.to_thread(load_weights, path)
        read_s = time.perf_counter() - t0

        def apply() -> dict[str, float]:
            stats = self.engine.update_weights(state, version, keep_kv=self._keep_kv and self._paused)
            self._committed(version)
            return stats

        return {"engine/update_read_s": read_s, **(await self._call(apply))}

    def stats(self) -> dict[str, float]:
        """engine/* metrics: the engine's own (as of its last step) plus this loop's counters."""
        c = self._counts
        return {**self._snapshot,
                "engine/weight_version": float(self.weight_version),
                "engine/paused": float(self._paused),
                "engine/idle_s_total": self._idle_s,
                "engine/in_flight": float(len(self._streams)),
                "engine/requests_total": float(c["requests"]),
                "engine/finished_total": float(c["finished"]),
                "engine/aborted_total": float(c["aborted"]),
                "engine/steps_total": float(c["steps"]),
                "engine/weight_updates_total": float(c["weight_updates"]),
                "engine/step_errors_total": float(c["step_errors"])}

    # ------------------------------------------------------------------ streamed weights (weight_sync)
    async def update_weights_from_staged(self, path: str, version: int) -> dict[str, float]:
        """Swap in a staged version (a safetensors file assembled from streamed buckets or written by the
        disk publisher, or a directory of safetensors shards) at one step boundary, so no forward pass
        mixes two versions. Each tensor is copied once from a memory map: no second copy of the model is
        held. Names and shapes are checked before any weight changes (the old weights stay on error), and a
        version not newer than the current one is refused. `/update_weights_from_disk` loads this way."""
        from async_rl.weight_sync.staging import map_weights

        check = functools.partial(self._check_newer, version)
        check()
        t0 = time.perf_counter()
        state = await asyncio.to_thread(map_weights, path)
        read_s = time.perf_counter() - t0

        def apply() -> dict[str, float]:
            check()
            stats = self.engine.update_weights(state, version, keep_kv=self._keep_kv and self._paused)
            self._committed(version)
            return stats

        try:
            return {"engine/update_read_s": read_s, **(await self._call(apply))}
        finally:
            state.clear()

    async def load_tensors(self, named: list[tuple[str, torch.Tensor]], version: int | None) -> dict[str, float]:
        """Copy tensors straight into the parameters (SGLang's `/update_weights_from_distributed`: a version
        may arrive in several calls, one per bucket). The first call of a version holds the loop paused, so
        no forward pass mixes two versions, until the call that completes it: the one carrying `version`,
        or without one, the one after which every parameter has arrived (then the version is the current
        one + 1). A version not newer than the one in use is refused before anything is copied. A version
        that never completes (its transfer failed) leaves the loop paused until a whole one loads.
        Returns engine/* stats; "engine/weights_complete" says whether this call completed the version."""
        def apply() -> dict[str, float]:
            if version is not None:
                self._check_newer(version)
            t0 = time.perf_counter()
            if self._partial is None:
                self._partial, self._held, self._paused = set(), not self._paused, True
            self.engine.load_tensors(named)
            self._partial.update(n for n, _ in named)
            if version is None and self.engine.missing_parameters(self._partial):
                return {"engine/update_load_s": time.perf_counter() - t0, "engine/weights_complete": 0.0}
            done = self.weight_version + 1 if version is None else version
            stats = self.engine.commit_weights(done, t0, keep_kv=self._keep_kv and self._paused)
            self._committed(done)
            return {**stats, "engine/weights_complete": 1.0}

        return await self._call(apply)

    def _committed(self, version: int) -> None:
        """Loop thread: `version` is in use; a version that was arriving in parts is over."""
        self.weight_version = version
        self._counts["weight_updates"] += 1
        if self._partial is not None and self._held:
            self._paused = False
        self._partial, self._held = None, False

    def _check_newer(self, version: int) -> None:
        from async_rl.weight_sync.versions import check_newer

        check_newer(version, self.weight_version, field="weight_version", current_is="the version in use")

"""The embedded generation engine: requests in, tokens with log-probs and policy versions out.

    engine = LLMEngine(model, EngineConfig(), tokenizer=tok, eos_token_ids=[2])
    engine.add_request("r0", prompt_ids, SamplingParams(max_new_tokens=16, temperature=1.0))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                print(out.output.output_ids, out.output.output_logprobs)

One `step()` = schedule (continuous batching under a token budget, paged KV, prefix
reuse, preemption) -> one forward over every scheduled token -> sample -> append tokens,
finish sequences and free their blocks. `update_weights` is called between steps: it
loads new weights in place, drops the prefix cache, and makes every in-flight sequence
recompute its KV with the new weights before it samples again (or, `keep_kv=True`, SGLang's
update under an `in_place` pause, go on over the KV it has: no recompute, and its next tokens
attend to keys and values the old weights computed). Not thread-safe: the
caller serialises `add_request`, `abort_request`, `step` and `update_weights`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence as Seq
from dataclasses import dataclass

import torch

from async_rl.config import EngineConfig
from async_rl.engine.block_manager import BlockManager
from async_rl.engine.model_runner import ModelRunner
from async_rl.engine.sampler import Sampler
from async_rl.engine.scheduler import ScheduledChunk, Scheduler
from async_rl.engine.sequence import Sequence
from async_rl.types import GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)


class EngineInputError(ValueError):
    """A request the engine cannot serve; the message names the offending field."""


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]  # tokens sampled for this request in this step (may be empty)
    new_logprobs: list[float]
    new_top_logprobs: list[list[tuple[int, float]]] | None
    finished: bool
    output: GenerationOutput | None  # the full result when finished


KV_POOL_HEADROOM = 4  # the KV pool holds at most this many times what max_running full contexts need


class LLMEngine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, *, tokenizer=None,
                 eos_token_ids: Seq[int] = (), policy_version: int = 0):
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.policy_version = policy_version
        per_block = ModelRunner.bytes_per_block(model, config.block_size)
        num_blocks = int(config.kv_cache_mb * 2**20) // per_block
        if num_blocks < 1:
            raise ValueError(f"engine.kv_cache_mb: {config.kv_cache_mb} MB holds no KV block "
                             f"({per_block} bytes each); raise it")
        # max_running sequences at full context, 4 times over (the rest is prefix cache): more blocks are
        # never used at once, and each costs host bookkeeping; a GPU share sized for real models held 26M
        # blocks of the debug model (2 s to start, 1 GB of host lists)
        most = KV_POOL_HEADROOM * config.max_running * -(-model.config.max_position_embeddings // config.block_size)
        if num_blocks > most:
            logger.info("engine: KV pool capped at %d blocks (%d budgeted): %d x max_running %d x blocks of a "
                        "full context", most, num_blocks, KV_POOL_HEADROOM, config.max_running)
            num_blocks = most
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.decode_slab, config.cpu_kernels)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_running, config.max_tokens_per_step)
        kernels = self.runner.kernels
        self.sampler = Sampler(self.runner.device, kernel=None if kernels is None else kernels.sample)
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.max_context = model.config.max_position_embeddings
        self._requests: dict[str, Sequence] = {}  # unfinished requests by id
        self._aborted: list[Sequence] = []  # finished by abort_request, reported by the next step()
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)  # (step seconds, tokens sampled)
        self._recomputed_tokens = 0
        # step timings by (torch threads, sequences sampled rounded down to a power of 2): the
        # simulator's calibration fits its engine model to these (async_rl/sim/calibrate.py)
        self._profile: dict[tuple[int, int], list[float]] = {}
        logger.info("engine: %d KV blocks of %d tokens (%.1f MB), max_running=%d, max_tokens_per_step=%d",
                    num_blocks, config.block_size, num_blocks * per_block / 2**20, config.max_running,
                    config.max_tokens_per_step)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._validate(request_id, prompt_ids, params)
        seq = Sequence(request_id, [int(t) for t in prompt_ids], params, self.eos_token_ids, self.runner.device)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def _validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise EngineInputError(f"rid: must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise EngineInputError(f"rid: request id {request_id!r} is already in flight")
        if not isinstance(params, SamplingParams):
            raise EngineInputError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        try:
            params.validate(self.config.max_new_tokens_limit)
        except ValueError as exc:
            raise EngineInputError(str(exc)) from None
        if len(prompt_ids) == 0:
            raise EngineInputError("input_ids: the prompt is empty")
        for i, t in enumerate(prompt_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise EngineInputError(
                    f"input_ids[{i}]: token id {t!r} outside the vocabulary (size {self.vocab_size})")
        total = len(prompt_ids) + params.max_new_tokens
        if len(prompt_ids) >= self.max_context:
            raise EngineInputError(f"input_ids: prompt of {len(prompt_ids)} tokens does not fit the model "
                                   f"context (max_position_embeddings={self.max_context})")
        if total > self.max_context:
            raise EngineInputError(
                f"sampling_params.max_new_tokens: prompt ({len(prompt_ids)}) + max_new_tokens "
                f"({params.max_new_tokens}) = {total} exceeds the model context "
                f"(max_position_embeddings={self.max_context}); lower max_new_tokens")
        need = self.block_manager.blocks_needed(total)
        if need > self.block_manager.num_blocks:
            raise EngineInputError(
                f"sampling_params.max_new_tokens: prompt ({len(prompt_ids)}) + max_new_tokens "
                f"({params.max_new_tokens}) needs {need} KV blocks but the whole cache has "
                f"{self.block_manager.num_blocks} (engine.kv_cache_mb={self.config.kv_cache_mb}); "
                "raise engine.kv_cache_mb or lower max_new_tokens")
        if params.stop and self.tokenizer is None:
            raise EngineInputError("sampling_params.stop: stop strings need the engine to have a tokenizer")
        if params.n != 1:
            raise EngineInputError(f"sampling_params.n: the engine samples one sequence per request, got n={params.n}"
                                   " (the HTTP server fans n out into n requests)")
        if any(t >= self.vocab_size for t in params.logit_bias):
            raise EngineInputError(f"sampling_params.logit_bias: token ids must be below the vocabulary size "
                                   f"{self.vocab_size}, got {sorted(params.logit_bias)[-1]}")

    def abort_request(self, request_id: str) -> bool:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self._aborted.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._aborted)

    def retract_all(self) -> list[str]:
        """Free the KV of every started request (SGLang's pause mode `retract`): they go back to the
        waiting queue and recompute it (from the prefix cache where it still holds) when stepping
        resumes. Returns the retracted request ids."""
        return [seq.request_id for seq in self.scheduler.interrupt_all()]

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while a running sequence holds KV blocks."""
        if self.scheduler.running:
            return False
        self.block_manager.reset_prefix_cache()
        return True

    # ------------------------------------------------------------------ the step loop
    def step(self) -> list[StepOutput]:
        outputs = [self._final(seq, [], [], None) for seq in self._aborted]
        self._aborted.clear()
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        if not chunks:
            return outputs
        logits = self.runner.run(chunks)  # [S, V]
        self.block_manager.commit()
        sampling = [c for c in chunks if c.samples]
        row = self._record(chunks, sampling)
        result = self.sampler(logits, [c.seq.params for c in sampling], [c.seq.generator for c in sampling],
                              [c.seq for c in sampling]) if sampling else None
        for c in chunks:
            self._account(c)
        for i, c in enumerate(sampling):
            outputs.append(self._append(c.seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i]))
        seconds = time.perf_counter() - t0
        self._recent.append((seconds, len(sampling)))
        row[1] += seconds
        return outputs

    def _record(self, chunks: list[ScheduledChunk], sampling: list[ScheduledChunk]) -> list[float]:
        """Count this step's shape in its profile bucket; the caller adds the step's seconds (row[1])."""
        key = (torch.get_num_threads(), 1 << (len(sampling).bit_length() - 1) if sampling else 0)
        row = self._profile.setdefault(key, [0.0] * 5)
        row[0] += 1
        row[2] += len(sampling)
        row[3] += sum(c.start + c.length for c in sampling)  # context the sampled sequences attend to
        row[4] += sum(c.length for c in chunks) - sum(1 for c in sampling if c.length == 1)  # prompt, recompute
        return row

    def _account(self, chunk: ScheduledChunk) -> None:
        seq = chunk.seq
        seq.num_computed += chunk.length
        redo = min(chunk.length, seq.recompute_left)
        seq.recompute_left -= redo
        self._recomputed_tokens += redo

    def _append(self, seq: Sequence, token: int, logprob: float, top) -> StepOutput:
        seq.token_ids.append(token)
        seq.output_logprobs.append(logprob)
        seq.output_versions.append(self.policy_version)
        if seq.output_top_logprobs is not None:
            seq.output_top_logprobs.append(top)
        reason = self._finish_reason(seq, token)
        if reason is None:
            return StepOutput(seq.request_id, [token], [logprob], None if top is None else [top], False, None)
        self.scheduler.finish(seq, reason)
        del self._requests[seq.request_id]
        return self._final(seq, [token], [logprob], None if top is None else [top])

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if seq.num_output >= seq.params.min_new_tokens:  # SGLang: no stop before min_new_tokens
            if token in seq.stop_ids:
                return "stop"
            if seq.params.stop and self._hits_stop_string(seq):
                return "stop"
        if seq.num_output >= seq.params.max_new_tokens or len(seq) >= self.max_context:
            return "length"
        return None

    def _hits_stop_string(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        tail = seq.output_ids[-(longest + 4):]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return any(s in text for s in seq.params.stop)

    @staticmethod
    def _final(seq: Sequence, tokens, logprobs, top) -> StepOutput:
        return StepOutput(seq.request_id, tokens, logprobs, top, True, seq.to_output())

    # ------------------------------------------------------------------ weights
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int,
                       keep_kv: bool = False) -> dict[str, float]:
        """Load a whole state dict (checked before anything changes) and commit it as `version`."""
        t0 = time.perf_counter()
        params = self.model.state_dict(keep_vars=True)
        self._check_named(state_dict.items(), params)
        # tied weights (embed_tokens / lm_head) are one tensor: either name is enough
        missing = self.missing_parameters(set(state_dict))
        if missing:
            raise ValueError(f"state_dict: missing parameters {missing[:5]} ({len(missing)} in all)")
        self._copy(state_dict.items(), params)
        return self.commit_weights(version, t0, keep_kv)

    def load_tensors(self, named: Seq[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the parameters of the same names (converting dtype and device); the version
        in use does not change until `commit_weights`. ValueError naming them if any name or shape is
        not this model's (nothing is copied then)."""
        params = self.model.state_dict(keep_vars=True)
        self._check_named(named, params)
        self._copy(named, params)

    @staticmethod
    def _check_named(named: Iterable[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor]) -> None:
        named = list(named)
        unknown = sorted(n for n, _ in named if n not in params)
        if unknown:
            raise ValueError(f"state_dict: unknown parameter names {unknown[:5]} (not in model.state_dict())")
        bad = [f"{n} {tuple(t.shape)} != {tuple(params[n].shape)}" for n, t in named
               if tuple(t.shape) != tuple(params[n].shape)]
        if bad:
            raise ValueError(f"state_dict: shape mismatch for {bad[:5]}")

    @staticmethod
    def _copy(named: Iterable[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)

    def missing_parameters(self, loaded: set[str]) -> list[str]:
        """Parameters none of whose names (tied ones share a tensor) is in `loaded`."""
        by_storage: dict[int, list[str]] = {}
        for name, p in self.model.state_dict(keep_vars=True).items():
            by_storage.setdefault(p.data_ptr(), []).append(name)
        return sorted(n for names in by_storage.values() if not loaded.intersection(names) for n in names)

    def commit_weights(self, version: int, t0: float | None = None, keep_kv: bool = False) -> dict[str, float]:
        """The parameters as loaded are now `version`: sequences in flight recompute their KV, or with
        `keep_kv` go on over the KV they hold (those whose KV was already freed recompute it either way)."""
        t0 = time.perf_counter() if t0 is None else t0
        self.policy_version = version
        kept = list(self.scheduler.running) if keep_kv else []
        for seq in kept:
            seq.kv_mixed = True
        interrupted = [] if keep_kv else self.scheduler.interrupt_all()
        self.block_manager.reset_prefix_cache()
        for seq in interrupted + kept + [s for s in self.scheduler.waiting if keep_kv and s.admitted_once]:
            seq.num_interruptions += 1
        load_s = time.perf_counter() - t0
        logger.info("weights v%d loaded in %.3fs; %d sequences will recompute their KV, %d keep theirs",
                    version, load_s, len(interrupted), len(kept))
        return {"engine/update_load_s": load_s, "engine/interrupted": float(len(interrupted)),
                "engine/kv_kept": float(len(kept))}

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, float]:
        sched, bm = self.scheduler, self.block_manager
        secs = sum(t for t, _ in self._recent)
        return {
            "engine/running": float(len(sched.running)),
            "engine/waiting": float(len(sched.waiting)),
            "engine/kv_blocks_used": float(bm.num_used),
            "engine/kv_blocks_total": float(bm.num_blocks),
            "engine/prefix_hit_rate": sched.prefix_hit_tokens / max(1, sched.prefix_lookup_tokens),
            "engine/tokens_per_s": sum(n for _, n in self._recent) / secs if secs > 0 else 0.0,
            "engine/preemptions": float(sched.num_preemptions),
            "engine/recomputed_tokens": float(self._recomputed_tokens),
            "engine/cuda_servers": float(self.runner.device.type == "cuda"),  # summed over a pool: its GPU servers
            **({"engine/slab_rows_copied": float(slab.rows_copied), "engine/slab_pool_steps": float(slab.pool_steps)}
               if (slab := self.runner.slab) is not None else {}),
            **{f"engine/step_t{t}_b{b}_{field}": value for (t, b), row in self._profile.items()
               for field, value in zip(STEP_FIELDS, row)},
        }


STEP_FIELDS = ("n", "s", "seqs", "ctx", "prefill")  # steps, seconds, sequences sampled, their context, prefill tokens

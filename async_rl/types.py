"""Plain data that crosses component and process boundaries.

Everything here is a frozen dataclass with an explicit wire form (`to_wire` /
`from_wire`): a dict of msgpack-able values where arrays stay numpy arrays, which the
codec in `async_rl.transport.codec` turns into raw bytes + dtype + shape. Nothing here
is ever pickled. `from_wire` checks every field and raises `WireFormatError` naming the
field that is wrong, so a malformed frame never reaches numeric code.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

FINISH_REASONS = ("stop", "length", "abort")


class WireFormatError(ValueError):
    """A frame or message does not have the shape its type requires."""


def new_id() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- helpers
def _require(d: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(d, dict):
        raise WireFormatError(f"{where}: expected a map, got {type(d).__name__}")
    if key not in d:
        raise WireFormatError(f"{where}.{key}: missing")
    value = d[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise WireFormatError(f"{where}.{key}: expected {kind}, got bool")
    if not isinstance(value, kind):
        raise WireFormatError(f"{where}.{key}: expected {kind}, got {type(value).__name__}")
    return value


def _array(d: dict, key: str, dtype: str, where: str, length: int | None = None) -> np.ndarray:
    value = _require(d, key, np.ndarray, where)
    if value.ndim != 1:
        raise WireFormatError(f"{where}.{key}: expected a 1-d array, got shape {value.shape}")
    if value.dtype != np.dtype(dtype):
        raise WireFormatError(f"{where}.{key}: expected dtype {dtype}, got {value.dtype}")
    if length is not None and len(value) != length:
        raise WireFormatError(f"{where}.{key}: expected length {length}, got {len(value)}")
    return value


# --------------------------------------------------------------------------- sampling
@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one request is sampled. Names follow SGLang's native `sampling_params`."""

    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means no top-k truncation
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0  # also return this many most likely tokens per position

    def validate(self, max_new_tokens_limit: int = 1 << 20) -> None:
        """Raise ValueError naming the first field with an impossible value."""
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise ValueError(
                f"sampling_params.max_new_tokens: must be an integer in [1, {max_new_tokens_limit}], "
                f"got {self.max_new_tokens!r}"
            )
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 100.0) \
                or math.isnan(self.temperature):
            raise ValueError(f"sampling_params.temperature: must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"sampling_params.top_p: must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k: must be -1 (off) or >= 0, got {self.top_k!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"sampling_params.top_logprobs: must be in [0, 20], got {self.top_logprobs!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling_params.stop_token_ids: must be non-negative integers, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"sampling_params.stop: must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"sampling_params.seed: must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_wire(self) -> dict[str, Any]:
        return {f.name: (list(getattr(self, f.name)) if isinstance(getattr(self, f.name), tuple)
                         else getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_wire(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build from a JSON/msgpack map; unknown keys raise ValueError naming them."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params.{unknown[0]}: unknown field (allowed: {', '.join(sorted(known))})")
        for key in ("stop_token_ids", "stop"):
            if key in d:
                v = d[key]
                if v is None:
                    v = ()
                elif isinstance(v, (str, int)):
                    v = (v,)
                elif not isinstance(v, (list, tuple)):
                    raise ValueError(f"sampling_params.{key}: must be a list, got {type(v).__name__}")
                d[key] = tuple(v)
        params = cls(**d)
        params.validate()
        return params


# --------------------------------------------------------------------------- sample
@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One task instance: what the agent loop is asked, and what it is scored against."""

    id: str
    prompt: str | None = None  # raw text prompt (no chat template)
    messages: list[dict[str, Any]] | None = None  # chat prompt (goes through the chat template)
    answer: str = ""  # reference answer for the verifiable reward
    agent: str | None = None  # agent loop to run; None = the configured default
    info: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- generation
@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationOutput:
    """What a generation server returns for one finished request."""

    request_id: str
    prompt_len: int
    output_ids: list[int]
    output_logprobs: list[float]  # log-prob of each sampled token under the sampling distribution
    output_versions: list[int]  # policy version of the weights that sampled each token
    finish_reason: str  # one of FINISH_REASONS
    num_interruptions: int = 0  # weight updates this request lived through while in flight
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    prefix_cached_tokens: int = 0

    def to_wire(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.output_top_logprobs is not None:
            d["output_top_logprobs"] = [[list(p) for p in pos] for pos in self.output_top_logprobs]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "GenerationOutput":
        where = "GenerationOutput"
        n = len(_require(d, "output_ids", list, where))
        for key in ("output_logprobs", "output_versions"):
            if len(_require(d, key, list, where)) != n:
                raise WireFormatError(f"{where}.{key}: expected {n} entries, got {len(d[key])}")
        reason = _require(d, "finish_reason", str, where)
        if reason not in FINISH_REASONS:
            raise WireFormatError(f"{where}.finish_reason: must be one of {FINISH_REASONS}, got {reason!r}")
        top = d.get("output_top_logprobs")
        return cls(
            request_id=_require(d, "request_id", str, where),
            prompt_len=_require(d, "prompt_len", int, where),
            output_ids=[int(t) for t in d["output_ids"]],
            output_logprobs=[float(x) for x in d["output_logprobs"]],
            output_versions=[int(v) for v in d["output_versions"]],
            finish_reason=reason,
            num_interruptions=int(d.get("num_interruptions", 0)),
            output_top_logprobs=None if top is None else [[(int(t), float(lp)) for t, lp in pos] for pos in top],
            prefix_cached_tokens=int(d.get("prefix_cached_tokens", 0)),
        )


# --------------------------------------------------------------------------- trajectory
@dataclass(frozen=True, slots=True, kw_only=True)
class Trajectory:
    """One sampled episode, ready to train on.

    `response_ids` holds every token after the prompt: model-sampled tokens (loss_mask 1)
    and, in multi-turn episodes, tool or user tokens (loss_mask 0). Per-token arrays all
    have the length of `response_ids`; where loss_mask is 0, behav_logprobs is 0 and
    versions is -1.
    """

    id: str
    group_id: str
    prompt_ids: np.ndarray  # [P] int32
    response_ids: np.ndarray  # [R] int32
    loss_mask: np.ndarray  # [R] uint8, 1 where the model sampled the token
    behav_logprobs: np.ndarray  # [R] float32, log-prob under the behaviour policy
    versions: np.ndarray  # [R] int32, policy version that sampled the token (-1 if not sampled)
    reward: float
    finish_reason: str
    num_interruptions: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # task metadata (str/int/float values)

    def __post_init__(self) -> None:
        r = len(self.response_ids)
        for name in ("loss_mask", "behav_logprobs", "versions"):
            if len(getattr(self, name)) != r:
                raise WireFormatError(f"Trajectory.{name}: expected length {r}, got {len(getattr(self, name))}")

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())

    def oldest_version(self) -> int:
        """Oldest policy version among the sampled tokens (-1 if none were sampled)."""
        sampled = self.versions[self.loss_mask.astype(bool)]
        return int(sampled.min()) if len(sampled) else -1

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Trajectory":
        where = "Trajectory"
        response = _array(d, "response_ids", "int32", where)
        r = len(response)
        reason = _require(d, "finish_reason", str, where)
        if reason not in FINISH_REASONS:
            raise WireFormatError(f"{where}.finish_reason: must be one of {FINISH_REASONS}, got {reason!r}")
        reward = _require(d, "reward", (int, float), where)
        if not math.isfinite(reward):
            raise WireFormatError(f"{where}.reward: must be finite, got {reward!r}")
        return cls(
            id=_require(d, "id", str, where),
            group_id=_require(d, "group_id", str, where),
            prompt_ids=_array(d, "prompt_ids", "int32", where),
            response_ids=response,
            loss_mask=_array(d, "loss_mask", "uint8", where, r),
            behav_logprobs=_array(d, "behav_logprobs", "float32", where, r),
            versions=_array(d, "versions", "int32", where, r),
            reward=float(reward),
            finish_reason=reason,
            num_interruptions=_require(d, "num_interruptions", int, where),
            timings=dict(_require(d, "timings", dict, where)),
            info=dict(_require(d, "info", dict, where)),
        )


def trajectory_from_generation(
    *,
    group_id: str,
    prompt_ids: list[int],
    out: GenerationOutput,
    reward: float,
    timings: dict[str, float] | None = None,
    info: dict[str, Any] | None = None,
) -> Trajectory:
    """A single-turn trajectory: every response token was sampled by the model."""
    n = len(out.output_ids)
    return Trajectory(
        id=new_id(),
        group_id=group_id,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        response_ids=np.asarray(out.output_ids, dtype=np.int32),
        loss_mask=np.ones(n, dtype=np.uint8),
        behav_logprobs=np.asarray(out.output_logprobs, dtype=np.float32),
        versions=np.asarray(out.output_versions, dtype=np.int32),
        reward=float(reward),
        finish_reason=out.finish_reason,
        num_interruptions=out.num_interruptions,
        timings=dict(timings or {}),
        info=dict(info or {}),
    )

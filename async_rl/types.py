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
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

FINISH_REASONS = ("stop", "length", "abort")


class WireFormatError(ValueError):
    """A frame or message does not have the shape its type requires."""


class RequestRefused(ValueError):
    """A generation server refused or failed one request (a prompt too long for its context, sampling parameters
    it cannot honour, an error chunk in its stream): that request is lost, the server is fine, the rest go on."""


class GroupRefused(ValueError):
    """A group that cannot be trained is refused where it is found (not sent, or not taken): the message
    says why (the same words for every group refused for that reason: the audit counts by them), `detail`
    which sample. The refusal is ledgered, and the audit counts the group as lost unless its prompt was
    trained through another group."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.detail = detail


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
# SGLang `sampling_params` keys asking for what the embedded engine cannot do: set -> an error naming the key.
UNSUPPORTED_SAMPLING = {
    "regex": "regex-constrained decoding",
    "json_schema": "JSON-schema-constrained decoding",
    "ebnf": "grammar-constrained decoding",
    "structural_tag": "structural-tag-constrained decoding",
    "stop_regex": "stop conditions given as regular expressions",
    "watermark": "watermarking",
}
# SGLang keys that change nothing in sampling (detokeniser spacing, custom logit-processor arguments
# without a processor): accepted and dropped; stream_interval, a stream's chunk cadence, is read by the
# /generate route (generate_route.stream_interval) before the rest become SamplingParams.
IGNORED_SAMPLING = ("stream_interval", "spaces_between_special_tokens", "custom_params")
MAX_N = 64  # most samples one request may ask for (`n`)


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple, dict)) and not value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a count


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one request is sampled. Names, meanings and defaults follow SGLang's native `sampling_params`
    (`seed` is SGLang's `sampling_seed`; `top_logprobs` its request-level `top_logprobs_num`).

    Penalties, `min_p`, `min_new_tokens` and `logit_bias` shape the distribution tokens are drawn
    from; the reported log-probs stay those of the policy (see `async_rl.engine.sampler`)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # stop tokens and stop strings are ignored before this many tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means no top-k truncation
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    frequency_penalty: float = 0.0  # minus this times the token's count in the output so far, per logit
    presence_penalty: float = 0.0  # minus this for every token already in the output
    repetition_penalty: float = 1.0  # logits of output tokens divided (positive) or multiplied (negative) by it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # samples of the prompt; the HTTP server fans them out, the engine samples one per request
    skip_special_tokens: bool = True  # in the decoded text
    no_stop_trim: bool = False  # keep a matched stop string at the end of the decoded text
    seed: int | None = None
    top_logprobs: int = 0  # also return this many most likely tokens per position

    def validate(self, max_new_tokens_limit: int = 1 << 20) -> None:
        """Raise ValueError naming the first field with an impossible value."""
        if not _integer(self.max_new_tokens) or not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise ValueError(
                f"sampling_params.max_new_tokens: must be an integer in [1, {max_new_tokens_limit}], "
                f"got {self.max_new_tokens!r}"
            )
        if not _integer(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"sampling_params.min_new_tokens: must be an integer in [0, max_new_tokens="
                             f"{self.max_new_tokens}], got {self.min_new_tokens!r}")
        if not _number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"sampling_params.temperature: must be in [0, 100], got {self.temperature!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p: must be in (0, 1], got {self.top_p!r}")
        if not _integer(self.top_k) or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k: must be -1 (off) or >= 0, got {self.top_k!r}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling_params.min_p: must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"sampling_params.{name}: must be in [-2, 2], got {getattr(self, name)!r}")
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"sampling_params.repetition_penalty: must be in (0, 2] (1 = off), "
                             f"got {self.repetition_penalty!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 or not _number(b)
               for t, b in self.logit_bias.items()):
            raise ValueError(f"sampling_params.logit_bias: must map token ids to finite numbers, "
                             f"got {self.logit_bias!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"sampling_params.n: must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _integer(self.top_logprobs) or not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"sampling_params.top_logprobs: must be in [0, 20], got {self.top_logprobs!r}")
        if any(not _integer(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling_params.stop_token_ids: must be non-negative integers, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"sampling_params.stop: must be non-empty strings, got {self.stop!r}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sampling_params.{name}: must be true or false, got {getattr(self, name)!r}")
        if self.seed is not None and (not _integer(self.seed) or not -(1 << 63) <= self.seed < 1 << 63):
            raise ValueError(f"sampling_params.seed: must be a 64-bit signed integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether drawing needs the output so far (penalties, min_new_tokens) or a logit bias."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_new_tokens or self.logit_bias)

    def to_wire(self) -> dict[str, Any]:
        """The `sampling_params` map of a /generate body in SGLang's names, non-default values only
        (so older SGLang releases, which lack some keys, accept it). `top_logprobs` is not in it: it
        travels as the request's `top_logprobs_num`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("seed", "top_logprobs") or (f.name not in ("max_new_tokens", "temperature")
                                                       and value == _DEFAULTS[f.name]):
                continue
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = {str(k): v for k, v in value.items()}
            out[f.name] = value
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build from SGLang's `sampling_params` map (or ours). `null` means unset; keys asking for
        what the engine cannot do, and unknown keys, raise ValueError naming them."""
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling_params: must be a map, got {type(d).__name__}")
        d = dict(d or {})
        for key in IGNORED_SAMPLING:
            d.pop(key, None)
        for key, what in UNSUPPORTED_SAMPLING.items():
            if not _unset(d.pop(key, None)):
                raise ValueError(f"sampling_params.{key}: {what} is not supported by this engine; leave it unset")
        if d.pop("beam_width", None) not in (None, 1):
            raise ValueError("sampling_params.beam_width: beam search is not supported by this engine; leave it unset")
        seed = d.pop("sampling_seed", None)
        if seed is not None:
            if d.get("seed") not in (None, seed):
                raise ValueError(f"sampling_params.sampling_seed: {seed!r} disagrees with seed {d['seed']!r}; give one")
            d["seed"] = seed
        d = {k: v for k, v in d.items() if v is not None}
        unknown = sorted(set(d) - set(_DEFAULTS))
        if unknown:
            raise ValueError(f"sampling_params.{unknown[0]}: unknown field (allowed: {', '.join(sorted(_DEFAULTS))}, "
                             f"sampling_seed, and SGLang's {', '.join(sorted(IGNORED_SAMPLING))})")
        for key in ("stop_token_ids", "stop"):
            if key in d:
                v = d[key]
                if isinstance(v, (str, int)):
                    v = (v,)
                elif not isinstance(v, (list, tuple)):
                    raise ValueError(f"sampling_params.{key}: must be a list, got {type(v).__name__}")
                d[key] = tuple(v)
        if "logit_bias" in d:
            d["logit_bias"] = _logit_bias(d["logit_bias"])
        params = cls(**d)
        params.validate()
        return params


def _logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise ValueError(f"sampling_params.logit_bias: must be a map of token id to bias, got {type(value).__name__}")
    try:
        return {int(k): v for k, v in value.items()}
    except (TypeError, ValueError):
        raise ValueError(f"sampling_params.logit_bias: keys must be token ids, got {sorted(value)[:5]!r}") from None


_DEFAULTS: dict[str, Any] = {f.name: (f.default_factory() if callable(f.default_factory) else f.default)
                             for f in fields(SamplingParams)}


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
STALE_MASKED = "stale_masked_tokens"  # Trajectory.info: sampled tokens trainer.stale_tokens=mask took out of the loss

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

    def newest_version(self) -> int:
        """Newest policy version among the sampled tokens (-1 if none were sampled)."""
        sampled = self.versions[self.loss_mask.astype(bool)]
        return int(sampled.max()) if len(sampled) else -1

    def within_bound(self, floor: int) -> "Trajectory":
        """This trajectory with its tokens sampled before version `floor` out of the loss mask (they stay
        as context; trainer.stale_tokens=mask); how many were taken out is `info[STALE_MASKED]`."""
        keep = (self.versions >= floor).astype(self.loss_mask.dtype)
        masked = int(self.loss_mask.sum()) - int((self.loss_mask * keep).sum())
        return replace(self, loss_mask=self.loss_mask * keep, info={**self.info, STALE_MASKED: masked})

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
        info = dict(_require(d, "info", dict, where))
        bad = nonfinite_score(reward, info)
        if bad:
            raise WireFormatError(f"{where}.{bad}")
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
            info=info,
        )


def nonfinite_score(reward: Any, info: dict[str, Any]) -> str:
    """"" when a trajectory's reward and turn scores (`info["turn_scores"]`) are finite numbers, else which is
    not: the one rule for what can be trained, applied where a trajectory is made and where it arrives."""
    if not _number(reward):
        return f"reward: must be finite, got {reward!r}"
    scores = info.get("turn_scores", [])
    if isinstance(scores, (list, tuple)) and not all(_number(x) for x in scores):
        return f"info.turn_scores: must be finite, got {list(scores)!r}"
    return ""


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

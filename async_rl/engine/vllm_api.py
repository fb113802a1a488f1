"""vLLM's token-in/token-out shapes in one place: the body a client sends, the answer as this project reads it.

vLLM (>= 0.32, started with `--enable-scale-out`) generates from token ids at
`POST /inference/v1/generate` (vllm/entrypoints/scale_out/token_in_token_out/protocol.py):

    request   {"request_id", "token_ids", "sampling_params" (vLLM's names: max_tokens, min_tokens, logprobs, ...),
               "stream", "output_mode": "tokens"}
    answer    {"request_id": "generate-tokens-<rid>", "usage": {"prompt_tokens", ...},
               "choices": [{"token_ids", "finish_reason" (stop|length|abort|error|repetition), "stop_reason",
                            "logprobs": {"content": [{"token_id", "logprob", "top_logprobs": [...]}, ...]},
                            "weight_versions": [{"version", "start", "end"}, ...]}]}
    stream    one such answer per step carrying only that step's tokens; the spans only on the last one
    error     {"error": {"message", "type", "code"}}, as the body of a 4xx/5xx answer or as a chunk of a
              stream that already answered 200 (a prompt too long for the context, found when the engine
              first sees the request: generate/base/serving.py)

`sglang_shaped` turns an answer into SGLang's native shape ({"output_ids", "meta_info"}, see
`sglang_api`), so one parser (`sglang_api.output_from_response`) reads every backend.

Log-probs. The server runs with `--logprobs-mode processed_logprobs`: log_softmax of the logits
after temperature, penalties and top-k/top-p (v1/sample/sampler.py). This project's rule (engine/
sampler.py) is log_softmax(logits / temperature) over the whole vocabulary, unpenalised; the two
agree exactly when nothing but the temperature shapes the distribution, so a request that asks for
more (top-p < 1, top-k, min-p, penalties, a logit bias) is refused here, naming the field, instead of
training on log-probs the trainer cannot reproduce. vLLM writes -9999 for a log-prob it does not
have (serving.py: a NaN or a token missing from its map): that is an error too, never a value.
"""

from __future__ import annotations

from typing import Any

from async_rl.types import RequestRefused, SamplingParams

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
ID_PREFIX = "generate-tokens-"  # vLLM's engine id of a request is this + the request_id sent (serving.py)
MISSING_LOGPROB = -9999.0  # what vLLM reports where it has no log-prob (serving.py)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}

# fields whose non-neutral values change what vLLM's processed log-probs measure (see the module docstring)
_NEUTRAL = {"top_p": 1.0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1.0}


def unsupported_field(params: SamplingParams) -> str | None:
    """The first sampling field whose value vLLM cannot honour under this project's log-prob rule, or None."""
    for name, neutral in _NEUTRAL.items():
        if getattr(params, name) != neutral:
            return name
    if params.top_k not in (-1, 0):
        return "top_k"
    if params.logit_bias:
        return "logit_bias"
    return None


def generate_body(input_ids: list[int], params: SamplingParams, rid: str, *, stream: bool = False) -> dict[str, Any]:
    """The /inference/v1/generate body for one sample of `input_ids` with every sampled token's log-prob."""
    bad = unsupported_field(params)
    if bad is not None:
        raise ValueError(f"sampling_params.{bad}: engine.backend=vllm reports log-probs after {bad} "
                         f"(--logprobs-mode processed_logprobs), not the policy's that the trainer recomputes; "
                         f"leave it at its neutral value with this backend (got {getattr(params, bad)!r})")
    sampling: dict[str, Any] = {
        "max_tokens": int(params.max_new_tokens), "min_tokens": int(params.min_new_tokens),
        "temperature": float(params.temperature), "logprobs": int(params.top_logprobs), "n": 1,
        "stop_token_ids": [int(t) for t in params.stop_token_ids], "ignore_eos": bool(params.ignore_eos),
        "skip_special_tokens": bool(params.skip_special_tokens), "include_stop_str_in_output": params.no_stop_trim,
        "detokenize": bool(params.stop)}  # stop strings need the text; token ids alone do not
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.seed is not None:
        sampling["seed"] = int(params.seed) & ((1 << 63) - 1)  # vLLM seeds are non-negative
    body: dict[str, Any] = {"request_id": rid, "token_ids": [int(t) for t in input_ids], "sampling_params": sampling,
                            "stream": stream, "output_mode": "tokens"}
    return body


def check_error(body: Any, where: str) -> None:
    """Raise RequestRefused when `body` (an answer or a stream chunk) is vLLM's error shape."""
    if isinstance(body, dict) and body.get("error") is not None:
        error = body["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise RequestRefused(f"{where}: vLLM refused the request: {message}")


def _logprobs(choice: dict[str, Any], ids: list[int], where: str) -> tuple[list[float], list[list] | None]:
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise RequestRefused(f"{where}: vLLM sent {len(content)} log-probs for {len(ids)} tokens")
    lps, tops = [], []
    for i, (entry, token) in enumerate(zip(content, ids)):
        lp = float(entry.get("logprob", MISSING_LOGPROB))
        if int(entry.get("token_id", token)) != token or lp <= MISSING_LOGPROB:
            raise RequestRefused(f"{where}: vLLM has no log-prob for output token {i} (id {token}): "
                                   f"it reported {entry!r}")
        lps.append(lp)
        tops.append([[float(t["logprob"]), int(t["token_id"]), None] for t in entry.get("top_logprobs") or []])
    return lps, tops


def sglang_shaped(body: dict[str, Any], rid: str, *, top_logprobs: bool = False,
                  finished: bool = True) -> dict[str, Any]:
    """A vLLM answer (or the merged chunks of a stream) in SGLang's native shape, ready for
    `sglang_api.output_from_response`; RequestRefused where vLLM answered with an error."""
    where = f"request {rid}"
    check_error(body, where)
    choices = body.get("choices") or []
    if len(choices) != 1:
        raise RequestRefused(f"{where}: expected one choice from vLLM, got {len(choices)}")
    choice = choices[0]
    ids = [int(t) for t in choice.get("token_ids") or []]
    lps, tops = _logprobs(choice, ids, where)
    reason = choice.get("finish_reason")
    if reason == "error":
        raise RequestRefused(f"{where}: vLLM failed the request (finish_reason error)")
    meta: dict[str, Any] = {
        "id": rid, "prompt_tokens": int((body.get("usage") or {}).get("prompt_tokens") or 0),
        "completion_tokens": len(ids), "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
        "finish_reason": None if not finished else {"type": FINISH_REASONS.get(str(reason), "abort"),
                                                    "matched": choice.get("stop_reason")}}
    if choice.get("weight_versions"):
        meta["weight_versions"] = choice["weight_versions"]
    if top_logprobs:
        meta["output_top_logprobs"] = tops
    return {"output_ids": ids, "meta_info": meta}


def merge_chunk(acc: dict[str, Any] | None, chunk: dict[str, Any]) -> dict[str, Any]:
    """The answer so far after one more stream chunk (vLLM streams each step's tokens only); the usage-only
    chunk (no choices) is left out. RequestRefused for an error chunk."""
    check_error(chunk, "stream")
    choices = chunk.get("choices") or []
    if not choices:
        return acc if acc is not None else {"choices": [{"token_ids": [], "logprobs": {"content": []}}]}
    new = choices[0]
    if acc is None:
        return {**chunk, "choices": [{**new, "token_ids": list(new.get("token_ids") or []),
                                      "logprobs": {"content": list((new.get("logprobs") or {}).get("content") or [])}}]}
    old = acc["choices"][0]
    merged = {**old, **{k: v for k, v in new.items() if v is not None},
              "token_ids": old["token_ids"] + list(new.get("token_ids") or []),
              "logprobs": {"content": old["logprobs"]["content"] + list((new.get("logprobs") or {}).get("content")
                                                                         or [])}}
    return {**acc, **{k: v for k, v in chunk.items() if k != "choices" and v is not None}, "choices": [merged]}

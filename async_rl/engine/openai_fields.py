"""What clients send to /v1/completions and /v1/chat/completions beyond OpenAI's own fields.

vLLM and SGLang accept a common set of sampling extensions on their OpenAI routes, and clients
written for them (vLLM's serving benchmark, verl/slime/AReaL rollouts, LangChain's `extra_body`)
send them, often at their neutral value (vLLM's benchmark sends `repetition_penalty: 1.0` on every
request). The lists below are read from vLLM 0.32 (`vllm/entrypoints/openai/completion/protocol.py`,
`chat_completion/protocol.py`, `generate/base/protocol.py` for `stream_options`) and SGLang
(`python/sglang/srt/entrypoints/openai/protocol.py`). Every field is one of three kinds:

- applied (`SamplingExtensions`, `ChatExtensions`): `top_k`, `min_p`, `repetition_penalty`,
  `min_tokens`, `logit_bias`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
  `include_stop_str_in_output` (SGLang: `no_stop_trim`), `return_tokens_as_token_ids`,
  `stream_options.continuous_usage_stats`; completions' `add_special_tokens`; chat's
  `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`;
- metadata that changes no token and no text (`METADATA`): accepted and not used;
- refused when set to anything but its neutral value (`NEUTRAL`): each is answered 400 naming
  the field, since the engine cannot honour it (beam search, constrained decoding, prompt
  log-probs, LoRA, ...). A neutral value (`use_beam_search: false`, `bad_words: []`,
  `response_format: {"type": "text"}`) is accepted, as vLLM and SGLang accept it.

A field neither server knows is still refused (400 "unknown field"), so a typo does not pass.
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictInt, create_model

from async_rl.engine.http_common import ApiError, Strict

# field -> the values that ask for nothing (None, unset, is always one of them)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1.0,), "best_of": (1,), "watermarking": (False,),
    "bad_words": ([],), "allowed_token_ids": (), "prompt_logprobs": (), "logprob_token_ids": (),
    "truncate_prompt_tokens": (), "truncation_side": (), "suffix": ("",), "prompt_embeds": (),
    "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "json_schema": (), "regex": (), "ebnf": (), "stop_regex": (), "cache_salt": (), "priority": (0,),
    "kv_transfer_params": (), "ec_transfer_params": (), "vllm_xargs": ({},), "repetition_detection": (),
    "thinking_token_budget": (-1,), "stream_interval": (1,), "lora_path": (), "session_params": (),
    "custom_logit_processor": (), "return_hidden_states": (False,), "return_routed_experts": (False,),
    "routed_experts_prompt_start": (0,), "return_prompt_text": (False,), "images_config": (),
    "bootstrap_host": (), "bootstrap_port": (), "bootstrap_room": (), "routed_dp_rank": (),
    "data_parallel_rank": (), "disagg_prefill_dp_rank": (), "ngram_corpus_id": (),
}
# the chat route's own: documents and media go to templates/processors this server does not run
CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "chat_template": (), "documents": (), "reasoning_effort": (), "include_reasoning": (True,),
    "media_io_kwargs": ({},), "mm_processor_kwargs": ({},), "separate_reasoning": (True,),
    "stream_reasoning": (True,), "add_special_tokens": (False,),
}
# change no token and no text: ids and labels for the caller's bookkeeping, detokeniser spacing (fast
# tokenizers ignore it), custom-processor arguments without a processor, output this server always sends
# (token ids) or that vLLM ignores on these routes (offsets, multimodal payloads)
METADATA = ("user", "request_id", "rid", "session_id", "extra_key", "custom_labels", "custom_params",
            "return_token_ids", "return_cached_tokens_details", "return_token_offsets", "mm_payload",
            "return_mm_kwargs", "spaces_between_special_tokens")


class StreamOptions(Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # usage so far in every chunk


class SamplingExtensions(Strict):
    """The applied extensions both routes take (names as vLLM and SGLang spell them)."""

    top_k: StrictInt | None = None  # -1 or 0 = off
    min_p: float | None = None
    repetition_penalty: float | None = None  # 1 = off
    min_tokens: StrictInt = 0  # no stop token or stop string before this many tokens
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> added to its logit
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True  # in the decoded text; token_ids are always complete
    include_stop_str_in_output: bool = False  # vLLM: keep a matched stop string at the end of the text
    no_stop_trim: bool = False  # SGLang's name for the same
    return_tokens_as_token_ids: bool | None = None  # log-prob tokens as "token_id:<id>"
    stream_options: StreamOptions | None = None


Unsupported = create_model("Unsupported", __base__=Strict,
                           **{n: (Any, None) for n in (*NEUTRAL, *METADATA, "response_format")})
ChatUnsupported = create_model("ChatUnsupported", __base__=Strict, **{n: (Any, None) for n in CHAT_NEUTRAL})


class ChatExtensions(Strict):
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template (enable_thinking, ...)


def refuse_unhonoured(req: Any, chat: bool) -> None:
    """ApiError naming the first field set to a value the engine cannot honour."""
    for table in (NEUTRAL, CHAT_NEUTRAL) if chat else (NEUTRAL,):
        for name, neutral in table.items():
            value = getattr(req, name, None)
            if value is not None and not any(_same(value, n) for n in neutral):
                raise ApiError(400, f"{name}: not supported by this server (the engine cannot honour {value!r}); "
                                    f"leave it unset{' or ' + repr(neutral[0]) if neutral else ''}")
    rf = getattr(req, "response_format", None)
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise ApiError(400, f"response_format: only {{'type': 'text'}} is supported by this server (no constrained "
                            f"decoding), got {rf!r}")


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same kind (so 0 is not taken for false, nor 1.0 for true)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def keeps_stop_string(req: SamplingExtensions) -> bool:
    return req.include_stop_str_in_output or req.no_stop_trim


def sampling_wire(req: SamplingExtensions) -> dict[str, Any]:
    """The applied extensions as `SamplingParams` wire keys."""
    return {"top_k": -1 if req.top_k is None else req.top_k, "min_p": req.min_p or 0.0,
            "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
            "min_new_tokens": req.min_tokens, "logit_bias": req.logit_bias or {},
            "stop_token_ids": req.stop_token_ids or [], "ignore_eos": req.ignore_eos,
            "skip_special_tokens": req.skip_special_tokens, "no_stop_trim": keeps_stop_string(req)}


def template_kwargs(req: ChatExtensions) -> dict[str, Any]:
    """Keyword arguments of `apply_chat_template` beyond messages and tools."""
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "continue_final_message: needs add_generation_prompt=false (the last message is "
                            "continued, so no new turn is opened)")
    reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize", "return_dict"}
    clash = sorted(reserved & set(req.chat_template_kwargs or {}))
    if clash:
        raise ApiError(400, f"chat_template_kwargs.{clash[0]}: set by the request itself, not through the template")
    return {"add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message, **(req.chat_template_kwargs or {})}

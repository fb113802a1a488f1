"""Tokens of what comes after a sampled assistant turn, without re-tokenising sampled text.

A multi-turn episode's token record is: prompt ids, then for each turn the ids the server
sampled (kept exactly as they are), then environment ids (mask 0). The environment ids are
everything the chat template writes between the end of the model's sampled ids and the start
of its next turn: the template's text after an assistant message's content that the model did
not sample itself, the new tool / user messages, and the next generation prompt.

They come from the chat template rendered as TEXT twice:

    before = render(messages)                                   # ends with the assistant turn
    after  = render(messages + new_messages, generation prompt)
    env text = glue + after[len(before):]

`after` must start with `before` (a template that rewrites the history when messages are
appended, e.g. one that drops earlier reasoning, is refused with `ChatTemplateError`). The
`glue` is the template's text after an assistant message's content (ChatML: `<|im_end|>\\n`),
found by rendering the conversation once more with a sentinel as the assistant content,
minus the part the model sampled itself: when the turn ended on a stop token (its EOS,
`<|im_end|>`) whose text starts the glue, that text is already in the record as a sampled
token and only the rest (`\\n`) is added. A turn cut by a stop string or by length gets the
whole glue (the template's end-of-turn is then an environment token), and so does a turn that
ended on a stop token the template does not write (a base model's `<|endoftext|>` under a
ChatML template: the sampled token stays, the template's `<|im_end|>\\n` follows it). Only the env text is
tokenised, as one string, with `add_special_tokens=False`.
"""

from __future__ import annotations

from typing import Any

SENTINEL = "\u2063ASYNC_RL_CONTENT\u2063"  # invisible separators: text no model writes by accident


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for token-exact multi-turn episodes."""


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
           add_generation_prompt: bool) -> str:
    """The chat template's text of `messages` (tools passed as `tools=`; a template may ignore them)."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja errors (raise_exception in the template, unknown roles) and friends
        roles = [m.get("role") for m in messages]
        raise ChatTemplateError(f"the chat template cannot render roles {roles}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def assistant_glue(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The text the template writes after the content of `messages[-1]` (an assistant message)."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("assistant_glue: the last message must be the assistant's")
    probe = render(tokenizer, messages[:-1] + [{**messages[-1], "content": SENTINEL}], tools,
                   add_generation_prompt=False)
    if probe.count(SENTINEL) != 1:
        raise ChatTemplateError("the chat template does not render an assistant message's content verbatim "
                                "exactly once; cannot find the text it writes after the content")
    return probe.split(SENTINEL, 1)[1]


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def env_text_after_turn(tokenizer: Any, messages: list[dict[str, Any]], new_messages: list[dict[str, Any]], *,
                        tools: list[dict[str, Any]] | None, sampled_tail: str = "") -> str:
    """Text to append after an assistant turn's sampled ids so that the next generation starts right.

    `messages` ends with the assistant message whose tokens the model sampled; `new_messages` are
    the tool / user messages that follow; `sampled_tail` is the text of the stop token the model
    sampled at the end of its turn ("" when it stopped on a stop string or by length)."""
    before = render(tokenizer, messages, tools, add_generation_prompt=False)
    after = render(tokenizer, messages + new_messages, tools, add_generation_prompt=True)
    if not after.startswith(before):
        i = _first_difference(before, after)
        raise ChatTemplateError(
            "the chat template renders the conversation history differently once messages are appended "
            f"(first difference at char {i}: {before[i:i + 40]!r} became {after[i:i + 40]!r}); multi-turn "
            "episodes need a template whose rendering of earlier turns never changes")
    glue = assistant_glue(tokenizer, messages, tools)
    if not before.endswith(glue):
        raise ChatTemplateError(f"the chat template's text after an assistant turn ({glue!r}) depends on the content")
    if sampled_tail and glue.startswith(sampled_tail):
        glue = glue[len(sampled_tail):]
    return glue + after[len(before):]


def env_ids_after_turn(tokenizer: Any, messages: list[dict[str, Any]], new_messages: list[dict[str, Any]], *,
                       tools: list[dict[str, Any]] | None, sampled_tail: str = "") -> list[int]:
    """`env_text_after_turn`, tokenised (only this text: the sampled ids are never re-tokenised)."""
    text = env_text_after_turn(tokenizer, messages, new_messages, tools=tools, sampled_tail=sampled_tail)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def stop_token_of_turn(tokenizer: Any, output_ids: list[int], finish_reason: str,
                       stop_token_ids: tuple[int, ...] = ()) -> int | None:
    """The stop token the model sampled to end its turn (its last id), or None (stop string, length, abort)."""
    if finish_reason != "stop" or not output_ids:
        return None
    last = int(output_ids[-1])
    stops = set(stop_token_ids) | set(getattr(tokenizer, "all_special_ids", ()))
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    return last if last in stops else None

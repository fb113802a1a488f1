"""/v1/chat/completions with tools: the official `openai` client against the real server serving the scripted model.

The scripted model's first assistant turn makes two Hermes tool calls (calculator "40+2",
sleep 0.5), its second says "The answer is 42". The server must answer the first turn with
OpenAI `tool_calls` (streamed or not), take the returned assistant message and `tool`
messages back (the scripted template does not know `tool_calls`: they are written back as
Hermes text), keep answering plain text to requests without tools, and refuse malformed
incoming calls with a 400 naming the field. The pure helpers of `async_rl.tool_parsers` are
checked on what the scripted model cannot say (a broken call, a template that knows calls).
"""

import json
from types import SimpleNamespace

import openai
import pytest
import torch
from scripted_model import build_scripted_checkpoint

from async_rl.config import EngineConfig, ModelConfig
from async_rl.models import chat_prompt_ids, load_model, load_tokenizer
from async_rl.tool_parsers import build_tool_parser, chat_template_messages, openai_assistant_message
from async_rl.launch.serve import BackgroundServer

QUESTION = [{"role": "user", "content": "What is 40+2?"}]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("calculator", "sleep")]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    torch.set_num_threads(1)
    cfg = ModelConfig(name=str(build_scripted_checkpoint(tmp_path_factory.mktemp("scripted"))), dtype="float32")
    tok = load_tokenizer(cfg)
    bg = BackgroundServer.for_model(load_model(cfg, seed=0, tokenizer=tok), tok, EngineConfig(kv_cache_mb=16),
                                    model_name="scripted")
    client = openai.OpenAI(base_url=f"{bg.start()}/v1", api_key="unused", max_retries=0, timeout=60)
    yield SimpleNamespace(client=client, tok=tok)
    client.close()
    bg.stop()


def chat(srv, messages, **kw):
    return srv.client.chat.completions.create(model="scripted", messages=messages, max_tokens=64, **kw)


def test_the_tool_call_turn_comes_back_as_tool_calls(srv):
    res = chat(srv, QUESTION, tools=TOOLS)
    choice = res.choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("calculator", {"expression": "40+2"}), ("sleep", {"seconds": 0.5})]
    assert all(c.type == "function" and c.id.startswith("call_") and len(c.id) > 10 for c in calls)
    assert len({c.id for c in calls}) == 2
    assert res.model_extra["prompt_token_ids"] == chat_prompt_ids(srv.tok, QUESTION, TOOLS)
    assert "<tool_call>" in srv.tok.decode(choice.model_extra["token_ids"])  # the exact tokens are still there


def test_without_tools_the_same_turn_is_plain_text(srv):
    choice = chat(srv, QUESTION).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content.startswith('<tool_call>{"name": "calculator"')


def test_the_returned_calls_and_tool_results_go_back_through_the_template(srv):
    first = chat(srv, QUESTION, tools=TOOLS).choices[0].message
    calc, sleep = first.tool_calls
    messages = QUESTION + [first.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": calc.id, "content": "42"},
                           {"role": "tool", "tool_call_id": sleep.id, "content": "slept"}]
    res = chat(srv, messages, tools=TOOLS)
    choice = res.choices[0]
    assert choice.message.content == "The answer is 42" and choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    prompt = srv.tok.decode(res.model_extra["prompt_token_ids"])
    # the template knows no tool_calls: the calls are in the assistant turn as Hermes text
    assert '<t0><tool_call>\n{"name": "calculator", "arguments": {"expression": "40+2"}}\n</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>tool\nslept<|im_end|>\n<|im_start|>assistant\n<t1>")


def test_streaming_with_tools_buffers_the_turn_into_one_delta(srv):
    chunks = list(chat(srv, QUESTION, tools=TOOLS, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks[1:] if c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].content is None
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in deltas[0].tool_calls] == \
        [(0, "calculator", {"expression": "40+2"}), (1, "sleep", {"seconds": 0.5})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the openai client's own accumulation reads it the same way
    with srv.client.chat.completions.stream(model="scripted", messages=QUESTION, tools=TOOLS, max_tokens=64) as s:
        final = s.get_final_completion()
    assert [c.function.name for c in final.choices[0].message.tool_calls] == ["calculator", "sleep"]


@pytest.mark.parametrize("call, field", [
    ({"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{broken"}},
     "messages[1].tool_calls[0].function.arguments"),
    ({"id": "c1", "type": "function", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
    ({"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "[1]"}},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_malformed_incoming_tool_calls_are_400_naming_the_field(srv, call, field):
    messages = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    with pytest.raises(openai.BadRequestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        chat(srv, messages, tools=TOOLS)


# ------------------------------------------------------------------ the shared helpers, on what the script cannot say
def test_a_broken_call_stays_in_the_content_and_good_ones_become_tool_calls():
    text = 'Let me see. <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>' \
           '<tool_call>\n{"name": "calculator", "arguments": {oops}\n</tool_call>'
    message, reason = openai_assistant_message(text, build_tool_parser("hermes"), "stop")
    assert reason == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"expression": "1+1"}]
    assert message["content"] == 'Let me see.\n<tool_call>\n{"name": "calculator", "arguments": {oops}\n</tool_call>'
    only_broken, reason = openai_assistant_message("<tool_call>{nope</tool_call>", build_tool_parser("hermes"), "stop")
    assert reason == "stop" and "tool_calls" not in only_broken and "{nope" in only_broken["content"]
    cut, reason = openai_assistant_message(text, build_tool_parser("hermes"), "length")
    assert reason == "length" and len(cut["tool_calls"]) == 1  # a turn cut by length says so


def test_a_template_that_knows_tool_calls_gets_them_with_dict_arguments():
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2"}'}}
    raw = [{"role": "assistant", "content": None, "tool_calls": [call]},
           {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "2"}]}]
    knows = chat_template_messages(raw, build_tool_parser("hermes"), True)
    assert knows[0] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2"}}}]}
    assert knows[1] == {"role": "tool", "tool_call_id": "call_1", "content": "2"}
    text = chat_template_messages(raw, build_tool_parser("hermes"), False)
    assert "tool_calls" not in text[0]
    assert text[0]["content"] == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2"}}\n</tool_call>'

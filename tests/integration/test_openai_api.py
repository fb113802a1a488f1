"""The OpenAI-compatible routes, driven by the official `openai` Python client against a real server.

Chat (template applied, tools reach the template), streaming chat, completions from text
and from token ids, models, logprobs/top_logprobs, stop strings, seeds, n > 1, the exact
token ids returned for RL, and bad requests answered 400 naming the field.
"""

from types import SimpleNamespace

import openai
import pytest
import torch

from async_rl.config import EngineConfig, ModelConfig
from async_rl.models import CHATML_TEMPLATE, PRINTABLE, build_tiny_tokenizer, chat_prompt_ids, load_model
from async_rl.launch.serve import BackgroundServer

# ChatML that also renders the tools, so the test can see them reach the template
TOOLS_TEMPLATE = "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}" + CHATML_TEMPLATE
MESSAGES = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2+3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def srv():
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(PRINTABLE)
    tok.chat_template = TOOLS_TEMPLATE
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
    bg = BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=16), model_name="tiny-printable")
    client = openai.OpenAI(base_url=f"{bg.start()}/v1", api_key="unused", max_retries=0, timeout=60)
    yield SimpleNamespace(client=client, tok=tok, engine=bg.engine, model=model)
    client.close()
    bg.stop()


def chat(srv, **kw):
    args = dict(model="tiny-printable", messages=MESSAGES, max_tokens=16, temperature=0.0)
    return srv.client.chat.completions.create(**{**args, **kw})


def test_models(srv):
    models = srv.client.models.list().data
    assert [m.id for m in models] == ["tiny-printable"]


def test_chat_returns_text_usage_logprobs_and_the_exact_tokens(srv):
    res = chat(srv, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    choice = res.choices[0]
    prompt = chat_prompt_ids(srv.tok, MESSAGES)
    token_ids = choice.model_extra["token_ids"]
    assert res.object == "chat.completion" and res.model == "tiny-printable"
    assert res.model_extra["prompt_token_ids"] == prompt
    assert res.usage.prompt_tokens == len(prompt) and res.usage.completion_tokens == len(token_ids) == 16
    assert res.usage.total_tokens == len(prompt) + 16 and choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content == srv.tok.decode(token_ids, skip_special_tokens=True)
    content = choice.logprobs.content
    assert [c.token for c in content] == [srv.tok.decode([t]) for t in token_ids]
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the top token
    meta = choice.model_extra["meta_info"]
    assert [e[0] for e in meta["output_token_logprobs"]] == [c.logprob for c in content]
    assert meta["output_token_versions"] == [srv.engine.weight_version] * 16


def test_tools_reach_the_chat_template(srv):
    plain, with_tools = chat(srv, max_tokens=1), chat(srv, max_tokens=1, tools=TOOLS)
    assert with_tools.usage.prompt_tokens == len(chat_prompt_ids(srv.tok, MESSAGES, TOOLS))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_streaming_chat_matches_the_plain_answer(srv):
    kw = dict(max_tokens=24, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    full = chat(srv, **kw)
    chunks = list(chat(srv, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert text == full.choices[0].message.content
    assert tokens == full.choices[0].model_extra["token_ids"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"] and len(set(tokens)) > 5
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_stop_strings_cut_the_text_but_not_the_tokens(srv):
    kw = dict(max_tokens=40, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    text = chat(srv, **kw).choices[0].message.content
    stop = text[20:22]
    res = chat(srv, stop=[stop], **kw).choices[0]
    assert res.finish_reason == "stop" and res.message.content == text[:text.find(stop)]
    assert len(res.message.content) >= 10
    assert srv.tok.decode(res.model_extra["token_ids"]).endswith(stop)  # the tokens are all there
    streamed = chat(srv, stop=stop, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == res.message.content


def test_seeded_sampling_repeats_and_n_gives_distinct_choices(srv):
    a, b = (chat(srv, temperature=1.0, seed=7, max_tokens=12).choices[0].message.content for _ in range(2))
    assert a == b
    res = chat(srv, temperature=1.0, seed=7, max_tokens=12, n=3)
    assert [c.index for c in res.choices] == [0, 1, 2] and res.choices[0].message.content == a
    assert len({c.message.content for c in res.choices}) > 1
    assert res.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in res.choices)


def test_completions_from_text_and_from_token_ids(srv):
    text = srv.client.completions.create(model="m", prompt="12+34=", max_tokens=10, temperature=0.0, logprobs=2,
                                         extra_body={"ignore_eos": True})
    ids = srv.client.completions.create(model="m", prompt=srv.tok.encode("12+34="), max_tokens=10,
                                        temperature=0.0, extra_body={"ignore_eos": True})
    assert text.object == "text_completion" and text.choices[0].text == ids.choices[0].text
    assert text.choices[0].model_extra["token_ids"] == ids.choices[0].model_extra["token_ids"]
    assert text.usage.prompt_tokens == 6 and text.usage.completion_tokens == 10
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    streamed = srv.client.completions.create(model="m", prompt="12+34=", max_tokens=10, temperature=0.0,
                                             stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text
    batch = srv.client.completions.create(model="m", prompt=["1+1=", "2+2="], max_tokens=3, temperature=0.0)
    assert [c.index for c in batch.choices] == [0, 1]


def test_presence_and_frequency_penalties_steer_the_answer(srv):
    """OpenAI's penalties reach the sampler: greedy with them is the model's own argmax after the
    penalties (recomputed here from plain forward passes), and differs from greedy without them."""
    presence, frequency, n = 1.5, 0.75, 12
    kw = dict(max_tokens=n, logprobs=True, extra_body={"ignore_eos": True})
    plain = chat(srv, **kw).choices[0].model_extra["token_ids"]
    res = chat(srv, presence_penalty=presence, frequency_penalty=frequency, **kw)
    got, prompt = res.choices[0].model_extra["token_ids"], res.model_extra["prompt_token_ids"]
    expect, policy = [], []
    for _ in range(n):
        with torch.no_grad():
            logits = srv.model(torch.tensor([prompt + expect])).logits[0, -1].float()  # [V]
        counts = torch.bincount(torch.tensor(expect, dtype=torch.long), minlength=logits.numel()).float()
        token = int((logits - frequency * counts - presence * (counts > 0).float()).argmax())
        expect.append(token)
        policy.append(float(torch.log_softmax(logits, -1)[token]))
    assert got == expect and got != plain
    assert len(set(got)) > len(set(plain))  # the point of the penalties: fewer repeats
    reported = [c.logprob for c in res.choices[0].logprobs.content]  # the policy's, not the penalised draw's
    assert reported == pytest.approx(policy, abs=1e-4)


BAD_CHAT = [
    (dict(temperature=500), "temperature"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"content": "no role"}]), "messages[0].role"),
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=99), "top_logprobs"),
    (dict(n=0), "n"),
    (dict(n=2, stream=True), "n"),
    (dict(max_tokens=10**9), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=1.5), "top_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"bogus": 1}), "bogus"),
    (dict(messages=[{"role": "user", "content": "x" * 600}]), "messages"),  # longer than the context
]


@pytest.mark.parametrize("kw,field", BAD_CHAT, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_CHAT)])
def test_bad_chat_requests_are_400_naming_the_field(srv, kw, field):
    with pytest.raises(openai.BadRequestError) as err:
        res = chat(srv, **kw)
        list(res) if kw.get("stream") else None
    assert field in err.value.message
    assert chat(srv, max_tokens=2).choices[0].finish_reason in ("stop", "length")  # still serving


@pytest.mark.parametrize("kw,field", [(dict(prompt=[10**6]), "prompt"), (dict(prompt=[]), "prompt"),
                                      (dict(prompt="x", echo=True), "echo"),
                                      (dict(prompt="x", extra_body={"best_of": 2}), "best_of")])
def test_bad_completion_requests_are_400_naming_the_field(srv, kw, field):
    with pytest.raises(openai.BadRequestError) as err:
        srv.client.completions.create(model="m", max_tokens=2, **kw)
    assert field in err.value.message

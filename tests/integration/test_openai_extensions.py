"""The vLLM/SGLang sampling extensions on the OpenAI routes, against a real server over HTTP.

Each applied field changes the answer the way its server documents (checked against a plain
forward of the model where it shapes sampling); each field the engine cannot honour is refused
naming it, and accepted at its neutral value; the exact body vLLM's serving benchmark sends is
answered. Field lists: `async_rl/engine/openai_fields.py`.
"""

import json
from types import SimpleNamespace

import httpx
import pytest
import torch
from tokenizers.processors import TemplateProcessing

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine.openai_fields import CHAT_NEUTRAL, METADATA, NEUTRAL
from async_rl.models import CHATML_TEMPLATE, PRINTABLE, build_tiny_tokenizer, chat_prompt_ids, load_model
from async_rl.launch.serve import BackgroundServer

# ChatML with one template variable, so chat_template_kwargs can be seen reaching the template
TEMPLATE = "{% if persona %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}" + CHATML_TEMPLATE
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def srv():
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(PRINTABLE)
    tok.chat_template = TEMPLATE
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
    bg = BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=16), model_name="tiny")
    http = httpx.Client(base_url=bg.start(), timeout=60)
    yield SimpleNamespace(http=http, tok=tok, model=model)
    http.close()
    bg.stop()


def chat(srv, status=200, **kw):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0.0, **kw}
    res = srv.http.post("/v1/chat/completions", json=body)
    assert res.status_code == status, res.text
    return res.json()


def complete(srv, status=200, **kw):
    body = {"model": "tiny", "prompt": "12+34=", "max_tokens": 12, "temperature": 0.0, **kw}
    res = srv.http.post("/v1/completions", json=body)
    assert res.status_code == status, res.text
    return res.json()


def tokens(body) -> list[int]:
    return body["choices"][0]["token_ids"]


def greedy_after(srv, prompt: list[int], n: int, adjust) -> list[int]:
    """n greedy tokens from plain forward passes, each step's logits passed through `adjust(logits, out)`."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = srv.model(torch.tensor([prompt + out])).logits[0, -1].float()  # [V]
        out.append(int(adjust(logits, out).argmax()))
    return out


def test_the_body_vllm_serving_benchmark_sends_is_answered(srv):
    """vllm/benchmarks/lib/endpoint_request_func.py, async_request_openai_completions (vLLM 0.32): a text
    prompt, `repetition_penalty: 1.0`, `logprobs: null`, a stream with usage, and `ignore_eos` with
    --ignore-eos. Before the extensions every such request was answered 400 `repetition_penalty`."""
    body = {"model": "tiny", "prompt": "12+34=", "repetition_penalty": 1.0, "max_tokens": 16, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with srv.http.stream("POST", "/v1/completions", json=body) as res:
        assert res.status_code == 200
        events = [line[6:] for line in res.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 16


def test_repetition_penalty_steers_greedy_like_a_recomputation(srv):
    penalty, prompt = 1.5, "0123456789"  # a prompt where the random model's argmax gives way to the penalty

    def penalised(logits, out):
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[out] = True
        return torch.where(seen & (logits < 0), logits * penalty, torch.where(seen, logits / penalty, logits))
    plain = complete(srv, ignore_eos=True, prompt=prompt)
    res = complete(srv, ignore_eos=True, prompt=prompt, repetition_penalty=penalty)
    expect = greedy_after(srv, res["prompt_token_ids"], 12, penalised)
    assert tokens(res) == expect and tokens(res) != tokens(plain)


def test_top_k_1_and_min_p_1_sample_the_argmax(srv):
    greedy = tokens(complete(srv, ignore_eos=True))
    for kw in ({"top_k": 1}, {"min_p": 1.0}):
        assert tokens(complete(srv, ignore_eos=True, temperature=1.0, seed=3, **kw)) == greedy, kw
    assert tokens(complete(srv, ignore_eos=True, temperature=1.0, seed=3)) != greedy  # sampling differs


def test_logit_bias_and_min_tokens_with_stop_token_ids(srv):
    forced = srv.tok.convert_tokens_to_ids("7")
    assert set(tokens(complete(srv, ignore_eos=True, logit_bias={str(forced): 100}))) == {forced}
    first = tokens(complete(srv, ignore_eos=True))[0]
    assert tokens(complete(srv, stop_token_ids=[first])) == [first]  # stops at once
    held = tokens(complete(srv, stop_token_ids=[first], min_tokens=4))
    assert len(held) > 4 and first not in held[:4]  # no stop before min_tokens: the stop token is not drawn


def test_special_tokens_stop_strings_and_token_id_strings_in_the_text(srv):
    eos = srv.tok.eos_token_id
    kw = dict(ignore_eos=True, max_tokens=3, logit_bias={str(eos): 100})
    assert complete(srv, **kw)["choices"][0]["text"] == ""
    assert complete(srv, skip_special_tokens=False, **kw)["choices"][0]["text"] == srv.tok.decode([eos]) * 3
    text = complete(srv, ignore_eos=True, max_tokens=30, temperature=1.0, seed=5)["choices"][0]["text"]
    stop = text[12:14]
    for keep, name in ((True, "include_stop_str_in_output"), (True, "no_stop_trim"), (False, None)):
        extra = {name: True} if name else {}
        cut = complete(srv, ignore_eos=True, max_tokens=30, temperature=1.0, seed=5, stop=[stop], **extra)
        assert cut["choices"][0]["text"] == text[:text.find(stop) + (len(stop) if keep else 0)], name
    lp = complete(srv, logprobs=1, return_tokens_as_token_ids=True)["choices"][0]
    assert lp["logprobs"]["tokens"] == [f"token_id:{t}" for t in lp["token_ids"]]
    assert all(k.startswith("token_id:") for top in lp["logprobs"]["top_logprobs"] for k in top)


def test_continuous_usage_stats_counts_in_every_chunk(srv):
    body = {"model": "tiny", "prompt": "1+1=", "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    with srv.http.stream("POST", "/v1/completions", json=body) as res:
        chunks = [json.loads(line[6:]) for line in res.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and len(set(counts)) > 2


def test_prompt_shaping_fields_reach_the_tokenizer_and_template(srv):
    assert chat(srv, max_tokens=1)["prompt_token_ids"] == chat_prompt_ids(srv.tok, MESSAGES)
    no_turn = chat(srv, max_tokens=1, add_generation_prompt=False)["prompt_token_ids"]
    assert no_turn == chat_prompt_ids(srv.tok, MESSAGES, add_generation_prompt=False)
    persona = chat(srv, max_tokens=1, chat_template_kwargs={"persona": "You add."})["prompt_token_ids"]
    assert srv.tok.decode(persona).startswith("<|im_start|>system\nYou add.")
    cont = MESSAGES + [{"role": "assistant", "content": "It is"}]
    ids = chat(srv, max_tokens=1, messages=cont, add_generation_prompt=False,
               continue_final_message=True)["prompt_token_ids"]
    assert srv.tok.decode(ids).endswith("It is")
    chat(srv, 400, continue_final_message=True)  # with a generation prompt: contradictory
    post = srv.tok._tokenizer.post_processor  # a tokenizer that adds a BOS, for this test only
    bos = srv.tok.convert_tokens_to_ids("<|im_start|>")
    srv.tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>",
                                                                                                   bos)])
    try:
        assert complete(srv, max_tokens=1)["prompt_token_ids"][0] == bos
        assert complete(srv, max_tokens=1, add_special_tokens=False)["prompt_token_ids"] == srv.tok.encode(
            "12+34=", add_special_tokens=False)
    finally:
        srv.tok._tokenizer.post_processor = post


def neutral_body(table) -> dict:
    return {name: values[0] if values else None for name, values in table.items()}


def test_every_field_at_its_neutral_value_changes_nothing(srv):
    plain_chat, plain = tokens(chat(srv, ignore_eos=True)), tokens(complete(srv, ignore_eos=True))
    meta = {name: "x" for name in METADATA if name != "spaces_between_special_tokens"}
    applied = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "logit_bias": {},
               "stop_token_ids": [], "skip_special_tokens": True, "include_stop_str_in_output": False,
               "spaces_between_special_tokens": True, "response_format": {"type": "text"}}
    kw = {**neutral_body(NEUTRAL), **meta, **applied}
    assert tokens(complete(srv, ignore_eos=True, **kw)) == plain
    assert tokens(chat(srv, ignore_eos=True, **kw, **neutral_body(CHAT_NEUTRAL))) == plain_chat


REFUSED = [("use_beam_search", True), ("bad_words", ["x"]), ("allowed_token_ids", [5]), ("prompt_logprobs", 1),
           ("truncate_prompt_tokens", 4), ("structured_outputs", {"regex": "a"}), ("regex", "a+"),
           ("priority", 1), ("cache_salt", "s"), ("lora_path", "adapter"), ("response_format", {"type": "json_object"}),
           ("best_of", 2), ("thinking_token_budget", 10)]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f for f, _ in REFUSED])
def test_what_the_engine_cannot_honour_is_refused_naming_the_field(srv, field, value):
    for send in (chat, complete):
        msg = send(srv, 400, **{field: value})["error"]["message"]
        assert msg.startswith(f"{field}:"), msg


@pytest.mark.parametrize("field", sorted(NEUTRAL))
def test_every_refusable_field_is_refused_when_set(srv, field):
    assert complete(srv, 400, **{field: "on"})["error"]["message"].startswith(f"{field}:")


def test_chat_only_refusals_and_bad_values_of_applied_fields(srv):
    assert chat(srv, 400, chat_template="{{ x }}")["error"]["message"].startswith("chat_template:")
    assert chat(srv, 400, echo=True)["error"]["message"].startswith("echo:")
    for kw, field in ((dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=2), "min_p"),
                      (dict(min_tokens=50), "min_tokens"), (dict(top_k=-3), "top_k"),
                      (dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias={"999999": 1}), "logit_bias"),
                      (dict(unheard_of=1), "unheard_of")):
        assert field in complete(srv, 400, **kw)["error"]["message"], kw
    assert complete(srv, max_tokens=2)["choices"][0]["finish_reason"] in ("stop", "length")  # still serving

"""The embedded server's native /generate beyond the SGLang contract: what it refuses (naming the field),
penalties and the log-prob rule over HTTP, text trimming, prefill-only requests and /flush_cache."""

import asyncio

import httpx
import pytest
import torch

from async_rl.config import EngineConfig, ModelConfig
from async_rl.engine.sglang_api import generate_body
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.launch.serve import BackgroundServer
from sglang_targets import TEXTS, Target, greedy, streamed_until


@pytest.fixture(scope="module")
def emb(tmp_path_factory):
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
    bg = BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=16), model_name="tiny")
    url = bg.start()
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        yield Target(url, "", [tok.encode(t) for t in TEXTS], exact=True, model=model,
                     extra={"tok": tok, "http": http, "engine": bg.engine})
    bg.stop()


REFUSED = [
    ({"sampling_params": {"regex": "[0-9]+"}}, "sampling_params.regex"),
    ({"sampling_params": {"json_schema": '{"type": "object"}'}}, "sampling_params.json_schema"),
    ({"sampling_params": {"stop_regex": ["a+"]}}, "sampling_params.stop_regex"),
    ({"sampling_params": {"ebnf": "root ::= 'a'"}}, "sampling_params.ebnf"),
    ({"sampling_params": {"beam_width": 4}}, "sampling_params.beam_width"),
    ({"sampling_params": {"frequency_penalty": 3.0}}, "sampling_params.frequency_penalty"),
    ({"sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "sampling_params.min_new_tokens"),
    ({"sampling_params": {"n": 2}, "stream": True}, "sampling_params.n"),
    ({"sampling_params": {"logit_bias": {"99999": 1.0}}}, "sampling_params.logit_bias"),
    ({"sampling_params": {"sampling_seed": 1, "seed": 2}}, "sampling_params.sampling_seed"),
    ({"image_data": "http://x/cat.png"}, "image_data"),
    ({"lora_path": "adapter"}, "lora_path"),
    ({"logprob_start_len": 0, "return_logprob": True}, "logprob_start_len"),
    ({"wat": 1}, "wat"),
]


@pytest.mark.parametrize("extra,field", REFUSED, ids=[f for _, f in REFUSED])
def test_what_the_engine_cannot_honour_is_refused_naming_it(emb, extra, field):
    body = {"input_ids": emb.prompts[0], **extra}
    body["sampling_params"] = {"max_new_tokens": 2, **extra.get("sampling_params", {})}
    resp = emb.extra["http"].post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith(field), resp.text
    ok = emb.extra["http"].post("/generate", json={"input_ids": emb.prompts[0], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def _forward_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def test_penalties_shape_the_draw_but_log_probs_stay_the_policys(emb):
    prompt, http = emb.prompts[3], emb.extra["http"]
    sp = {"max_new_tokens": 40, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 11}
    plain = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": sp}).json()
    pen = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": {
        **sp, "presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 2.0}}).json()
    ids = pen["output_ids"]
    assert len(set(ids)) > len(set(plain["output_ids"])), "penalties make the draw avoid repeats"
    got = torch.tensor([e[0] for e in pen["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, _forward_logprobs(emb.model, prompt, ids, 0.8), atol=1e-4, rtol=0)
    # min_new_tokens: the stop token (EOS) cannot come before it; logit_bias forces a token
    eos = sorted(emb.extra["engine"].engine.eos_token_ids)[0]
    forced = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "logit_bias": {str(eos): 100.0}, "min_new_tokens": 3}}).json()
    assert forced["output_ids"][3] == eos and eos not in forced["output_ids"][:3] and len(forced["output_ids"]) == 4
    assert forced["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_text_trimming_prefill_only_and_flush_cache(emb):
    http, tok, prompt = emb.extra["http"], emb.extra["tok"], emb.prompts[0]
    free = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}).json()
    stop = tok.decode(free["output_ids"][3:5])
    cut = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}}).json()
    kept = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stop": [stop], "no_stop_trim": True}}).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["output_ids"] == kept["output_ids"] and kept["text"].endswith(stop) and not cut["text"].endswith(stop)
    empty = http.post("/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 0}}).json()
    assert empty["output_ids"] == [] and empty["meta_info"]["prompt_tokens"] == len(tok.encode("1+1="))
    assert http.post("/flush_cache").status_code == 200

    async def flush_while_running():
        async with httpx.AsyncClient(base_url=emb.url, timeout=60, trust_env=False) as c:
            _, probe = await streamed_until(emb.url, generate_body(prompt, greedy(), "flushed"), 5)
            refused = await c.get("/flush_cache")
            await c.post("/abort_request", json={"rid": "flushed"})
            await probe
            return refused.status_code

    assert asyncio.run(flush_while_running()) == 400

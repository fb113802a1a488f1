"""Engine parity: a generation server's log-probs held to a transformers forward of the same weights.

    err = await check_parity(client, cfg, "engine.backend=vllm (http://...)")   # RuntimeError when it disagrees

The trainer's importance weights compare the behaviour log-probs a server reports with its own
forward, so a server whose numbers are wrong (a broken kernel, a stale LM head after a reload)
corrupts training silently. This check asks for a greedy continuation of a fixed prompt and
recomputes the log-prob of every token the server chose with the model's reference forward
(fp32, on this CPU); the largest gap must stay within what the server's dtype explains.
Launchers run it on every server they start (before it serves the run), and the backend
conformance suite after a weight update.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import torch

from async_rl.config import Config, ModelConfig
from async_rl.models import load_model, load_tokenizer
from async_rl.types import SamplingParams

PROMPT = "12+34=46\n7+8="  # characters every tokenizer here has (the tiny one's alphabet included)
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 0.35, torch.float16: 0.15}  # largest log-prob gap allowed


def _fp32(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, dtype="float32")


@functools.lru_cache(maxsize=2)
def _reference(model: str, seed: int) -> Any:
    return load_model(_fp32(ModelConfig(**json.loads(model))), seed=seed)


def reference_logprobs(cfg: Config, prompt: list[int], output: list[int], state: dict[str, torch.Tensor] | None = None
                       ) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under the configured model's fp32 forward (`state`: other weights)."""
    model = _reference(json.dumps(dataclasses.asdict(cfg.model), sort_keys=True), cfg.seed)
    if state is not None:
        model = load_model(_fp32(cfg.model), seed=cfg.seed)
        model.load_state_dict(state, strict=False)
        model.tie_weights()
    ids = torch.tensor([prompt + output])  # [1, P + N]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [P + N, V]
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


async def check_parity(client: Any, cfg: Config, what: str, *, dtype: torch.dtype = torch.float32,
                       tokens: int = 8, state: dict[str, torch.Tensor] | None = None) -> float:
    """The largest gap between the server's greedy log-probs and the reference's; RuntimeError naming `what`
    when it exceeds the tolerance of the server's `dtype`."""
    prompt = [int(t) for t in load_tokenizer(cfg.model).encode(PROMPT, add_special_tokens=False)]
    out = await client.generate(prompt, SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True))
    ref = reference_logprobs(cfg, prompt, list(out.output_ids), state)
    gap = max(abs(a - b) for a, b in zip(out.output_logprobs, ref))
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    if gap > tol:
        raise RuntimeError(f"{what}: its greedy log-probs differ from a transformers forward of the same weights "
                           f"by up to {gap:.3g} (allowed {tol:g} in {str(dtype).removeprefix('torch.')}): it computes "
                           "another model than the trainer; refusing it")
    return gap

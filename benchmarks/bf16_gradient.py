"""Does a bf16-autocast train step point where the fp32 one does? The demo's GRPO gradient, both ways.

Single runs of the demo once found both async_rl and TRL learning far less under bf16 autocast than
in fp32 (benchmarks/results/HISTORY.md, `benchmarks/vs_trl.py`). This measures the step itself, on real batches of the
demo's task (SmolLM2-135M, 4 prompts x 8 answers sampled at temperature 0.7, 24 new tokens, GRPO
advantages, the trainer's own `token_logprobs` and decoupled PPO loss at ratio 1):

- the gradient under bf16 autocast (fp32 master weights, as `trainer.compute_dtype=bfloat16`) against
  the fp32 one on the same batch: cosine, relative error, and the share of elements whose sign agrees
  (Adam's first step is lr x sign(g) per element, so a wrong sign is a full-size wrong step);
- the same between two fp32 gradients on two batches of the same prompts (other samples): the
  sampling noise every RL step carries anyway, the scale the bf16 error is to be read against;
- how much of one Adam step at the demo's rate (2e-5, an lr x sign(g) step) a bf16 copy of the
  weights sees: the share of weights whose bf16 value changes (the engine and the autocast forward
  run those);
- the forward + backward time in each precision (median of 3).

    python benchmarks/bf16_gradient.py     # 3 batches (seeds 0-2): benchmarks/results/bf16_gradient.{md,json}
    python benchmarks/bf16_gradient.py --batches 1 --prompts 1 --group 4 --name bf16_gradient_smoke   # a smoke check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import median_range, write_results  # noqa: E402


def sample_batch(model, tok, task, prompts, group: int, seed: int, max_new: int):
    """(input_ids [N, L], attention_mask [N, L], loss_mask [N, L-1], rewards [N]) for `group` answers a prompt."""
    import torch

    from async_rl.models import chat_prompt_ids, eos_token_ids

    eos = eos_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    rows, masks, rewards = [], [], []
    torch.manual_seed(seed)
    for sample in prompts:
        ids = torch.tensor([chat_prompt_ids(tok, sample.messages)] * group)  # [G, P]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.7, top_k=0,
                                 top_p=1.0, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=pad)
        for seq in out:
            resp = seq[ids.shape[1]:].tolist()
            n = next((i + 1 for i, t in enumerate(resp) if t in eos), len(resp))  # the answer and its stop token
            rows.append(ids[0].tolist() + resp[:n])
            masks.append([0] * (ids.shape[1] - 1) + [1] * n)
            rewards.append(task.reward(sample, tok.decode(resp[:n], skip_special_tokens=True)))
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    loss_mask = torch.tensor([m + [0] * (width - 1 - len(m)) for m in masks], dtype=torch.float32)
    return input_ids, attention, loss_mask, rewards


def gradient(model, batch, group: int, dtype) -> tuple["torch.Tensor", float]:
    """The flat fp32 gradient of the trainer's loss on `batch` with compute in `dtype`, and its forward+backward s."""
    import contextlib

    import torch

    from async_rl.trainer.advantages import group_advantages
    from async_rl.trainer.logprobs import token_logprobs
    from async_rl.trainer.loss import decoupled_ppo_loss

    input_ids, attention, loss_mask, rewards = batch
    adv = group_advantages(rewards, [i // group for i in range(len(rewards))], std_norm=True)
    adv = adv[:, None].expand_as(loss_mask)  # [N, L-1]
    model.zero_grad(set_to_none=True)
    cast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    t0 = time.perf_counter()
    with cast:
        lp = token_logprobs(model, input_ids, attention, 0.7, score_mask=loss_mask)  # [N, L-1]
    loss, _ = decoupled_ppo_loss(lp, lp.detach(), lp.detach(), adv, loss_mask, eps_clip=0.2, behav_weight_cap=5.0)
    loss.backward()
    took = time.perf_counter() - t0
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in model.parameters()])
    return flat, took


def compare(a, b) -> dict[str, float]:
    """Cosine, |b - a| / |a|, and the sign agreement over the elements where both are nonzero."""
    import torch

    both = (a != 0) & (b != 0)
    a, b = a.double(), b.double()  # float32 sums over 1e8 elements are off by percents
    return {"cosine": float(a @ b / (a.norm() * b.norm())), "rel_err": float((b - a).norm() / a.norm()),
            "sign_agree": float((torch.sign(a[both]) == torch.sign(b[both])).float().mean()) if both.any() else 1.0}


def bf16_visible(model, g, lr: float) -> float:
    """Share of weights whose bf16 copy changes under one lr x sign(g) step (Adam's first step) of the fp32 weights."""
    import torch

    w = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    moved = (w - lr * torch.sign(g)).bfloat16() != w.bfloat16()
    return float(moved[g != 0].float().mean())


def measure(args, seed: int, model, tok, task) -> dict:
    import itertools

    import torch

    prompts = list(itertools.islice(task.train_samples(seed), args.prompts))
    first = sample_batch(model, tok, task, prompts, args.group, 1000 + seed, args.max_new_tokens)
    second = sample_batch(model, tok, task, prompts, args.group, 2000 + seed, args.max_new_tokens)
    times = {"fp32": [], "bf16": []}
    for _ in range(3):
        g32, t32 = gradient(model, first, args.group, torch.float32)
        g16, t16 = gradient(model, first, args.group, torch.bfloat16)
        times["fp32"].append(t32)
        times["bf16"].append(t16)
    other, _ = gradient(model, second, args.group, torch.float32)
    bf = compare(g32, g16)
    noise = compare(g32, other)
    return {"seed": seed, "tokens": int(first[2].sum()), "reward_mean": statistics.mean(first[3]),
            **{f"bf16_{k}": v for k, v in bf.items()}, **{f"batches_{k}": v for k, v in noise.items()},
            "grad_norm_fp32": float(g32.norm()), "grad_norm_bf16": float(g16.norm()),
            "bf16_visible_share": bf16_visible(model, g32, args.lr),
            "fwd_bwd_s_fp32": statistics.median(times["fp32"]), "fwd_bwd_s_bf16": statistics.median(times["bf16"])}


ROWS = [("gradient cosine", "bf16_cosine", "batches_cosine", ".3f"),
        ("relative error |g' - g| / |g|", "bf16_rel_err", "batches_rel_err", ".3f"),
        ("sign agreement (Adam's first step)", "bf16_sign_agree", "batches_sign_agree", ".3f"),
        ("gradient norm (bf16; fp32)", "grad_norm_bf16", "grad_norm_fp32", ".3g"),
        ("forward + backward s (bf16; fp32)", "fwd_bwd_s_bf16", "fwd_bwd_s_fp32", ".2f")]


def table(rows: list[dict], lr: float) -> str:
    lines = ["| measure | bf16 autocast vs fp32, same batch | fp32 vs fp32, two batches of the same prompts |",
             "|---|---|---|"]
    for name, bf, base, spec in ROWS:
        cells = (median_range([r[k] for r in rows], spec) for k in (bf, base))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"| weights whose bf16 copy moves in one Adam step at lr {lr:g} | "
                 f"{median_range([r['bf16_visible_share'] for r in rows], '.3f')} | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=3, help="batches, one per seed 0..N-1")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--name", default="bf16_gradient")
    args = ap.parse_args()

    import torch

    from async_rl.config import load_config
    from async_rl.models import load_model, load_tokenizer
    from async_rl.tasks import build_task

    cfg = load_config(ROOT / "configs" / "smollm2_arith.yaml", ["model.dtype=float32"])
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tokenizer=tok)
    model.config.use_cache = True
    task = build_task(cfg.task)
    torch.manual_seed(0)
    rows = [measure(args, seed, model, tok, task) for seed in range(args.batches)]
    text = table(rows, args.lr)
    print(text)
    note = (f"\n\n{args.batches} batch(es) of {args.prompts} prompts x {args.group} answers of the demo's task "
            f"(`configs/smollm2_arith.yaml`, SmolLM2-135M), one per seed; median (min-max) over them. The loss "
            "is the trainer's decoupled PPO at ratio 1 with GRPO advantages (the policy gradient of a first "
            "minibatch); the bf16 gradient is taken under torch.autocast(bfloat16) with fp32 master weights, as "
            "`trainer.compute_dtype=bfloat16` does. Sign agreement counts the elements nonzero in both.")
    write_results(args.name, text + note, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()

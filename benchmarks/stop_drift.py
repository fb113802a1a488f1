"""Does a checkpoint still stop after its answer? The arithmetic demo's collapse, measured.

The demo's reward reads the last number of a response (`task.answer_pick=last`), and a healthy
policy answers "a + b = c<|im_end|>". A run whose held-out accuracy falls back after its peak can
have stopped stopping: after a correct "a + b = c" it writes "\\n\\nThe answer is X" (X a second,
often wrong, guess, which the reward reads) or repeats the equation until `max_new_tokens`.

Per checkpoint (an HF model directory: `run_dir/checkpoints/step_N`, or the base model under
`~/.cache/async_rl/`): P(<|im_end|> | prompt + the correct "a + b = c"), teacher-forced, over a
grid of sums (median, min-max), and greedy answers to a subset: the share that stop right after
the equation, the share answered correctly, the mean answer length in tokens.

    python benchmarks/stop_drift.py ~/.cache/async_rl/smollm2-135m-instruct runs/demo_0/checkpoints/step_000014

Writes benchmarks/results/stop_drift.md and .json (`--name` to change).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from async_rl.rewards.math import exact_number_reward  # noqa: E402
from async_rl.tasks.arith import CHAT_QUESTION  # noqa: E402
from benchmarks.common import write_results  # noqa: E402

STOP = "<|im_end|>"


def prompt_ids(tok, a: int, b: int) -> list[int]:
    msgs = [{"role": "user", "content": CHAT_QUESTION.format(a=a, op="+", b=b)}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def judge(text: str, answer: int) -> tuple[bool, bool]:
    """One greedy answer, read two ways: correct (the demo's own reward: its last number is the sum), and
    ended (a number or "a + b = c", then the stop token, nothing more)."""
    correct = exact_number_reward(text.replace(STOP, ""), str(answer), "last") == 1.0
    ended = re.fullmatch(r"\s*(\d+\s*\+\s*\d+\s*=\s*)?-?\d+\.?\s*" + re.escape(STOP), text)
    return correct, ended is not None


@torch.no_grad()
def measure(path: str, sums: list[tuple[int, int]], greedy: list[tuple[int, int]], max_new: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    stop = tok.convert_tokens_to_ids(STOP)
    p_stop = []
    for a, b in sums:
        ids = prompt_ids(tok, a, b) + tok.encode(f"{a} + {b} = {a + b}", add_special_tokens=False)
        p_stop.append(model(torch.tensor([ids])).logits[0, -1].float().softmax(-1)[stop].item())
    stopped = correct = 0
    lengths = []
    examples = []
    for a, b in greedy:
        ids = torch.tensor([prompt_ids(tok, a, b)])
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=stop,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop)
        new = out[0, ids.shape[1]:].tolist()
        text = tok.decode(new)
        lengths.append(len(new))
        ok, ended = judge(text, a + b)
        correct += ok
        stopped += ended
        if len(examples) < 3:
            examples.append(text)
    n = len(greedy)
    return {"path": path, "p_stop_median": statistics.median(p_stop), "p_stop_min": min(p_stop),
            "p_stop_max": max(p_stop), "greedy_stops_after_answer": stopped / n, "greedy_correct": correct / n,
            "greedy_len_mean": statistics.mean(lengths), "examples": examples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", help="HF model directories")
    ap.add_argument("--greedy", type=int, default=32, help="problems answered greedily per checkpoint")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--name", default="stop_drift")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sums = [(a, b) for a in range(0, 20, 2) for b in range(1, 20, 2)]  # 100 sums, operands 0..19
    greedy = sums[::max(1, len(sums) // args.greedy)][:args.greedy]
    rows = [measure(p, sums, greedy, args.max_new_tokens) for p in args.checkpoints]
    lines = ["| checkpoint | P(stop after the correct equation), median (min-max) over 100 sums | greedy: stops after "
             f"the answer | greedy: correct | greedy: mean tokens | a greedy answer |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['path']}` | {r['p_stop_median']:.3f} ({r['p_stop_min']:.3f}-{r['p_stop_max']:.3f}) | "
                     f"{r['greedy_stops_after_answer']:.2f} | {r['greedy_correct']:.2f} | {r['greedy_len_mean']:.1f} | "
                     f"`{r['examples'][0]!r}` |")
    lines += ["", f"Greedy answers: {len(greedy)} of the 100 sums, at most {args.max_new_tokens} new tokens; "
              "correct = the last number of the answer is the sum (the demo's reward); stops after the answer = "
              "the answer is a number or \"a + b = c\" and then the stop token."]
    path = write_results(args.name, "\n".join(lines), {"rows": rows})
    print(path.read_text())


if __name__ == "__main__":
    main()

"""async_rl against TRL's `GRPOTrainer` on the demo: same task, model, machine, batch shape and held-out set.

    pip install -c constraints.txt '.[trl]'     # TRL is an optional extra
    python benchmarks/vs_trl.py                 # 3 runs of each: async_rl as `make demo` runs it, then TRL
    python benchmarks/vs_trl.py --ours mode=sync --runs 1
    python benchmarks/vs_trl.py --seeds 0 1 2        # one run of each per seed: TRL repeats a seed exactly

Both train SmolLM2-135M-Instruct (`configs/smollm2_arith.yaml`: addition word problems over operands
0..19, chat prompts, exact-answer reward) for `total_steps` steps of `batch_size` answers in groups of
`group_size` (4 prompts x 8 answers), temperature 0.7, at most 24 new tokens, AdamW at the config's
learning rate (constant), no KL term, on the same training prompts in the same order, and are scored
on the same 128 held-out sums (greedy, 24 tokens) every `eval_every` steps.

- async_rl: `async-rl run --config configs/smollm2_arith.yaml` (its default mode and bound; `--ours`
  overrides), the rollout and trainer pools splitting the cores; its evaluation runs on the rollout
  engine beside training. Times are the run's own wall clock from its first generation.
- TRL: `GRPOTrainer` with `num_generations=group_size`, `per_device_train_batch_size=batch_size`,
  one generation batch per step (on-policy), TRL's default loss (`dapo`) and group reward scaling,
  `transformers` generation (no vLLM on a CPU), fp32 weights with the whole run under bf16 autocast
  where the CPU runs bf16 natively (as async_rl's `dtype: auto`), all cores. Its evaluation
  pauses training; its time is left out of TRL's wall clock. Under bf16 autocast TRL hardly learns
  on this task (measured, benchmarks/results/HISTORY.md): compare at each side's best with `--trl autocast=false
  learning_rate=2e-5 gradient_checkpointing=false` (the demo config already trains async_rl in fp32 at 2e-5).

Per run: held-out accuracy before, at every evaluation and after, and the training wall clock
at each. The table gives medians (min-max) over the runs, the seconds per step, and the training
time each system takes to first reach the accuracy both reach (the lower of the two median final
accuracies); a plot draws every run's curve. Writes benchmarks/results/vs_trl.{md,json,png}.
`--quick` (2 steps, 16 held-out problems, 1 run) only checks that both sides run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, drop_bulk, write_results  # noqa: E402
from benchmarks.demo import rows  # noqa: E402

CONFIG = "configs/smollm2_arith.yaml"


def ours(run_dir: Path, overrides: list[str]) -> dict:
    """One `async-rl run` of the demo; its curve as [(training wall s, held-out accuracy)]."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", "run", "--config", CONFIG, f"run_dir={run_dir}",
                        "log.progress=false", *overrides], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"async_rl run failed ({p.returncode}): {p.stderr[-2000:]}")
    drop_bulk(run_dir)  # SmolLM2's checkpoints with Adam state: GBs a run
    evals = rows(run_dir / "eval.jsonl")
    metrics = rows(run_dir / "metrics.jsonl")
    started = next(r["time"] for r in rows(run_dir / "rollout_metrics.jsonl") if "rollout/generation_started" in r)
    train_s = metrics[-1]["time"] - started
    curve = [(0.0, next(e for e in evals if e["when"] == "before")["eval/accuracy"])]
    curve += [(e["timing/train_wall_s"], e["eval/accuracy"]) for e in evals if e["when"] == "periodic"]
    curve.append((train_s, next(e for e in reversed(evals) if e["when"] == "after")["eval/accuracy"]))
    return {"curve": curve, "train_s": train_s, "steps": len(metrics), "process_s": time.monotonic() - t0,
            "eval_n": evals[-1]["eval/n"]}


def trl_worker(out: Path, steps: int, eval_size: int, settings: dict, seed: int | None = None) -> None:
    """One TRL GRPOTrainer run (in its own process: its threads and memory are its own)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_rl.config import load_config
    from async_rl.models import load_model, load_tokenizer
    from async_rl.tasks import build_task
    from async_rl.utils.hardware import resolve_dtype

    cfg = load_config(ROOT / CONFIG, [f"total_steps={steps}", f"task.eval_size={eval_size}",
                                      *([f"seed={seed}"] if seed is not None else [])])
    task = build_task(cfg.task)
    tokenizer = load_tokenizer(cfg.model)
    tokenizer.padding_side = "left"
    model = load_model(dataclasses.replace(cfg.model, dtype="float32"), seed=cfg.seed, tokenizer=tokenizer)
    model.train()
    # `--trl autocast=false`: fp32 throughout (the harness's own switch, not a GRPOConfig field)
    bf16 = settings.pop("autocast", True) and resolve_dtype("auto", torch.device("cpu")).dtype == torch.bfloat16
    prompts_per_step = cfg.trainer.batch_size // cfg.rollout.group_size
    stream = task.train_samples(cfg.seed)
    train = [next(stream) for _ in range(steps * prompts_per_step)]
    by_id = {s.id: s for s in train}
    held_out = task.eval_samples()
    dataset = Dataset.from_list([{"prompt": s.messages, "sample_id": s.id} for s in train])

    cut_pays = cfg.rollout.truncated_reward  # async_rl's rollout.truncated_reward, the same rule on TRL's side

    def cut(ids) -> bool:  # ran to max_completion_length without an end-of-sequence token
        return len(ids) >= cfg.rollout.max_new_tokens and tokenizer.eos_token_id not in list(ids)

    def reward(prompts, completions, sample_id, completion_ids=None, **_):
        scores = [task.reward(by_id[i], c[0]["content"] if isinstance(c, list) else c)
                  for i, c in zip(sample_id, completions)]
        if cut_pays is None or completion_ids is None:
            return scores
        return [cut_pays if cut(ids) else r for r, ids in zip(scores, completion_ids)]

    def accuracy() -> float:
        model.eval()
        right = 0.0
        with torch.no_grad():
            for k in range(0, len(held_out), 64):
                batch = held_out[k:k + 64]
                texts = [tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
                         for s in batch]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, do_sample=False, max_new_tokens=cfg.rollout.eval_max_new_tokens,
                                     pad_token_id=tokenizer.pad_token_id)
                answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                right += sum(task.reward(s, a) for s, a in zip(batch, answers))
        model.train()
        return right / len(held_out)

    class Clock(TrainerCallback):
        """Held-out accuracy every eval_every steps; evaluation time is left out of the training clock."""

        def __init__(self):
            self.t0, self.paused, self.curve = None, 0.0, []

        def _eval(self, step: int) -> None:
            t = time.monotonic()
            train_s = 0.0 if self.t0 is None else t - self.t0 - self.paused
            self.curve.append((train_s, accuracy(), step))
            self.paused += time.monotonic() - t

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.monotonic()
            self._eval(0)
            self.paused = time.monotonic() - self.t0

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % cfg.rollout.eval_every == 0 or state.global_step == steps:
                self._eval(state.global_step)

    clock = Clock()
    if cfg.trainer.lr_decay_steps not in (0, steps):
        raise ValueError("trainer.lr_decay_steps: TRL decays over its max_steps; leave it 0 for a comparison")
    args = GRPOConfig(
        output_dir=str(out.parent / "trl_out"), max_steps=steps, per_device_train_batch_size=cfg.trainer.batch_size,
        num_generations=cfg.rollout.group_size, steps_per_generation=1, gradient_accumulation_steps=1,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        learning_rate=cfg.trainer.lr, **_trl_schedule(cfg.trainer, steps),
        warmup_steps=cfg.trainer.lr_warmup_steps, weight_decay=cfg.trainer.weight_decay,
        max_grad_norm=cfg.trainer.grad_clip, beta=0.0, epsilon=cfg.trainer.eps_clip, shuffle_dataset=False,
        use_cpu=True, bf16=False, save_strategy="no", report_to="none", logging_steps=1, seed=cfg.seed,
        disable_tqdm=True, optim="adamw_torch")
    for key, value in settings.items():  # --trl overrides, checked against GRPOConfig's own fields
        if not hasattr(args, key):
            raise SystemExit(f"--trl {key}: GRPOConfig has no such field")
        setattr(args, key, value)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    out.write_text(json.dumps({"curve": [(t, a) for t, a, _ in clock.curve], "steps": steps,
                               "reward": [h["reward"] for h in logged],
                               "grad_norm": [h.get("grad_norm") for h in logged],
                               "train_s": clock.curve[-1][0], "eval_n": len(held_out),
                               "dtype": "bf16 autocast" if bf16 else "fp32", "threads": torch.get_num_threads()}))


def trl_run(run_dir: Path, steps: int, eval_size: int, settings: dict, seed: int | None = None) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "trl.json"
    out.unlink(missing_ok=True)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, __file__, "--trl-worker", str(out), "--steps", str(steps),
                        "--eval-size", str(eval_size), "--trl-settings", json.dumps(settings),
                        *(["--seed", str(seed)] if seed is not None else [])],
                       cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"TRL run failed ({p.returncode}): {p.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "process_s": time.monotonic() - t0}


def trl_overrides(pairs: list[str]) -> dict:
    """`--trl field=value ...` as a dict: JSON scalars (2e-5, false, null), anything else a string (dapo)."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--trl {pair!r}: expected FIELD=VALUE")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return settings


def first_reach(curve: list[list[float]], target: float) -> float | None:
    return next((t for t, a in curve if a >= target - 1e-9), None)


def spread(values: list[float | None], fmt: str = "{:.3g}") -> str:
    got = [v for v in values if v is not None]
    if not got:
        return f"not reached ({len(values)} runs)"
    cell = f"{fmt.format(statistics.median(got))} ({fmt.format(min(got))}-{fmt.format(max(got))})"
    return cell + ("" if len(got) == len(values) else f", reached in {len(got)} of {len(values)}")


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, rs), color in zip(runs.items(), ("tab:blue", "tab:orange")):
        for k, r in enumerate(rs):
            ts, accs = zip(*r["curve"])
            ax.plot(ts, accs, marker="o", color=color, alpha=0.7, label=name if k == 0 else None)
    ax.set_xlabel("training wall clock, s")
    ax.set_ylabel("held-out accuracy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _trl_schedule(trainer, steps: int) -> dict:
    """GRPOConfig's scheduler fields for async_rl's trainer.lr_schedule (both decay over the steps)."""
    if trainer.lr_schedule == "constant":
        return {"lr_scheduler_type": "constant_with_warmup" if trainer.lr_warmup_steps else "constant"}
    if trainer.lr_hold_steps or trainer.lr_min_ratio:  # transformers' warmup-stable-decay: the same shape
        decay = steps - trainer.lr_warmup_steps - trainer.lr_hold_steps
        return {"lr_scheduler_type": "warmup_stable_decay",
                "lr_scheduler_kwargs": {"num_stable_steps": trainer.lr_hold_steps, "num_decay_steps": decay,
                                        "min_lr_ratio": trainer.lr_min_ratio, "decay_type": trainer.lr_schedule}}
    # linear, cosine: the same names and decay shapes in transformers (its warm-up ramps from 0, ours from
    # 1/(warmup+1): the same only without warm-up)
    return {"lr_scheduler_type": trainer.lr_schedule}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each system, alternating")
    ap.add_argument("--ours", nargs="*", default=[], help="overrides for the async_rl runs (e.g. mode=sync)")
    ap.add_argument("--trl", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="GRPOConfig overrides for the TRL runs (e.g. learning_rate=2e-5 gradient_checkpointing=false); "
                         "autocast=false runs TRL in fp32 instead of under bf16 autocast")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="one run of each system per seed (its training prompts, sampling and initial shuffle); "
                         "TRL is deterministic for a seed, so repeats of one seed are one sample: compare over seeds")
    ap.add_argument("--only", choices=("async_rl", "TRL"), help="run one system only (a settings sweep)")
    ap.add_argument("--name", default=None, help="results file name (default vs_trl)")
    ap.add_argument("--quick", action="store_true", help="2 steps, 16 held-out problems, 1 run: a smoke check")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--eval-size", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trl-settings", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(Path(args.trl_worker), args.steps, args.eval_size, json.loads(args.trl_settings), args.seed)
    trl_settings = trl_overrides(args.trl)
    try:
        from trl import __version__ as trl_version
    except ImportError:
        raise SystemExit("benchmarks/vs_trl.py needs TRL: pip install -c constraints.txt '.[trl]'") from None
    from async_rl.config import load_config

    base = load_config(ROOT / CONFIG, args.ours)
    steps, eval_size = (2, 16) if args.quick else (base.total_steps, base.task.eval_size)
    seeds = [None] * (1 if args.quick else args.runs) if args.seeds is None else args.seeds
    runs_n = len(seeds)
    extra = ["total_steps=2", "task.eval_size=16", "rollout.eval_every=1"] if args.quick else []
    runs: dict[str, list[dict]] = {s: [] for s in ("async_rl", "TRL") if args.only in (None, s)}
    for k, seed in enumerate(seeds):  # alternating, so drift on the machine hits both
        seeded = [] if seed is None else [f"seed={seed}"]
        if "async_rl" in runs:
            runs["async_rl"].append(ours(ROOT / "runs" / "vs_trl" / f"ours_{k}", [*args.ours, *extra, *seeded]))
        if "TRL" in runs:
            runs["TRL"].append(trl_run(ROOT / "runs" / "vs_trl" / f"trl_{k}", steps, eval_size, trl_settings, seed))
        for name, rs in runs.items():
            print(f"run {k} {name}: {rs[-1]['train_s']:.0f} s, accuracy "
                  f"{' -> '.join(f'{a:.3f}' for _, a in rs[-1]['curve'])}", flush=True)
    finals = {name: statistics.median(r["curve"][-1][1] for r in rs) for name, rs in runs.items()}
    common = min(finals.values())
    described = []
    if "async_rl" in runs:
        described.append(f"async_rl: `async-rl run --config {CONFIG}`{' ' + ' '.join(args.ours) if args.ours else ''} "
                         f"({base.mode}, max_staleness {base.max_staleness})")
    if "TRL" in runs:
        described.append(f"TRL {trl_version} GRPOTrainer ({runs['TRL'][0]['dtype']}, {runs['TRL'][0]['threads']} "
                         f"threads{', ' + ' '.join(args.trl) if args.trl else ''})")
    lines = ["; ".join(described) + f". {steps} steps of {base.trainer.batch_size} answers, {eval_size} held-out "
             f"problems; {runs_n} run(s) each{', alternating' if len(runs) > 1 else ''}"
             f"{'' if args.seeds is None else ', seeds ' + ' '.join(map(str, args.seeds)) + ' (one run per seed)'}"
             ": median (min-max).", "",
             "| system | training wall clock s | s per step | held-out accuracy before | after | best | "
             f"time to {common:.3f} (all reach it) |", "|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        lines.append(f"| {name} | {spread([r['train_s'] for r in rs])} | "
                     f"{spread([r['train_s'] / r['steps'] for r in rs])} | "
                     f"{spread([r['curve'][0][1] for r in rs])} | {spread([r['curve'][-1][1] for r in rs])} | "
                     f"{spread([max(a for _, a in r['curve']) for r in rs])} | "
                     f"{spread([first_reach(r['curve'], common) for r in rs], '{:.0f}')} |")
    times = {name: [first_reach(r["curve"], common) for r in rs] for name, rs in runs.items()}
    if len(runs) == 2 and all(v is not None for vs in times.values() for v in vs):
        ratio = statistics.median(times["TRL"]) / max(statistics.median(times["async_rl"]), 1e-9)
        lines += ["", f"Time to {common:.3f} held-out accuracy, TRL / async_rl: {ratio:.2f}x (medians)."]
    if "TRL" in runs:
        lines += ["", "TRL's training reward per step (run 0): "
                  + " ".join(f"{x:.2f}" for x in runs["TRL"][0].get("reward", []))]
    lines += ["", "Curves (training wall s, accuracy) of every run:", ""]
    lines += [f"- {name} {k}: {json.dumps([[round(t, 1), a] for t, a in r['curve']])}"
              for name, rs in runs.items() for k, r in enumerate(rs)]
    name = args.name or ("vs_trl_quick" if args.quick else "vs_trl")
    plot(runs, RESULTS / f"{name}.png")
    out = write_results(name, "\n".join(lines) + f"\n\n![curves]({name}.png)", {"runs": runs, "common": common})
    print(out.read_text())


if __name__ == "__main__":
    main()

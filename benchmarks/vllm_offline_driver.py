"""Runs inside the vLLM environment (never imports async_rl): vLLM's offline `LLM.generate` on a
workload it is handed, one timed round per command, the model loaded (and compiled) once.

    python vllm_offline_driver.py MODEL_DIR DTYPE MAX_MODEL_LEN WORK_JSON < commands

WORK_JSON holds [[prompt token ids, max_new_tokens], ...]. Each line on stdin is a command:
`warm N` runs the first N requests, `run` runs them all; each answers one line on stdout,
`RESULT {"seconds", "generated"}`, and EOF ends. vLLM's own logs (its processes write to stdout)
go to stderr. Sampling as `benchmarks/engine_throughput.py` samples:
temperature 1 over the full vocabulary (top_p 1, top_k off), EOS ignored, so every request
produces exactly its max_new_tokens. Between commands the process waits on stdin, so it costs
no CPU while the embedded engine's round runs beside it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model_dir, dtype, max_len, work_path = sys.argv[1:5]
    results = os.fdopen(os.dup(1), "w")  # answers only; fd 1 (inherited by vLLM's processes) becomes stderr
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams

    work = json.load(open(work_path))
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=int(max_len), seed=0)
    prompts = [{"prompt_token_ids": ids} for ids, _ in work]
    # no per-request seed: vLLM 0.32's CPU sampler fails a batch with seeded rows ("CPU Generator does not
    # use offset"); the LLM's seed makes the run repeatable
    params = [SamplingParams(max_tokens=new, min_tokens=new, ignore_eos=True, temperature=1.0, top_p=1.0, top_k=0)
              for _, new in work]
    print("RESULT " + json.dumps({"ready": True}), file=results, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        n = int(cmd[1]) if cmd[0] == "warm" else len(work)
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:n], params[:n], use_tqdm=False)
        seconds = time.perf_counter() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        print("RESULT " + json.dumps({"seconds": seconds, "generated": generated}), file=results, flush=True)


if __name__ == "__main__":
    main()

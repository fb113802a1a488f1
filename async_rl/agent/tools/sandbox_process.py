"""One sandboxed run of model-written Python, as an asyncio subprocess: spawn, feed the code,
capture capped output, kill the whole process group at the wall-clock limit, and say why
it ended. The confinement itself happens in the child (`sandbox_runner.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass

from async_rl.agent.tools import sandbox_runner as runner

RUNNER_PATH = os.path.abspath(runner.__file__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOutcome:
    """How one run ended: the runner's exit status (negative: killed by that signal) and output."""

    status: int | None
    stdout: str
    stderr: str
    omitted_chars: int  # output dropped between the kept head and tail of a stream
    timed_out: bool


class _CappedStream:
    """Keeps the first and the last `cap` bytes of a stream and counts the rest."""

    def __init__(self, cap: int):
        self.cap, self.head, self.tail, self.total = cap, bytearray(), bytearray(), 0

    async def drain(self, reader: asyncio.StreamReader) -> None:
        while chunk := await reader.read(65536):
            self.total += len(chunk)
            room = self.cap - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            self.tail += chunk
            del self.tail[:-self.cap]

    def text(self) -> tuple[str, int]:
        omitted = self.total - len(self.head) - len(self.tail)
        if not omitted:
            return (self.head + self.tail).decode("utf-8", "replace"), 0
        head = self.head.decode("utf-8", "replace")
        tail = self.tail.decode("utf-8", "replace")
        return f"{head}\n[... {omitted} bytes omitted ...]\n{tail}", omitted


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _feed_and_wait(proc: asyncio.subprocess.Process, code: str) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(code.encode("utf-8", "surrogatepass"))
        await proc.stdin.drain()
        proc.stdin.close()
    await proc.wait()


async def run_sandboxed(argv: list[str], code: str, env: dict[str, str], timeout_s: float,
                        output_cap: int) -> RunOutcome:
    """Run `argv` (ends with the runner) with `code` on stdin, within `timeout_s` of wall clock.

    The child is a session leader, so one `killpg` reaches everything it started unless it
    left the session; in namespace mode the pid namespace ends with its first process anyway.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
    out, err = _CappedStream(output_cap), _CappedStream(output_cap)
    readers = [asyncio.create_task(out.drain(proc.stdout)), asyncio.create_task(err.drain(proc.stderr))]
    timed_out = False
    try:
        await asyncio.wait_for(_feed_and_wait(proc, code), timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        _kill_group(proc.pid)
        if proc.returncode is None:
            await proc.wait()
        # a process that left the session may hold the pipes open: stop reading after a moment
        _, pending = await asyncio.wait(readers, timeout=2.0)
        for task in pending:
            task.cancel()
    stdout, cut_out = out.text()
    stderr, cut_err = err.text()
    return RunOutcome(status=proc.returncode, stdout=stdout, stderr=stderr,
                      omitted_chars=cut_out + cut_err, timed_out=timed_out)


def describe_exit(outcome: RunOutcome, limits: dict[str, float]) -> str | None:
    """Why a run failed, in words the model can act on; None when it succeeded."""
    status, stderr = outcome.status, outcome.stderr
    if outcome.timed_out:
        return f"timeout: the code ran longer than timeout_s={limits['timeout_s']} s (wall clock) and was killed"
    if status == 0:
        return None
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    known = {
        runner.EXIT_SYNTAX: f"syntax error: {last}",
        runner.EXIT_MEMORY: f"memory limit: the code ran out of memory (memory_mb={limits['memory_mb']})",
        runner.EXIT_NPROC: f"process limit: no more processes may be started (max_processes={limits['max_processes']})",
        runner.EXIT_SETUP: f"sandbox error: the sandbox could not be set up, the code did not run ({last})",
    }
    if status in known:
        return known[status]
    sig = -status if status is not None and status < 0 else (status - 128 if status and status > 128 else None)
    if sig == signal.SIGXCPU or sig == signal.SIGKILL:
        return (f"CPU time limit: the code used more than cpu_s={limits['cpu_s']} s of CPU and was killed"
                if sig == signal.SIGXCPU else "killed: the code was killed (SIGKILL; CPU or memory limit)")
    if sig == signal.SIGXFSZ:
        return "file size limit: the code wrote a file larger than max_file_mb and was killed"
    if sig is not None and 0 < sig < signal.NSIG:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed: the code was killed by {name}"
    if status == 1:
        return f"exception: {last}" if last else "exception: the code raised an error"
    return f"exit status {status}: the code exited with status {status}"

"""Throughput of the trajectory queue between two processes, and the time to broadcast a large blob.

A producer process (spawned, asyncio `TrajectoryQueueClient`) pushes groups of 8
trajectories as fast as credits allow; this process runs the `TrajectoryQueueServer` and
consumes with `get_groups` (acknowledging), like the trainer. Measured from the first
group received to the last, over tcp loopback and ipc, for small (64-token prompt + 64-token
response) and large (4k + 4k) trajectories. Then the trainer broadcasts one CONTROL map
holding a large bytes blob (a stand-in for a safetensors file) and the producer reports
when it has the decoded map: end to end, encode + transfer + decode.

    python benchmarks/queue_throughput.py            # about 30 s
    python benchmarks/queue_throughput.py --quick    # about 10 s

Writes benchmarks/results/queue_throughput.md and .json with the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from async_rl.transport.codec import encode
from async_rl.transport.client import TrajectoryQueueClient
from async_rl.transport.queue import TrajectoryQueueServer
from async_rl.types import Trajectory

RESULTS = Path(__file__).resolve().parent / "results"
GROUP = 8


def make_group(k: int, tokens: int) -> list[Trajectory]:
    """One group; prompt and response of `tokens` tokens each."""
    rng = np.random.default_rng(k)
    return [Trajectory(id=f"{k}-{j}", group_id=str(k), prompt_ids=rng.integers(0, 50_000, tokens, dtype=np.int32),
                       response_ids=rng.integers(0, 50_000, tokens, dtype=np.int32),  # [R]
                       loss_mask=np.ones(tokens, np.uint8), behav_logprobs=rng.random(tokens, np.float32) - 1,
                       versions=np.zeros(tokens, np.int32), reward=1.0, finish_reason="stop",
                       timings={"gen_s": 0.1}, info={"task": "bench"})
            for j in range(GROUP)]


def producer(addr: str, n_groups: int, tokens: int, out_q) -> None:
    """Spawned: push `n_groups` groups, then wait for CONTROL maps and report when each arrived."""
    async def main():
        client = TrajectoryQueueClient(addr, producer_id="bench")
        await client.connect(30)
        groups = [make_group(k, tokens) for k in range(min(n_groups, 64))]
        for k in range(n_groups):  # re-use 64 prebuilt groups under fresh ids
            await client.put_group([dataclasses.replace(t, id=f"{k}-{j}")
                                    for j, t in enumerate(groups[k % len(groups)])])
        async for msg in client.controls():
            if msg["kind"] == "stop":
                break
            out_q.put((msg["kind"], time.monotonic(), len(msg.get("blob", b""))))
        await client.close()
    asyncio.run(main())


def run_case(ctx, addr: str, tokens: int, n_groups: int, blob_mb: int = 0) -> dict:
    server = TrajectoryQueueServer(addr, capacity=256)
    out_q = ctx.Queue()
    proc = ctx.Process(target=producer, args=(server.address, n_groups, tokens, out_q), daemon=True)
    proc.start()
    try:
        got = len(server.get_groups(GROUP, timeout=60)[0])
        t0 = time.perf_counter()
        while got < n_groups * GROUP:
            got += sum(len(g) for g in server.get_groups(64 if n_groups * GROUP - got >= 64 else GROUP, timeout=60))
        dt = time.perf_counter() - t0
        frame_bytes = len(encode({"seq": 1, "trajectories": [t.to_wire() for t in make_group(0, tokens)]}))
        row = {"addr": server.address.split(":")[0], "tokens": tokens, "trajectories": got,
               "traj_per_s": (got - GROUP) / dt, "MB_per_s": (got / GROUP - 1) * frame_bytes / dt / 1e6,
               "bytes_per_traj": frame_bytes / GROUP}
        if blob_mb:
            blob = os.urandom(blob_mb * 2**20)
            t1 = time.monotonic()
            server.broadcast({"kind": "weights", "version": 1, "blob": blob})
            t_enc = time.monotonic() - t1
            kind, t_recv, n = out_q.get(timeout=120)
            assert n == len(blob), f"blob arrived with {n} bytes, sent {len(blob)}"
            row.update(blob_MB=blob_mb, blob_s=t_recv - t1, blob_encode_s=t_enc, blob_MB_per_s=blob_mb / (t_recv - t1))
        server.broadcast({"kind": "stop"})
        proc.join(30)
        return row
    finally:
        if proc.is_alive():
            proc.kill()
        server.close()


def table(rows: list[dict]) -> str:
    lines = ["| transport | tokens (prompt + response) | bytes/trajectory | trajectories/s | MB/s |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['addr']} | {r['tokens']} + {r['tokens']} | {r['bytes_per_traj']:.0f} | "
                     f"{r['traj_per_s']:.0f} | {r['MB_per_s']:.1f} |")
    blobs = [r for r in rows if "blob_MB" in r]
    if blobs:
        lines += ["", "| transport | CONTROL blob | encode s | broadcast -> decoded at producer s | MB/s |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['addr']} | {r['blob_MB']} MB | {r['blob_encode_s']:.2f} | {r['blob_s']:.2f} | "
                  f"{r['blob_MB_per_s']:.0f} |" for r in blobs]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer trajectories and a 100 MB blob")
    ap.add_argument("--blob-mb", type=int, default=None, help="CONTROL blob size in MB (default 500, quick 100)")
    args = ap.parse_args()
    blob_mb = args.blob_mb if args.blob_mb is not None else (100 if args.quick else 500)
    scale = 1 if args.quick else 3
    ctx = mp.get_context("spawn")
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for addr in ("tcp://127.0.0.1:0", f"ipc://{tmp}/bench.sock"):
            rows.append(run_case(ctx, addr, 64, 250 * scale))
            rows.append(run_case(ctx, addr, 4096, 40 * scale, blob_mb=blob_mb))
            print(table(rows[-2:]), flush=True)
    text = table(rows)
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    print(text)
    RESULTS.mkdir(exist_ok=True)
    load = f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    (RESULTS / "queue_throughput.json").write_text(
        json.dumps({"command": cmd, "cpus": os.cpu_count(), "load_avg": load, "rows": rows}, indent=1) + "\n")
    (RESULTS / "queue_throughput.md").write_text(
        "# Trajectory queue throughput\n\n"
        f"Two processes on one machine ({os.cpu_count()} cores, 1-min load average {load} during the run), "
        f"groups of {GROUP}, capacity 256, the trainer acknowledging as it consumes; see "
        "benchmarks/queue_throughput.py.\n\n"
        f"Command: `{cmd}`\n\n{text}\n")


if __name__ == "__main__":
    main()

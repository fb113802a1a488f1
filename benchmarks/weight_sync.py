"""Seconds per weight update for the `disk`, `zmq` and `dist` transports, peak extra memory, interruption.

Three processes, as in a run: the trainer (spawned) publishes a few versions of a random
fp32 model of the given shapes through the transport's publisher, on the path training uses
(`PPOTrainer.weights()`: read from the parameters bucket by bucket, no copy of the model);
the generation
server (spawned: the embedded engine, fp32, same model, served over HTTP) decodes four
streaming requests; this process is the rollout side, whose receiver loads each version
into the server through its routes, exactly as a run does:

- disk: `DiskWeightPublisher` writes the file; the engine loads it (`/update_weights_from_disk`,
        a memory-mapped swap at one step boundary);
- zmq:  chunks over a real trajectory queue (tcp loopback, one-bucket flow-control window) into
        a staged file on this side, then `/update_weights_from_disk` (what real SGLang serves too);
- dist: a gloo group formed as SGLang forms it; one `/update_weights_from_distributed` per flattened
        bucket (between `/begin_weight_update` and `/end_weight_update`), which the engine receives
        straight into its parameters.

Per update: seconds from the trainer starting to publish to the engine serving the new
version; peak extra memory (RSS, sampled every 2 ms, above the level just before) of the
trainer, rollout and engine processes (anonymous memory in brackets: page cache mapped by
a reader is counted in RSS but not there); for zmq, the most bytes the trainer had sent and
the rollout side had not yet acknowledged (the flow-control window: everything the rollout
side can hold of a version, in kernel buffers, ZeroMQ queues or the handler); the largest gap
between two tokens of an in-flight request during the update minus the median gap (the
interruption: swap + KV recompute of the four requests, so it grows with how far they have
got). The phases of each update (trainer checksums, waits for the window, the final drain;
receiver checksums and file writes; the engine's map and copy; CPU seconds of the trainer
process and of the rollout side's receiving threads, which bound what a quiet machine
would take) are in the JSON and in a second table. The first `--warmup` updates of each case are run but
not counted (their times are in the "warm-up s" column): until `keep_last` (2) versions
exist, each version's file is new and its page cache is fresh memory, 5-10x slower to write
here than the pages of the pruned version's file, which every later version takes over.

    python benchmarks/weight_sync.py            # tiny + SmolLM2-135M shapes, about 3 min on 2 cores
    python benchmarks/weight_sync.py --quick    # tiny only

Writes benchmarks/results/weight_sync.md and .json with the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from async_rl.config import EngineConfig, TrainerConfig
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import build_tiny_tokenizer
from async_rl.transport.client import TrajectoryQueueClient
from async_rl.trainer.trainer import PPOTrainer
from async_rl.transport.queue import TrajectoryQueueServer
from async_rl.weight_sync.disk import DiskWeightPublisher
from async_rl.weight_sync.dist_publisher import DistWeightPublisher
from async_rl.weight_sync.dist_receiver import DistWeightReceiver
from async_rl.weight_sync.zmq_buckets import ZmqWeightPublisher, ZmqWeightReceiver
from async_rl.launch.serve import BackgroundServer

RESULTS = Path(__file__).resolve().parent / "results"
TRANSPORTS = ("disk", "zmq", "dist")
MODELS = {  # name -> LlamaConfig kwargs (SmolLM2-135M's real shapes; weights are random)
    "tiny": dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3),
}


def build(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(**MODELS[name], max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg).eval()


class PeakMemory:
    """Peak RSS and anonymous RSS of this process above the level at `start()`, sampled every 2 ms."""

    def __init__(self):
        self._stop = threading.Event()
        self.base = self.peak = (0, 0)

    @staticmethod
    def now() -> tuple[int, int]:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["RssAnon"].split()[0]) * 1024

    def start(self) -> "PeakMemory":
        self.base = self.peak = self.now()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, anon = self.now()
            self.peak = (max(self.peak[0], rss), max(self.peak[1], anon))
            time.sleep(0.002)

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._thread.join()
        return (self.peak[0] - self.base[0]) / 2**20, (self.peak[1] - self.base[1]) / 2**20


def zmq_io_cpu_s() -> float:
    """CPU seconds of this process's ZeroMQ I/O threads (the copies out of the socket)."""
    total = 0.0
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if name.startswith("ZMQbg"):
            total += (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


# --------------------------------------------------------------------------- trainer process
def trainer(transport: str, model: str, versions: list[int], bucket_mb: float, tmp: str, out_q, in_q) -> None:
    torch.set_num_threads(1)
    ppo = PPOTrainer(build(model, seed=1), TrainerConfig(), temperature=1.0, max_staleness=1, seed=1)
    bucket = int(bucket_mb * 2**20)
    queue = None
    if transport == "disk":
        pub = DiskWeightPublisher(Path(tmp) / "trainer", keep_last=2)
    elif transport == "zmq":
        queue = TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=8)
        out_q.put(("addr", queue.address))
        queue.wait_for_producer(60)
        pub = ZmqWeightPublisher(queue.broadcast, bucket, deadline_s=120)
    else:
        pub = DistWeightPublisher(out_q.put, world_size=2, bucket_bytes=bucket, deadline_s=120)
    for v in versions:
        in_q.get(timeout=300)  # the rollout side is ready for the next version
        mem = PeakMemory().start()
        out_q.put(("start", v, time.time()))
        msg = pub.publish(ppo.weights(), v)  # as async_rl/trainer/versions.py publish_weights does
        if msg is not None:
            (queue.broadcast if queue is not None else out_q.put)(msg)
        stats = dict(getattr(pub, "stats", {}))
        if queue is not None:
            stats["queue/bulk_inflight_peak_bytes"] = queue.stats()["queue/bulk_inflight_peak_bytes"]
        out_q.put(("published", v, time.time(), *mem.stop(), stats))
    if queue is not None:
        in_q.get(timeout=300)
        queue.close()


# --------------------------------------------------------------------------- engine process
def engine(model: str, threads: int, url_q, cmd_q) -> None:
    """The generation server, serving until told to stop; measures its own peak memory when asked."""
    torch.set_num_threads(threads)
    tok = build_tiny_tokenizer("0123456789+= ")
    bg = BackgroundServer.for_model(build(model, seed=0), tok, EngineConfig(kv_cache_mb=64, block_size=16),
                                    model_name=model)
    url_q.put(bg.start())
    mem = PeakMemory()
    for cmd in iter(lambda: cmd_q.get(timeout=600), "stop"):
        if cmd == "mem_start":
            mem.start()
        else:
            url_q.put(mem.stop())
    bg.stop()


# --------------------------------------------------------------------------- rollout side
class Streams:
    """Streaming requests in flight; records when each token arrived."""

    def __init__(self, url: str, n: int, max_new_tokens: int):
        self.times: list[list[float]] = [[] for _ in range(n)]
        self.threads = [threading.Thread(target=self._one, args=(url, i, max_new_tokens), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, url: str, i: int, max_new_tokens: int) -> None:
        body = {"input_ids": [1 + i, 2, 3, 4], "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}}
        with httpx.Client(base_url=url, timeout=600, trust_env=False) as http:
            with http.stream("POST", "/generate", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.times[i].append(time.time())

    def interruption(self, t0: float, t1: float) -> float:
        """Largest token gap overlapping [t0, t1] minus the median gap, over the requests."""
        worst = 0.0
        for ts in self.times:
            gaps = [(b - a, a, b) for a, b in zip(ts, ts[1:])]
            if len(gaps) < 3:
                continue
            median = statistics.median(g for g, _, _ in gaps)
            during = [g for g, a, b in gaps if b >= t0 and a <= t1]
            if during:
                worst = max(worst, max(during) - median)
        return worst

    def join(self) -> None:
        for t in self.threads:
            t.join(600)


async def settle(client: HttpGenerationClient, timeout_s: float = 60.0) -> None:
    """Wait until the engine has recomputed the KV of its requests after an update and decoded again (two
    steps), so the next update does not wait behind that recompute and is timed on its own."""
    steps = (await client.metrics())["engine/steps_total"]
    deadline = time.monotonic() + timeout_s
    while (await client.metrics())["engine/steps_total"] < steps + 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)


def run_case(transport: str, model: str, rounds: int, bucket_mb: float, engine_threads: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    out_q, in_q, url_q, cmd_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=engine, args=(model, engine_threads, url_q, cmd_q), daemon=True)
    server.start()
    versions = list(range(1, rounds + 1))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc = ctx.Process(target=trainer, args=(transport, model, versions, bucket_mb, tmp, out_q, in_q), daemon=True)
        proc.start()
        try:
            url = url_q.get(timeout=300)
            rows = asyncio.run(_rollout(transport, model, url, (url_q, cmd_q), versions, tmp, out_q, in_q))
        finally:
            cmd_q.put("stop")
            for p in (proc, server):
                p.join(60)
                if p.is_alive():
                    p.kill()
    return rows


async def _rollout(transport, model, url, engine_qs, versions, tmp, out_q, in_q) -> list[dict]:
    client = HttpGenerationClient(url)
    url_q, cmd_q = engine_qs
    get = lambda: asyncio.to_thread(out_q.get, True, 300)  # noqa: E731
    queue = receiver = None
    if transport == "zmq":
        _, addr = await get()
        queue = TrajectoryQueueClient(addr)
        receiver = ZmqWeightReceiver(Path(tmp) / "rollout", keep_last=2).attach(queue)
        await queue.connect(60)
        controls = queue.controls()
    elif transport == "dist":
        receiver = DistWeightReceiver(deadline_s=120)
    rows = []
    streams = Streams(url, 4, max_new_tokens=900)
    await asyncio.sleep(1.0)  # the requests are decoding
    for v in versions:
        mem = PeakMemory().start()
        cmd_q.put("mem_start")
        in_q.put("go")
        _, _, t_start = await get()
        phases = {}
        if transport == "disk":
            msg = await get()
            _, _, t_pub, *tmem, tstats = await get()
            t_staged = time.time()
            served = await client.update_weights_from_disk(msg["path"], v)
        elif transport == "zmq":
            cpu0 = zmq_io_cpu_s()
            msg = await controls.__anext__()
            t_staged = time.time()
            phases["rollout_transport_cpu_s"] = zmq_io_cpu_s() - cpu0  # + the receiver's, below
            path = await receiver.prepare(msg)
            served = await client.update_weights_from_disk(path, v)
            _, _, t_pub, *tmem, tstats = await get()
            phases.update(receiver.stats)
            phases["rollout_transport_cpu_s"] += receiver.stats["sync/recv_cpu_s"]
            phases["queue/bulk_held_peak_bytes"] = queue.stats()["queue/bulk_held_peak_bytes"]
        else:
            msg = await get()
            t_staged = None  # received into the parameters inside the server's route
            await receiver.load(client, await receiver.prepare(msg), v)
            _, _, t_pub, *tmem, tstats = await get()
            served = {}
        t_done = time.time()
        rss, anon = mem.stop()
        cmd_q.put("mem_stop")
        erss, eanon = await asyncio.to_thread(url_q.get, True, 60)
        assert (await client.get_model_info())["weight_version"] == v
        phases.update({k: x for k, x in {**tstats, **served}.items() if k.startswith(("sync/", "engine/update",
                                                                                        "queue/"))})
        if t_staged is not None:
            phases["staged_s"] = t_staged - t_start  # trainer start -> the version is staged on this side
        rows.append({"transport": transport, "model": model, "version": v, "update_s": t_done - t_start,
                     "publish_s": t_pub - t_start, "trainer_peak_MB": tmem[0], "trainer_peak_anon_MB": tmem[1],
                     "rollout_peak_MB": rss, "rollout_peak_anon_MB": anon, "engine_peak_MB": erss,
                     "engine_peak_anon_MB": eanon, "t0": t_start, "t1": t_done,
                     "phases": phases})
        await settle(client)
    in_q.put("stop")
    await asyncio.to_thread(httpx.post, url + "/abort_request", json={"abort_all": True}, trust_env=False,
                            timeout=120)
    await asyncio.to_thread(streams.join)
    for row in rows:
        row["interruption_s"] = streams.interruption(row.pop("t0"), row.pop("t1"))
    await client.close()
    if queue is not None:
        await queue.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | transport | MB | s / update | trainer publish s | trainer peak extra MB (anon) | "
             "rollout peak extra MB (anon) | engine peak extra MB (anon) | rollout side holds at most MB | "
             "interruption s | warm-up s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        window = r.get("phases", {}).get("queue/bulk_inflight_peak_bytes")
        held = "-" if window is None else f"{window / 2**20:.0f}"
        lines.append(f"| {r['model']} | {r['transport']} | {r['MB']:.1f} | {r['update_s']:.2f} | {r['publish_s']:.2f} | "
                     f"{r['trainer_peak_MB']:.0f} ({r['trainer_peak_anon_MB']:.0f}) | {r['rollout_peak_MB']:.0f} "
                     f"({r['rollout_peak_anon_MB']:.0f}) | {r['engine_peak_MB']:.0f} ({r['engine_peak_anon_MB']:.0f}) | "
                     f"{held} | {r['interruption_s']:.2f} | "
                     f"{' '.join(f'{x:.2f}' for x in r.get('warmup_update_s', [])) or '-'} |")
    return "\n".join(lines)


PHASES = [("staged_s", "staged s"), ("sync/crc_s", "trainer CRC s"), ("sync/window_wait_s", "trainer window wait s"),
          ("sync/drain_s", "trainer drain s"), ("sync/recv_crc_s", "receiver CRC s"),
          ("sync/recv_write_s", "receiver write s"), ("engine/update_read_s", "engine map s"),
          ("engine/update_load_s", "engine copy s"), ("sync/publish_cpu_s", "trainer CPU s"),
          ("rollout_transport_cpu_s", "rollout receive CPU s")]


def phase_table(rows: list[dict]) -> str:
    """Where the time of each update goes (a dash: the transport has no such phase)."""
    lines = ["| model | transport | " + " | ".join(title for _, title in PHASES) + " |",
             "|---|---|" + "---|" * len(PHASES)]
    for r in rows:
        ph = r.get("phases", {})
        cells = [f"{ph[k]:.2f}" if k in ph else "-" for k, _ in PHASES]
        lines.append(f"| {r['model']} | {r['transport']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model only")
    ap.add_argument("--models", default="tiny,smollm2-135m", help=f"some of {', '.join(MODELS)}")
    ap.add_argument("--rounds", type=int, default=3, help="updates per case counted (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2, help="updates per case run first and not counted")
    ap.add_argument("--bucket-mb", type=float, default=128.0, help="weight_sync.bucket_mb")
    ap.add_argument("--transports", default="disk,zmq,dist", help="some of disk, zmq, dist")
    args = ap.parse_args()
    unknown = sorted(set(args.transports.split(",")) - set(TRANSPORTS))
    if unknown:
        ap.error(f"--transports: {', '.join(unknown)} unknown (allowed: {', '.join(TRANSPORTS)})")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # this process only receives, like a run's rollout process
    rows = []
    load_before = os.getloadavg()[0]
    for model in ["tiny"] if args.quick else args.models.split(","):
        mb = sum(p.numel() * p.element_size() for p in build(model, 0).parameters()) / 2**20
        for transport in args.transports.split(","):
            runs = run_case(transport, model, args.warmup + args.rounds, args.bucket_mb, max(1, threads // 2))
            counted = runs[args.warmup:]
            best = sorted(counted, key=lambda r: r["update_s"])[len(counted) // 2]
            rows.append({**best, "MB": mb, "all_update_s": [r["update_s"] for r in counted],
                         "warmup_update_s": [r["update_s"] for r in runs[:args.warmup]]})
            print(table(rows[-1:]), flush=True)
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    cpu = torch.backends.cpu.get_cpu_capability()
    for r in rows:
        r.update(command=cmd, load_avg=f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}", bucket_mb=args.bucket_mb,
                 warmup=args.warmup)
    write(rows, {"cpus": os.cpu_count(), "cpu_capability": cpu, "torch_threads": threads})


def write(rows: list[dict], meta: dict) -> None:
    """Merge `rows` into the results (a later run of a (model, transport) replaces the earlier one)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "weight_sync.json"
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    mine = {(r["model"], r["transport"]) for r in rows}
    order = {m: i for i, m in enumerate(MODELS)}
    kept = [r for r in old if (r["model"], r["transport"]) not in mine and r["transport"] in TRANSPORTS
            and "engine_peak_MB" in r]  # rows of an earlier layout of this benchmark are dropped
    merged = sorted(kept + rows, key=lambda r: (order.get(r["model"], 9), r["transport"]))
    path.write_text(json.dumps({**meta, "rows": merged}, indent=1) + "\n")
    commands = sorted({f"`{r['command']}` (load average {r['load_avg']})" for r in merged})
    text = table(merged) + "\n\nWhere the time goes (the same updates):\n\n" + phase_table(merged)
    print(text)
    (RESULTS / "weight_sync.md").write_text(
        "# Weight sync: seconds per update, peak extra memory, interruption\n\n"
        f"{meta['cpus']} cores ({meta['cpu_capability']}), torch threads {meta['torch_threads']} (half to the "
        "engine process, one each to the trainer and rollout processes); fp32 weights; the median of the counted "
        "updates of each case (after the warm-up ones); a shared machine, its load average beside each command. "
        "See the script's docstring for what each column measures. Made by:\n\n" + "\n".join(f"- {c}" for c in commands)
        + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()

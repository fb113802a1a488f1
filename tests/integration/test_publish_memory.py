"""A publish holds at most one bucket of extra memory, on the path training uses.

The trainer publishes `trainer.weights()` (views of its fp32 parameters) through
`publish_weights`, as `async_rl/trainer/loop.py` does, over the `dist` transport in bf16 to a
server rank in another process. The peak resident memory of this process during the
publish (VmHWM, reset through /proc/self/clear_refs) minus its memory before it is the
publish's extra memory: at most one bucket (plus a little allocator and gloo slack). The old
call site, `trainer.state_dict()`, copies the model to CPU first: the same measurement sees
the whole model, so the check would fail on it.
"""

import json
import multiprocessing as mp
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from async_rl.config import ModelConfig, TrainerConfig
from async_rl.models import build_tiny_tokenizer, load_model
from async_rl.trainer.trainer import PPOTrainer
from async_rl.weight_sync.dist_publisher import DistWeightPublisher
from async_rl.trainer.versions import publish_weights

ALPHABET = "0123456789+= "
BUCKET = 4 << 20
SLACK = 2 << 20  # allocator rounding, gloo's own buffers

PEER = r'''
import json, os, sys
from async_rl.weight_sync.dist_server import DistWeightGroups
cfg = json.loads(sys.argv[1])
groups = DistWeightGroups("cpu")
g = cfg["group"]
groups.init(g["master_address"], g["master_port"], 1, 2, g["group_name"], g["backend"], 120)
for _ in range(cfg["versions"]):
    for a, b in cfg["buckets"]:
        groups.receive(g["group_name"], cfg["names"][a:b], cfg["dtypes"][a:b], cfg["shapes"][a:b], "flattened_bucket")
print("received", flush=True)
groups.destroy(g["group_name"])
os._exit(0)  # a gloo worker thread still letting go of its tensors would abort a normal exit
'''


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10


def _extra(publish) -> int:
    """Peak resident bytes of this process during `publish()` above what it held before."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = _kib("VmRSS")
    publish()
    return _kib("VmHWM") - before


class _Queue:
    def broadcast(self, msg):  # dist announces the version itself; nothing to tell
        raise AssertionError("dist publishes return None")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset peak RSS")
def test_a_dist_publish_holds_at_most_one_bucket_of_extra_memory():
    # in a fresh process: in one that has run other tests, the allocator reuses pages that are already
    # resident, and a copy of the model would not show in RSS (the control below would fail)
    with mp.get_context("spawn").Pool(1) as pool:
        streamed, copied, model_bytes = pool.apply(_measure)
    print(f"extra memory of a publish: {streamed / 2**20:.1f} MiB streamed from the parameters, "
          f"{copied / 2**20:.1f} MiB through a CPU copy; bucket {BUCKET / 2**20:.0f} MiB, model "
          f"{model_bytes / 2**20:.0f} MiB")
    assert streamed <= BUCKET + SLACK
    assert copied >= model_bytes * 0.9  # the measurement sees a copy of the model where there is one


def _measure() -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=ALPHABET, tiny_hidden=512, tiny_layers=4,
                                   tiny_heads=8, tiny_kv_heads=4, tiny_intermediate=2048),
                       seed=0, tokenizer=build_tiny_tokenizer(ALPHABET))
    trainer = PPOTrainer(model, TrainerConfig(), temperature=1.0, max_staleness=1, seed=0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes > 12 * BUCKET  # ~60 MB of fp32 weights against 4 MB buckets
    publisher = DistWeightPublisher(None, world_size=2, bucket_bytes=BUCKET, deadline_s=120,
                                    dtype=torch.bfloat16)
    announced = threading.Event()
    peer: list[subprocess.Popen] = []

    def send(msg):
        if not peer:
            cfg = {k: msg[k] for k in ("group", "names", "dtypes", "shapes", "buckets")}
            peer.append(subprocess.Popen([sys.executable, "-c", PEER, json.dumps({**cfg, "versions": 3})],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        announced.set()

    publisher.send = send
    queue = _Queue()
    publish_weights(publisher, queue, trainer.weights(), 1)  # warm: the group forms, gloo allocates its buffers
    streamed = _extra(lambda: publish_weights(publisher, queue, trainer.weights(), 2))
    copied = _extra(lambda: publish_weights(publisher, queue, trainer.state_dict(), 3))  # the old call site
    try:
        out, err = peer[0].communicate(timeout=120)
    finally:
        peer[0].kill()  # never left behind (a no-op once it has exited)
    publisher.close()
    assert peer[0].returncode == 0 and "received" in out, err[-2000:]
    return streamed, copied, model_bytes

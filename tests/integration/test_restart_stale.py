"""A generation that went too stale to be trained starts again instead of running on (rollout.restart_stale).

The real rollout controller drives a real server (the debug config's tiny model, every
response forced to LENGTH tokens) while the test sends weight updates faster than a group can
finish (responses are long enough for that even on one thread, where an update is slowest). With max_staleness=1, a generation begun under version v can no longer be trained
once v+2 is loaded: with `restart_stale` it is cancelled and begun again under v+2, so every
group it pushes is trainable when pushed; without, the stale ones run to their end.
"""

import asyncio
import dataclasses

import pytest
import torch

from async_rl.config import load_config
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import load_model, load_tokenizer
from async_rl.rollout.controller import RolloutController
from async_rl.tasks import build_task
from async_rl.launch.serve import BackgroundServer
from tests.e2e.test_run import DEBUG
from served_weights import save_weights_dir

ETA = 1
LENGTH = 200


@pytest.fixture
def setup(tmp_path):
    tmp = tmp_path  # a fresh server each test: its weight version starts at 0
    cfg = load_config(DEBUG, [f"run_dir={tmp}", "model.dtype=float32", "mode=async", f"max_staleness={ETA}",
                              "trainer.batch_size=4", "rollout.group_size=2", f"rollout.max_new_tokens={LENGTH}",
                              f"model.max_position={LENGTH + 16}",
                              "rollout.eval_every=0", "log.level=WARNING"])
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, seed=cfg.seed, tokenizer=tok)
    weights = save_weights_dir(model, tmp / "weights")  # the server's own weights, loaded again as each "new" version
    server = BackgroundServer.for_model(model, tok, cfg.engine, model_name=cfg.model.name)
    url = server.start()
    yield cfg, tok, url, weights
    server.stop()


def _run(setup, restart: bool, updates: int = 6, **rollout):
    cfg, tok, url, weights = setup
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, restart_stale=restart, **rollout))
    pushed: list[tuple[int, list]] = []  # (the version loaded when the group was pushed, its trajectories)
    controls: asyncio.Queue = asyncio.Queue()

    class Sink:
        async def put_group(self, group):
            pushed.append((controller.gate.version, group))

    async def stream():
        while True:
            yield await controls.get()

    async def main():
        nonlocal controller
        controller = RolloutController(cfg, [HttpGenerationClient(url)], Sink(), stream(), tok,
                                       build_task(cfg.task))
        controller.params = dataclasses.replace(controller.params, ignore_eos=True)  # every response is long
        run = asyncio.create_task(controller.run(cfg.seed))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        for v in range(1, updates + 1):  # each update as soon as the last is loaded, generations in flight
            while not controller._attempts and loop.time() < deadline:
                await asyncio.sleep(0.005)
            await controls.put({"kind": "weights", "version": v, "path": weights})
            while controller.gate.version < v and loop.time() < deadline:
                await asyncio.sleep(0.005)
        while sum(v >= updates for v, _ in pushed) < 2 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await controls.put({"kind": "stop", "final_version": updates})
        await asyncio.wait_for(run, 60)

    controller = None
    asyncio.run(main())
    return controller, pushed


def test_a_generation_too_stale_to_train_starts_again_under_the_new_weights(setup):
    controller, pushed = _run(setup, restart=True)
    assert controller.restarted_stale > 0
    assert pushed, "no group was pushed"
    for version, group in pushed:  # trainable when pushed: the trainer is at `version` or later
        assert all(version - t.oldest_version() <= ETA for t in group), [(version, t.oldest_version()) for t in group]
        assert all(len(t.response_ids) == LENGTH for t in group)  # a restarted one is whole, not cut


def test_without_restart_the_stale_ones_run_to_their_end(setup):
    controller, pushed = _run(setup, restart=False)
    assert controller.restarted_stale == 0
    assert any(version - t.oldest_version() > ETA for version, group in pushed for t in group)


"""Sticky sessions over three real embedded servers: prefix hits across turns, spread, moves.

Each episode is multi-turn: a turn's prompt is the previous prompt, the tokens the model
sampled and a few new "user" tokens. Every episode starts from its own random tokens, so a
server can only have the KV of an episode's prefix if that episode ran there before: the
server's reported prefix-cache hit (`prefix_cached_tokens`) on turns 2+ shows the turns
stayed. All servers hold the same weights (same seed) and decode greedily, so a turn that
moves mid-way must end with exactly the tokens an unmoved run produces.
"""

import asyncio
import dataclasses
import math
import random
from types import SimpleNamespace

import pytest
import torch

from async_rl.config import ConfigError, EngineConfig, ModelConfig, RolloutConfig, load_config
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import PRINTABLE, load_model, load_tokenizer
from async_rl.rollout.failover import PooledGenerationClient
from async_rl.rollout.server_pool import ServerPool
from async_rl.types import SamplingParams
from async_rl.launch.serve import BackgroundServer

BLOCK = 16  # engine.block_size: the prefix cache works in whole blocks
TURN = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=96, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def servers():
    torch.set_num_threads(1)
    model_cfg = ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE)
    engine_cfg = EngineConfig(kv_cache_mb=16.0, block_size=BLOCK, num_threads=1)
    tok = load_tokenizer(model_cfg)
    bgs = [BackgroundServer.for_model(load_model(model_cfg, seed=0, tokenizer=tok), tok, engine_cfg, model_name="tiny")
           for _ in range(3)]
    yield SimpleNamespace(tok=tok, urls=[b.start() for b in bgs])
    for b in bgs:
        b.stop()


def with_pool(urls, body):
    async def main():
        pool = ServerPool([HttpGenerationClient(u) for u in urls], health_interval_s=60.0)
        try:
            return await body(pool)
        finally:
            await pool.close()
    return asyncio.run(main())


def opening(seed, n=21):
    """An episode's own first prompt (random printable tokens: no two episodes share a block)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 90) for _ in range(n)]


def next_prompt(prompt, out, seed, turn):
    rng = random.Random(seed * 100 + turn)
    return prompt + out.output_ids + [rng.randrange(3, 90) for _ in range(3)]


def cacheable(prompt, out):
    """Tokens of the next turn's prompt a server that ran this turn holds in whole KV blocks (the
    last sampled token is never fed to the model)."""
    return (len(prompt) + len(out.output_ids) - 1) // BLOCK * BLOCK


class Episode:
    """One multi-turn episode on its own sticky client: per turn, the output and the server it ran on."""

    def __init__(self, pool, seed, margin=None):
        self.client = PooledGenerationClient(pool, sticky=True, overload_margin=margin)
        self.seed, self.prompt, self.turns = seed, opening(seed), []

    async def turn(self, params=TURN):
        out = await self.client.generate(self.prompt, params)
        prompt = self.prompt
        self.turns.append(SimpleNamespace(out=out, server=self.client.session.server.index, prompt=prompt))
        self.prompt = next_prompt(prompt, out, self.seed, len(self.turns))
        return out

    def servers(self):
        return [t.server for t in self.turns]

    def hit_on(self, k):
        """Turn k's prefix-cache hit, and what it would be had turn k-1 run on the same server."""
        return self.turns[k].out.prefix_cached_tokens, cacheable(self.turns[k - 1].prompt, self.turns[k - 1].out)


async def run_turns(episodes, n, params=TURN):
    for _ in range(n):
        await asyncio.gather(*(e.turn(params) for e in episodes))


def test_turns_stick_to_their_server_and_hit_its_prefix_cache(servers):
    margin = RolloutConfig().sticky_overload_margin  # the default does not move sessions under even load

    async def paced(e):  # episodes at their own pace: between turns a "tool" takes its time
        rng = random.Random(e.seed)
        for _ in range(4):
            await e.turn(dataclasses.replace(TURN, max_new_tokens=rng.randrange(4, 20)))
            await asyncio.sleep(rng.uniform(0.0, 0.03))

    async def body(pool):
        eps = [Episode(pool, seed, margin) for seed in range(7)]
        await asyncio.gather(*(paced(e) for e in eps))
        return eps, pool.stats()

    eps, stats = with_pool(servers.urls, body)
    assert stats["rollout/session_moves"] == 0
    assert sorted(e.servers()[0] for e in eps) == [0, 0, 0, 1, 1, 2, 2]  # new episodes spread
    for e in eps:
        assert len(set(e.servers())) == 1, e.servers()
        assert e.turns[0].out.prefix_cached_tokens == 0
        for k in range(1, 4):
            hit, held = e.hit_on(k)
            # all of the prompt but the 3 new tokens and the last, partial block
            assert hit == held > len(e.turns[k].prompt) - 4 - BLOCK, (k, hit, held, len(e.turns[k].prompt))
    assert stats["pool/in_flight"] == 0


@pytest.mark.parametrize("staggered", [False, True], ids=["burst", "one_after_another"])
def test_new_episodes_spread_over_the_servers(servers, staggered):
    """12 new episodes at once spread by requests in flight; one after another (every server idle
    each time) they spread by the sessions each server holds, round-robin among equals."""
    async def body(pool):
        eps = [Episode(pool, 100 + seed) for seed in range(12)]
        if staggered:
            for e in eps:
                await e.turn()
        else:
            await run_turns(eps, 1)
        per_server = [sum(e.servers()[0] == i for e in eps) for i in range(3)]
        sessions = [pool.stats()[f"pool/server{i}/sessions"] for i in range(3)]
        for e in eps:
            await e.client.close()
        return per_server, sessions, pool.stats()

    per_server, sessions, after = with_pool(servers.urls, body)
    assert max(per_server) <= math.ceil(12 / 3) + 1 and sum(per_server) == 12, per_server
    assert sessions == per_server
    assert all(after[f"pool/server{i}/sessions"] == 0 for i in range(3))  # closed episodes free their place


def test_fenced_server_sessions_move_rebuild_their_prefix_and_stay(servers):
    async def body(pool):
        eps = [Episode(pool, 200 + seed) for seed in range(6)]
        await run_turns(eps, 1)
        gone = pool.servers[1]
        pool.fence(gone, "missed a weight update (test)")
        await run_turns(eps, 2)
        moved = pool.stats()
        await pool.rejoin(gone, 0)  # back in rotation: nothing moves back
        await run_turns(eps, 1)
        return eps, moved, pool.stats()

    eps, moved, final = with_pool(servers.urls, body)
    on_fenced = [e for e in eps if e.servers()[0] == 1]
    assert len(on_fenced) == 2
    assert moved["rollout/session_moves"] == moved["rollout/session_moves_gone"] == 2
    assert final["rollout/session_moves"] == 2
    for e in eps:
        first = e.servers()[0]
        if e in on_fenced:
            assert e.servers()[1] != 1 and len(set(e.servers()[1:])) == 1, e.servers()
            assert e.turns[1].out.prefix_cached_tokens == 0  # the new server rebuilt the prefix ...
            hit, held = e.hit_on(2)
            assert hit == held > 0  # ... and holds it from then on
        else:
            assert e.servers() == [first] * 4  # peers never rebalance
            assert all(e.hit_on(k)[0] == e.hit_on(k)[1] for k in range(1, 4))


def test_server_fenced_mid_turn_its_sessions_finish_elsewhere_with_the_same_tokens(servers):
    """A server leaves rotation while the episodes' second turns run: those on it continue on another
    server from the tokens they had, exactly as if nothing happened (a SIGKILLed server takes the same
    path once its stream breaks: see test_server_pool)."""
    async def run(pool, fence):
        eps = [Episode(pool, 300 + seed) for seed in range(6)]
        await run_turns(eps, 1)
        on_fenced = [e for e in eps if e.servers()[0] == 2]
        second = asyncio.ensure_future(run_turns(eps, 1, LONG))
        while fence and not any(srv.index == 2 and n >= 2 for e in on_fenced
                                for srv, n in e.client.running().values()):
            assert not second.done(), "the turns ended before the server could be fenced"
            await asyncio.sleep(0.002)
        if fence:
            pool.fence(pool.servers[2], "missed a weight update (test)")
        await second
        return eps, on_fenced, pool.stats()

    want, _, calm = with_pool(servers.urls, lambda pool: run(pool, False))
    eps, on_fenced, stats = with_pool(servers.urls, lambda pool: run(pool, True))
    assert calm["rollout/session_moves"] == 0 and calm["pool/reissued"] == 0
    assert len(on_fenced) == 2 and stats["pool/server2/fenced"] == 1
    assert stats["rollout/session_moves"] == stats["rollout/session_moves_gone"] == 2
    assert stats["pool/reissued"] == 2 and stats["pool/reissued_tokens"] >= 2
    assert [[t.out.output_ids for t in e.turns] for e in eps] == [[t.out.output_ids for t in e.turns] for e in want]
    for e in on_fenced:
        assert e.servers()[1] != 2 and e.turns[1].out.finish_reason == "length"


def test_overloaded_server_sessions_move_with_a_tiny_margin_not_with_a_large_one(servers):
    async def body(pool, margin):
        busy_ep, calm_ep = Episode(pool, 400 + 10 * margin, margin), Episode(pool, 401 + 10 * margin, margin)
        await busy_ep.turn()
        await calm_ep.turn()
        busy = pool.servers[busy_ep.servers()[0]]
        load = []
        for _ in range(4):  # four long requests of other work on the episode's server
            await pool.acquire(busy)
            load.append(asyncio.ensure_future(busy.client.generate(opening(500 + len(load)), LONG)))
        in_flight = pool.stats()[f"pool/server{busy.index}/in_flight"]
        await busy_ep.turn()
        await calm_ep.turn()
        await asyncio.gather(*load)
        for _ in load:
            pool.release(busy)
        await busy_ep.turn()  # the old server is idle again: the session does not go back
        return busy_ep, calm_ep, busy.index, in_flight, pool.stats()

    ep, calm, busy, in_flight, stats = with_pool(servers.urls, lambda pool: body(pool, 1))
    assert in_flight == 4
    assert stats["rollout/session_moves"] == stats["rollout/session_moves_overload"] == 1
    assert ep.servers()[1] != busy and ep.servers()[2] == ep.servers()[1]
    assert ep.turns[1].out.prefix_cached_tokens == 0 and ep.hit_on(2)[0] == ep.hit_on(2)[1] > 0
    assert len(set(calm.servers())) == 1 and calm.hit_on(1)[0] == calm.hit_on(1)[1]

    ep, _, busy, _, stats = with_pool(servers.urls, lambda pool: body(pool, 8))
    assert stats["rollout/session_moves"] == 0 and ep.servers() == [busy] * 3
    assert ep.hit_on(1)[0] == ep.hit_on(1)[1] > 0


def test_negative_margin_is_a_clear_error(servers):
    with pytest.raises(ConfigError, match="rollout.sticky_overload_margin: must be >= 0, got -1"):
        load_config(None, ["rollout.sticky_overload_margin=-1"])

    async def body(pool):
        with pytest.raises(ValueError, match="rollout.sticky_overload_margin: must be >= 0"):
            PooledGenerationClient(pool, sticky=True, overload_margin=-1)
    with_pool(servers.urls, body)

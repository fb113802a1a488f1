"""The server pool over two real generation-server processes: load sharing, fencing, failover, health.

Both servers run the same tiny model (same seed), so greedy decoding is a function of the
prompt alone: a request that moves from one server to another mid-way must end with
exactly the tokens an uninterrupted request produces, whatever the moment it moved. One
server is frozen (SIGSTOP) during a weight update to miss the deadline, and later killed
(SIGKILL) mid-generation; the requests on it finish on the other with their tokens,
log-probs and versions.
"""

import asyncio
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import load_file

from async_rl.config import load_config
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import load_model, load_tokenizer
from async_rl.rollout.failover import PooledGenerationClient
from async_rl.rollout.server_pool import NoServerError, ServerPool
from async_rl.rollout.weight_update import WeightUpdateError, update_servers
from async_rl.types import SamplingParams
from async_rl.weight_sync.disk import DiskWeightPublisher
from async_rl.weight_sync.versions import version_dir
from async_rl.weight_sync.receivers import DiskWeightReceiver
from async_rl.weight_sync.staging import WeightsSuperseded
from async_rl.launch.common import free_port
from async_rl.launch.procs import start_server, stop_all
from async_rl.launch.serve import BackgroundServer
from tests.e2e.test_run import DEBUG
from served_weights import save_weights_dir

PROMPTS = ["1+2=", "0+0=", "2+2=", "1+1=", "2+0=", "0+1=", "4+3=", "3+1="]
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool")
    cfg = load_config(DEBUG, [f"run_dir={tmp}", "model.dtype=float32", "engine.num_threads=1", "log.level=WARNING"])
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, seed=cfg.seed, tokenizer=tok)
    weights = save_weights_dir(model, tmp / "same_weights")  # the servers' own weights, to load as "new" versions
    started = [start_server(cfg, i) for i in range(2)]
    yield SimpleNamespace(cfg=cfg, tok=tok, model=model, weights=weights, procs=[p for p, _ in started],
                          urls=[u for _, u in started])
    for p in started:
        if p[0].is_alive():
            os.kill(p[0].pid, signal.SIGCONT)
    stop_all([p for p, _ in started])


def prompt_ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def with_pool(s, body, health_interval_s=60.0, health_timeout_s=5.0):
    async def main():
        pool = ServerPool([HttpGenerationClient(u) for u in s.urls], health_interval_s=health_interval_s,
                          health_timeout_s=health_timeout_s)
        try:
            return await body(pool)
        finally:
            await pool.close()
    return asyncio.run(main())


@pytest.fixture(scope="module")
def reference(servers):
    """Uninterrupted greedy outputs, one per prompt."""
    async def body(pool):
        client = PooledGenerationClient(pool)
        return await asyncio.gather(*(client.generate(prompt_ids(servers.tok, p), GREEDY) for p in PROMPTS))
    return with_pool(servers, body)


def assert_same_as_reference(outs, reference):
    for out, ref in zip(outs, reference):
        assert out.output_ids == ref.output_ids
        assert out.finish_reason == "length" and len(out.output_logprobs) == len(out.output_ids)
        assert torch.allclose(torch.tensor(out.output_logprobs), torch.tensor(ref.output_logprobs), atol=1e-4)


async def wait_progress(client, pool, server, tokens, timeout_s=30.0):
    """Until some request on `server` has received `tokens` tokens (checked at every loop turn)."""
    deadline = time.monotonic() + timeout_s
    while not any(srv is server and n >= tokens for srv, n in client.running().values()):
        assert time.monotonic() < deadline, "no request made progress on the server"
        await asyncio.sleep(0)


async def freeze_mid_request(client, pool, server, proc, prompts, tok, tries=3, quiet_s=0.3):
    """Start `prompts`, then SIGSTOP `proc` once a request on `server` has 3 tokens; return the tasks.

    What the test needs is a request the frozen server had not finished. The client sees tokens only
    as it reads its streams: a starved client (a loaded machine) can see the third token after the
    server has written every token into the socket. So after the freeze the client drains what the
    server had sent, and if every request on it then finishes, the server is let go and the round is
    run again (at most `tries`). Caught: requests on the server stay unfinished with no token arriving
    for `quiet_s` and 20 loop turns."""
    for _ in range(tries):
        tasks = [asyncio.ensure_future(client.generate(prompt_ids(tok, p), GREEDY)) for p in prompts]
        await wait_progress(client, pool, server, 3)
        os.kill(proc.pid, signal.SIGSTOP)
        last, since, turns = None, time.monotonic(), 0
        while True:
            now = sorted((rid, n) for rid, (srv, n) in client.running().items() if srv is server)
            if not now:
                break  # everything on it came out of the socket: not caught
            if now != last:
                last, since, turns = now, time.monotonic(), 0
            elif time.monotonic() - since >= quiet_s and turns >= 20:  # turns: a descheduled client read nothing
                return tasks
            turns += 1
            await asyncio.sleep(0.01)
        os.kill(proc.pid, signal.SIGCONT)
        await asyncio.gather(*tasks)
    raise AssertionError(f"the frozen server had finished every request in each of {tries} rounds")


def test_two_servers_share_the_load(servers, reference):
    async def body(pool):
        client = PooledGenerationClient(pool)
        outs = await asyncio.gather(*(client.generate(prompt_ids(servers.tok, p), GREEDY) for p in PROMPTS * 2))
        return outs, pool.stats()

    outs, stats = with_pool(servers, body)
    assert stats["pool/server0/requests"] == stats["pool/server1/requests"] == len(PROMPTS)
    assert stats["pool/in_flight"] == 0 and stats["pool/in_rotation"] == 2 and stats["pool/reissued"] == 0
    assert_same_as_reference(outs, reference * 2)
    assert all(v == 0 for o in outs for v in o.output_versions)


def test_a_server_this_side_paused_is_not_taken_for_dead(servers):
    """SGLang's /health runs a one-token generation, which gets no answer while generation is paused
    (sglang/srt/entrypoints/http_server.py, health_generate; SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is on by
    default), and the embedded server answers the same way: a weight update that holds a server paused longer
    than a health check must not take it out of rotation (every request on it would move)."""
    async def body(pool):
        ours = pool.servers[0].client
        await ours.pause_generation()
        try:
            async with httpx.AsyncClient(base_url=servers.urls[0], trust_env=False) as other:
                with pytest.raises(httpx.TimeoutException):
                    await other.get("/health", timeout=1.5)  # what the server itself says while paused
            await pool.check_health()
            return pool.stats()
        finally:
            await ours.continue_generation()

    stats = with_pool(servers, body, health_timeout_s=1.0)
    assert stats["pool/in_rotation"] == 2 and stats["pool/unhealthy_total"] == 0 and stats["pool/fenced_total"] == 0


def test_server_missing_the_deadline_is_fenced_and_its_requests_move(servers, reference):
    frozen = servers.procs[1]

    async def body(pool):
        client = PooledGenerationClient(pool)
        b = pool.servers[1]
        tasks = await freeze_mid_request(client, pool, b, frozen, PROMPTS, servers.tok)
        t0 = time.monotonic()
        stats = await update_servers(pool, DiskWeightReceiver(), {"version": 1, "path": servers.weights}, 3.0)
        took, why = time.monotonic() - t0, pool.servers[1].reason
        outs = await asyncio.gather(*tasks)
        after_fence = pool.stats()
        os.kill(frozen.pid, signal.SIGCONT)
        await pool.check_health()  # answers again, but still holds version 0: stays fenced
        still = pool.stats()
        stats2 = await update_servers(pool, DiskWeightReceiver(), {"version": 2, "path": servers.weights}, 10.0)
        again = await asyncio.gather(*(client.generate(prompt_ids(servers.tok, p), GREEDY) for p in PROMPTS))
        final = pool.stats()
        # a server fenced while its load was still under way rejoins when the health check finds it holds
        # the current version, without waiting for the next update
        pool.fence(pool.servers[1], "a late load (simulated)")
        await pool.check_health()
        return stats, (took, why), outs, after_fence, still, stats2, again, final, pool.stats()

    stats, (took, why), outs, fenced, still, stats2, again, final, caught_up = with_pool(servers, body)
    assert stats["sync/servers_fenced"] == 1 and stats["sync/servers_loaded"] == 1
    assert took >= 3.0 and "missed the 3s deadline of weight update v1" in why  # the deadline ended it, not a hang
    assert fenced["pool/server1/fenced"] == 1 and fenced["pool/in_rotation"] == 1
    assert fenced["pool/reissued"] >= 1 and fenced["pool/reissued_tokens"] >= 3
    assert_same_as_reference(outs, reference)  # moved requests continue exactly where they stopped
    for o in outs:  # versions kept: old tokens 0, then 1 after the update, never backwards
        assert set(o.output_versions) <= {0, 1} and o.output_versions == sorted(o.output_versions)
    # the requests that had started before the update keep their first tokens' version (on a fast machine
    # some requests only begin sampling after it, so not all of them)
    assert any(o.output_versions[0] == 0 and o.output_versions[-1] == 1 for o in outs)
    assert any(o.output_versions[-1] == 1 for o in outs)
    assert still["pool/server1/healthy"] == 1 and still["pool/server1/fenced"] == 1
    # the next update loads the fenced server too: it rejoins and takes requests again
    assert stats2["sync/servers_loaded"] == 2 and final["pool/server1/fenced"] == 0
    assert final["pool/server1/version"] == 2 and final["pool/in_rotation"] == 2
    assert final["pool/server1/requests"] > fenced["pool/server1/requests"]
    assert_same_as_reference(again, reference)
    assert all(set(o.output_versions) == {2} for o in again)
    assert caught_up["pool/server1/fenced"] == 0 and caught_up["pool/rejoined_total"] == final["pool/rejoined_total"] + 1


def test_killed_server_leaves_rotation_and_its_requests_finish_elsewhere(servers, reference):
    victim = servers.procs[1]

    async def body(pool):
        client = PooledGenerationClient(pool)
        tasks = await freeze_mid_request(client, pool, pool.servers[1], victim, PROMPTS, servers.tok)
        os.kill(victim.pid, signal.SIGKILL)  # killed while frozen mid-request
        outs = await asyncio.gather(*tasks)
        gone = pool.stats()
        await pool.check_health()
        stats = await update_servers(pool, DiskWeightReceiver(), {"version": 3, "path": servers.weights}, 10.0)
        return outs, gone, stats, pool.stats()

    outs, gone, stats, final = with_pool(servers, body)
    assert_same_as_reference(outs, reference)
    assert gone["pool/server1/healthy"] == 0 and gone["pool/reissued"] >= 1 and gone["pool/reissued_tokens"] >= 3
    assert stats["sync/servers_loaded"] == 1 and final["pool/server1/fenced"] == 1
    assert final["pool/server0/version"] == 3 and final["pool/in_rotation"] == 1


def test_no_server_left_is_a_clear_error_not_a_hang(servers):
    dead = servers.urls[1]  # killed by the test before

    async def main():
        pool = ServerPool([HttpGenerationClient(dead)], health_interval_s=0.2).start()
        try:
            t0 = time.monotonic()
            while pool.stats()["pool/unhealthy"] == 0:  # the periodic health check finds it without any request
                assert time.monotonic() - t0 < 60, "the health check did not take the dead server out"
                await asyncio.sleep(0.05)
            assert pool.stats()["pool/reissued"] == 0  # no request was needed to find it
            with pytest.raises(NoServerError, match=r"no generation server in rotation .*0\.5") as err:
                await pool.acquire(timeout_s=0.5)  # its own timeout ended the wait (the message names it)
            assert dead in str(err.value)
            with pytest.raises(WeightUpdateError, match="v9: no generation server loaded it"):
                await update_servers(pool, DiskWeightReceiver(), {"version": 9, "path": servers.weights}, 1.0)
            asked = []

            async def recovery(answer):  # what a server keeper says: is a restarted server coming back?
                asked.append(answer)
                return answer

            pool.recovery = lambda: recovery(False)
            with pytest.raises(WeightUpdateError, match="v10: no generation server loaded it"):
                await update_servers(pool, DiskWeightReceiver(), {"version": 10, "path": servers.weights}, 1.0)
            pool.recovery = lambda: recovery(True)  # its restart will load v11: the update is not fatal
            stats = await update_servers(pool, DiskWeightReceiver(), {"version": 11, "path": servers.weights}, 1.0)
            assert stats["sync/servers_loaded"] == 0 and pool.version == 11 and asked == [False, True]
        finally:
            await pool.close()

    asyncio.run(main())


def test_a_version_pruned_before_the_server_loads_it_is_skipped_not_fenced(servers, tmp_path):
    """The trainer ran ahead (after a restart it trains on replayed data at once) and pruned v20 behind
    v21 and v22 before this side loaded it: the server carries on unfenced at the weights it holds,
    the update says it was superseded, and the next one loads. A path that is simply missing is
    still a failure that fences (the random-kill test once lost its rollout side to the former)."""
    publisher = DiskWeightPublisher(tmp_path / "weights", keep_last=1)
    state = load_file(os.path.join(servers.weights, "model.safetensors"))
    msgs = [publisher.publish(state, v) for v in (20, 21, 22)]  # v20 and v21 pruned behind v22

    async def main():
        pool = ServerPool([HttpGenerationClient(servers.urls[0])])  # server1 was killed by an earlier test
        receiver = DiskWeightReceiver()
        try:
            with pytest.raises(WeightsSuperseded, match="v20: pruned behind a newer version"):
                await update_servers(pool, receiver, msgs[0], 10.0)
            skipped = pool.stats()
            assert skipped["pool/in_rotation"] == 1 and skipped["pool/fenced_total"] == 0 and pool.version == 0
            client = PooledGenerationClient(pool)
            held = int((await pool.servers[0].client.get_model_info())["weight_version"])
            out = await asyncio.wait_for(client.generate(prompt_ids(servers.tok, PROMPTS[0]), GREEDY), 30)
            assert set(out.output_versions) == {held} and held < 20  # not left paused; at the weights it held
            loaded = await update_servers(pool, receiver, msgs[2], 10.0)
            assert loaded["sync/servers_loaded"] == 1 and loaded["sync/servers_superseded"] == 0
            assert pool.stats()["pool/server0/version"] == 22
            nowhere = {"version": 23, "path": str(version_dir(tmp_path / "nowhere", 23))}
            with pytest.raises(WeightUpdateError, match="v23: no generation server loaded it"):
                await update_servers(pool, receiver, nowhere, 10.0)
            assert pool.stats()["pool/fenced_total"] == 1
            await update_servers(pool, receiver, publisher.publish(state, 24), 10.0)
            assert pool.stats()["pool/in_rotation"] == 1
            out = await asyncio.wait_for(client.generate(prompt_ids(servers.tok, PROMPTS[0]), GREEDY), 30)
            assert set(out.output_versions) == {24}  # back, and not paused
        finally:
            await pool.close()

    asyncio.run(main())


def test_wrong_address_and_another_model_are_one_clear_error(servers):
    from async_rl.launch.rollout_proc import ready_pool

    cfg = load_config(DEBUG, [f"run_dir={servers.cfg.run_dir}", "rollout.connect_timeout_s=1"])
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=r"rollout.server_addrs\[1\]: .*127.0.0.1") as err:
        asyncio.run(ready_pool(cfg, [servers.urls[0], closed], True, servers.tok))
    assert "\n" not in str(err.value) and "not reachable after 1s" in str(err.value)  # its timeout ended the wait
    with pytest.raises(ValueError, match=r"rollout.server_addrs: .*http://"):
        asyncio.run(ready_pool(cfg, ["127.0.0.1:8000"], True, servers.tok))

    other_cfg = load_config(DEBUG, ["model.dtype=float32", "model.tiny_alphabet=01+="])
    other_tok = load_tokenizer(other_cfg.model)
    other = load_model(other_cfg.model, seed=0, tokenizer=other_tok)
    with BackgroundServer.for_model(other, other_tok, servers.cfg.engine, model_name="tiny") as small, \
            BackgroundServer.for_model(other, other_tok, servers.cfg.engine, model_name="smollm2-135m") as named:
        with pytest.raises(ValueError, match=r"rollout.server_addrs\[1\] .*vocabulary.*another model"):
            asyncio.run(ready_pool(cfg, [servers.urls[0], small], True, servers.tok))
        with pytest.raises(ValueError, match=r"rollout.server_addrs\[0\] .*serves model 'smollm2-135m'.*'tiny'"):
            asyncio.run(ready_pool(cfg, [named], True, servers.tok))


def test_a_server_brought_back_while_this_side_waits_for_it_is_found(servers):
    """`ready_pool` (async_rl/launch/rollout_proc.py) starts the watch, the server keeper, before its first wait: a
    server that is down when a restarted rollout side begins waiting, and that the keeper starts again on
    its port, is found. With the watch started after the wait, nobody starts it: the wait runs out."""
    from async_rl.launch.rollout_proc import ready_pool
    from async_rl.launch.serve import build_app, build_engine

    port = free_port()
    cfg = load_config(DEBUG, [f"run_dir={servers.cfg.run_dir}", "rollout.connect_timeout_s=20"])
    started = []

    class Keeper:
        """What the server keeper does for a dead server, a moment later: start it again on its port."""

        def __init__(self):
            self.timer = threading.Timer(1.0, self.restart)
            self.timer.start()

        def restart(self):
            engine = build_engine(servers.model, servers.tok, servers.cfg.engine).start()
            server = BackgroundServer(build_app(engine, model_name=cfg.model.name, tokenizer=servers.tok), engine,
                                      port=port, own_engine=True)
            started.append(server)
            server.start()

        async def close(self):
            self.timer.cancel()

    async def main():
        pool, keeper = await ready_pool(cfg, [f"http://127.0.0.1:{port}"], False, servers.tok, lambda pool: Keeper())
        await pool.close()
        await keeper.close()

    try:
        asyncio.run(main())
    finally:
        for server in started:
            server.stop()
    assert len(started) == 1

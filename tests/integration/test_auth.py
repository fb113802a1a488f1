"""Authentication, for real: CURVE on the trajectory queue (and so on the zmq weight channel it carries),
a bearer token on the generation server's HTTP API, and `async-rl keys` + a short authenticated run.

A producer without the CURVE keys, with a client key the trainer does not know, or holding another
trainer's server key is refused at the handshake: its `connect` fails at once saying why, a raw socket
pushing HELLO and a group gets nothing through and receives neither broadcasts nor weight buckets,
while an authorised producer in the same test pushes, receives a broadcast and a whole weight version.
Without `Authorization: Bearer <token>` every state-changing route (and /generate, /v1, /metrics)
answers 401 and changes nothing; /health and /get_model_info stay open; the right token works.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
import zmq

from async_rl.config import ConfigError, EngineConfig, ModelConfig, load_config, resolve_secret, save_config
from async_rl.engine.client import HttpGenerationClient
from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
from async_rl.transport.auth import HandshakeRefusedError, create_keys
from async_rl.transport.client import TrajectoryQueueClient
from async_rl.transport.messages import Group, Hello, pack
from async_rl.transport.queue import TrajectoryQueueServer
from async_rl.types import Trajectory
from async_rl.weight_sync.disk import load_weights
from async_rl.weight_sync.zmq_buckets import ZmqWeightPublisher, ZmqWeightReceiver
from async_rl.launch.serve import BackgroundServer
from served_weights import save_weights_dir

ROOT = Path(__file__).resolve().parents[2]
FAST = {"heartbeat_s": 0.1, "peer_timeout_s": 10.0}
TOKEN = "s3cret-token"


def make_group(producer: str, size: int = 4, r: int = 8) -> list[Trajectory]:
    return [Trajectory(id=f"{producer}-{j}", group_id=producer, prompt_ids=np.arange(4, dtype=np.int32),  # [P]
                       response_ids=np.arange(r, dtype=np.int32), loss_mask=np.ones(r, np.uint8),  # [R]
                       behav_logprobs=np.full(r, -0.5, np.float32), versions=np.zeros(r, np.int32),
                       reward=float(j), finish_reason="stop") for j in range(size)]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """The run's keys, another `async-rl keys` run's keys, and a producer with the right server key
    but a client key the trainer never admitted."""
    base = tmp_path_factory.mktemp("keys")
    create_keys(base / "run")
    create_keys(base / "other")
    stranger = base / "stranger"
    stranger.mkdir()
    shutil.copy(base / "run" / "server.key", stranger / "server.key")
    shutil.copy(base / "other" / "client.key_secret", stranger / "client.key_secret")
    return SimpleNamespace(run=str(base / "run"), other=str(base / "other"), stranger=str(stranger))


def _raw_intruder(addr: str, name: str, keys_dir: str | None) -> zmq.Socket:
    """A hand-made producer that says HELLO and pushes a group without waiting for anything."""
    from async_rl.transport.auth import client_curve_options

    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.IDENTITY, name.encode())
    for opt, value in (client_curve_options(keys_dir) if keys_dir else {}).items():
        raw.setsockopt(opt, value)
    raw.connect(addr)
    for msg in (Hello(producer_id=name, session=1), Group(seq=1, trajectories=tuple(make_group(name)))):
        try:  # once the refused handshake has dropped the connection, a DEALER has no peer to queue to
            raw.send_multipart(pack(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
    return raw


# --------------------------------------------------------------------------- the trajectory queue
def test_queue_admits_only_producers_with_an_authorised_key(keys, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="async_rl.transport.auth")
    state = {"w": torch.arange(3000, dtype=torch.float32).reshape(30, 100), "b": torch.ones(7)}
    with TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=16, curve_keys_dir=keys.run, **FAST) as server:
        intruders = [_raw_intruder(server.address, "raw-nokey", None),
                     _raw_intruder(server.address, "raw-stranger", keys.stranger)]
        try:
            got = asyncio.run(asyncio.wait_for(_queue_scenario(server, keys, tmp_path), 120))
            for raw in intruders:  # nothing ever reached them: no WELCOME, no control, no weight bucket
                assert not raw.poll(300), "a refused producer received something"
        finally:
            for raw in intruders:
                raw.close(0)
        stats = server.stats()
    groups, note, weights = got
    assert [t.id for g in groups for t in g] == [t.id for t in make_group("good")]
    assert stats["queue/received"] == 4 and stats["queue/producers"] == 0  # the good one said BYE
    assert stats["queue/auth_refused"] >= 5  # three clients and two raw sockets, at least once each
    assert note == {"kind": "note", "blob": b"x" * 1000}
    assert weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state)
    refusals = [r.getMessage() for r in caplog.records]
    # the stranger's key was refused twice (client and raw socket) from one address: logged once
    assert sum("refused a producer at 127.0.0.1" in m for m in refusals) == 1


async def _queue_scenario(server, keys, tmp_path):
    # which side notices a CURVE/NULL mismatch first is a race: either message names it
    refused = {"no CURVE at all": ({}, "one side uses CURVE and the other does not|a peer without CURVE"),
               "a client key not admitted": ({"curve_keys_dir": keys.stranger}, "not among the trainer's authorised"),
               "another trainer's server key": ({"curve_keys_dir": keys.other}, "closed the connection")}
    for why, (kwargs, message) in refused.items():
        client = TrajectoryQueueClient(server.address, producer_id=why.replace(" ", "-"), **FAST, **kwargs)
        with pytest.raises(HandshakeRefusedError, match=message):
            await client.connect(10)
        await client.close()

    good = TrajectoryQueueClient(server.address, producer_id="good", **FAST, curve_keys_dir=keys.run)
    receiver = ZmqWeightReceiver(tmp_path / "rollout", keep_last=2).attach(good)
    await good.connect(10)
    await good.put_group(make_group("good"))
    groups = await asyncio.to_thread(server.get_groups, 4, 10)
    controls = good.controls()
    server.broadcast({"kind": "note", "blob": b"x" * 1000})
    note = await asyncio.wait_for(controls.__anext__(), 10)
    publisher = ZmqWeightPublisher(server.broadcast, bucket_bytes=4096, deadline_s=30)
    state = {"w": torch.arange(3000, dtype=torch.float32).reshape(30, 100), "b": torch.ones(7)}
    sender = threading.Thread(target=lambda: server.broadcast(publisher.publish(state, 1)))
    sender.start()
    commit = await asyncio.wait_for(controls.__anext__(), 30)
    sender.join(30)
    weights = load_weights(await receiver.prepare(commit))  # the version's directory
    await good.close()
    return groups, note, weights


def test_missing_key_files_are_named(keys, tmp_path):
    with pytest.raises(ConfigError, match="transport.curve_keys_dir: no directory"):
        load_config(None, [f"transport.curve_keys_dir={tmp_path / 'nowhere'}"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"lacks .*server.key_secret \(trainer side\) and .*server.key"):
        load_config(None, [f"transport.curve_keys_dir={empty}"])
    trainer_only = tmp_path / "trainer_only"
    shutil.copytree(keys.run, trainer_only)
    (trainer_only / "client.key_secret").unlink()
    load_config(None, [f"transport.curve_keys_dir={trainer_only}"])  # a trainer machine's directory is valid
    with pytest.raises(ValueError, match=r"transport.curve_keys_dir: .*client.key_secret is missing; the rollout"):
        TrajectoryQueueClient("tcp://127.0.0.1:5555", curve_keys_dir=str(trainer_only))
    rollout_only = tmp_path / "rollout_only"
    shutil.copytree(keys.stranger, rollout_only)
    with pytest.raises(ValueError, match=r"server.key_secret is missing; the trainer side"):
        TrajectoryQueueServer("tcp://127.0.0.1:0", capacity=4, curve_keys_dir=str(rollout_only))


# --------------------------------------------------------------------------- the HTTP server
@pytest.fixture(scope="module")
def srv():
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
    bg = BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=16, api_key=TOKEN), model_name="tiny")
    url = bg.start()
    yield SimpleNamespace(url=url, engine=bg.engine, tok=tok, model=model)
    bg.stop()


def _http(url: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, timeout=60, trust_env=False, headers=headers)


def test_http_routes_need_the_bearer_token_but_health_and_model_info(srv, tmp_path):
    weights = save_weights_dir(srv.model, tmp_path / "w")
    prompt = srv.tok.encode("ab")
    guarded = [("POST", "/pause_generation", {"mode": "retract"}), ("POST", "/continue_generation", {}),
               ("POST", "/update_weights_from_disk", {"model_path": str(weights), "weight_version": "1"}),
               ("POST", "/abort_request", {"abort_all": True}), ("POST", "/flush_cache", None),
               ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                       "rank_offset": 1, "world_size": 2}),
               ("POST", "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}),
               ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}]}),
               ("GET", "/metrics", None), ("GET", "/get_server_info", None)]
    version = srv.engine.weight_version
    with _http(srv.url, None) as anonymous, _http(srv.url, "wrong") as wrong, _http(srv.url, TOKEN) as ok:
        for client in (anonymous, wrong):
            for method, path, body in guarded:
                resp = client.request(method, path, json=body)
                assert resp.status_code == 401, (path, resp.text)
                assert resp.headers["www-authenticate"] == "Bearer"
                assert "Authorization" in resp.json()["error"]["message"]
        assert srv.engine.weight_version == version and not srv.engine.paused  # nothing changed
        for path in ("/health", "/health_generate", "/get_model_info", "/model_info"):
            assert anonymous.get(path).status_code == 200, path
        assert anonymous.get("/openapi.json").status_code == 404  # no open schema either

        assert ok.post("/pause_generation", json={"mode": "retract"}).json()["success"]
        assert ok.get("/metrics").json()["engine/paused"] == 1.0
        update = ok.post("/update_weights_from_disk", json={"model_path": str(weights), "weight_version": str(version + 1)})
        assert update.status_code == 200 and update.json()["weight_version"] == version + 1
        assert ok.post("/continue_generation").status_code == 200
        assert ok.post("/abort_request", json={"abort_all": True}).status_code == 200
        out = ok.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2,
                                                                                 "ignore_eos": True}})
        assert len(out.json()["output_ids"]) == 2
        assert ok.get("/metrics").json()["engine/auth_refused"] == 2 * len(guarded)
        assert ok.get("/get_server_info").json()["engine_config"]["api_key"] == "<redacted>"


def test_http_client_sends_the_token(srv):
    prompt = srv.tok.encode("ab")

    async def main():
        from async_rl.types import SamplingParams

        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        anonymous = HttpGenerationClient(srv.url)
        await anonymous.wait_ready(10)  # /health is open
        assert (await anonymous.get_model_info())["tokenizer_path"] == "tiny"
        with pytest.raises(ValueError, match="Authorization"):
            await anonymous.pause_generation()
        with pytest.raises(ValueError, match="Authorization"):
            await anonymous.generate(prompt, params)
        await anonymous.close()
        client = HttpGenerationClient(srv.url, api_key=TOKEN)
        await client.pause_generation()
        await client.continue_generation()
        out = await client.generate(prompt, params)
        await client.close()
        return out

    assert len(asyncio.run(main()).output_ids) == 2


def test_api_key_from_the_environment_and_never_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_RL_TEST_TOKEN", "from-env")
    assert resolve_secret("env:ASYNC_RL_TEST_TOKEN", "engine.api_key") == "from-env"
    monkeypatch.delenv("ASYNC_RL_TEST_TOKEN")
    with pytest.raises(ConfigError, match="engine.api_key: environment variable 'ASYNC_RL_TEST_TOKEN'"):
        resolve_secret("env:ASYNC_RL_TEST_TOKEN", "engine.api_key")
    text = save_config(load_config(None, [f"engine.api_key={TOKEN}"]), tmp_path).read_text()
    assert TOKEN not in text and "api_key: <redacted>" in text


# --------------------------------------------------------------------------- the command line
def _routable_ip() -> str:
    """An address of this machine that other machines could reach (its route out), or the wildcard."""
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: it only picks the interface
        ip = probe.getsockname()[0]
    except OSError:
        ip = "0.0.0.0"
    finally:
        probe.close()
    return "0.0.0.0" if ip.startswith("127.") else ip


def test_keys_command_then_the_two_machine_example_is_refused_without_keys_and_runs_with_them(tmp_path):
    """docs/deployment.md's two machines, on one: the trainer binds an address other machines reach. Without
    keys `async-rl train` stops with one line naming transport.curve_keys_dir and `async-rl keys`; with the
    keys `async-rl keys` wrote (CURVE on the queue, the API token on the rollout side's servers) both sides run."""
    from async_rl.launch.common import free_port

    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", "keys", "--out", str(keys)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret", "authorized_clients/client.key",
                 "api_key"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600, name
    again = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", "keys", "--out", str(keys)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "never overwritten" in again.stderr

    ip = _routable_ip()
    bind = f"tcp://{ip}:{free_port()}"
    common = ["--config", str(ROOT / "configs" / "debug_cpu.yaml"), "total_steps=2", "weight_sync.transport=zmq",
              "trainer.batch_size=16", "task.eval_size=8", "log.progress=false"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    open_train = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", "train", *common, f"run_dir={tmp_path / 'x'}",
                                 f"transport.addr={bind}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert open_train.returncode == 2 and "transport.curve_keys_dir" in open_train.stderr, open_train.stderr
    assert "`async-rl keys --out DIR`" in open_train.stderr and open_train.stderr.count("error: ") == 1

    secured = [*common, f"transport.curve_keys_dir={keys}", f"engine.api_key=file:{keys / 'api_key'}"]
    train = subprocess.Popen([sys.executable, "-m", "async_rl.launch.cli", "train", *secured, f"run_dir={tmp_path / 'a'}",
                              f"transport.addr={bind}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    try:
        connect = bind if ip != "0.0.0.0" else bind.replace("0.0.0.0", "127.0.0.1")
        roll = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", "rollout", *secured, f"run_dir={tmp_path / 'b'}",
                               f"transport.addr={connect}"], cwd=ROOT, capture_output=True, text=True, timeout=400,
                              env=env)
        _, err = train.communicate(timeout=120)
    finally:
        train.kill()
    assert roll.returncode == 0, roll.stderr[-3000:]
    assert train.returncode == 0, err[-3000:]
    import json

    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert all(r["queue/auth_refused"] == 0 for r in rows)
    assert "CURVE on the trajectory queue" in (tmp_path / "a" / "logs" / "train.log").read_text()
    audited = subprocess.run([sys.executable, "-m", "async_rl.launch.cli", "audit", str(tmp_path / "a"), str(tmp_path / "b")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert audited.returncode == 0, audited.stdout  # the side's identity is its key on both ledgers

"""A generation server's port is its own from the moment it is picked, not from the moment uvicorn
starts serving after the model loads: a queue address that `async_rl.launch.common.free_port` picked and
ZeroMQ binds (with SO_REUSEADDR, as libzmq does on Linux) must not land on it. CI saw exactly that
race once: the server's later listen() failed with EADDRINUSE."""

import zmq

from async_rl.launch.serve import bind_socket, socket_url


def test_a_server_socket_holds_its_port_against_zeromq_from_the_start():
    sock = bind_socket("127.0.0.1", 0)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        port = sock.getsockname()[1]
        assert socket_url(sock) == f"http://127.0.0.1:{port}"
        try:
            pull.bind(f"tcp://127.0.0.1:{port}")
        except zmq.ZMQError as exc:
            assert exc.errno == zmq.EADDRINUSE
        else:
            raise AssertionError("ZeroMQ bound the server's port: the server would fail to listen later")
    finally:
        pull.close(0)
        ctx.term()
        sock.close()


def test_free_ports_are_drawn_where_the_kernel_never_hands_out_ports(monkeypatch, tmp_path):
    """Ports picked for later binds lie below the ephemeral range (bind(0) and outgoing connections
    draw from it), are bindable, and a host whose range leaves no room falls back to bind(0)."""
    import random
    import socket

    from async_rl.utils import ports

    start = ports.ephemeral_start()
    picked = {ports.free_port("127.0.0.1", random.Random(i)) for i in range(20)}
    assert all(ports.LOWEST <= p < start for p in picked) and len(picked) > 10
    assert not any(10001 <= p <= 19999 for p in picked)  # Ray's client and worker ports on a cluster node
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:  # a taken port is never returned: draw it first, then something else
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_start", lambda: taken + 1)
        monkeypatch.setattr(ports, "LOWEST", taken)
        assert ports.free_port("127.0.0.1") != taken
    finally:
        held.close()
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST)  # no room below the range
    assert ports.free_port("*") > 0


def test_requests_on_a_kept_alive_connection_answer_without_the_delayed_ack_wait():
    """The server socket names IPPROTO_TCP and sets TCP_NODELAY (inherited by the connections it accepts);
    without them every request on a kept-alive connection waited for the client's delayed ACK (Linux:
    >= 40 ms; 44 ms measured for /model_info), so each weight update's pause, load and continue cost
    ~130 ms of generation. The latency bound sits well under that wait and far over the ~1 ms answer."""
    import socket
    import statistics
    import time

    import httpx
    import torch

    from async_rl.config import EngineConfig, ModelConfig
    from async_rl.models import PRINTABLE, build_tiny_tokenizer, load_model
    from async_rl.launch.serve import BackgroundServer

    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()
    tok = build_tiny_tokenizer(PRINTABLE)
    model = load_model(ModelConfig(dtype="float32", tiny_alphabet=PRINTABLE), seed=0, tokenizer=tok)
    with torch.no_grad(), BackgroundServer.for_model(model, tok, EngineConfig(kv_cache_mb=4), model_name="t") as url:
        with httpx.Client(base_url=url, trust_env=False) as http:
            seconds = []
            for _ in range(12):
                t0 = time.perf_counter()
                assert http.get("/model_info").status_code == 200
                seconds.append(time.perf_counter() - t0)
    assert statistics.median(seconds[2:]) < 0.025, seconds

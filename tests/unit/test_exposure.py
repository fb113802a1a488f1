"""Closed by default (async_rl/utils/exposure.py): what listens where other machines reach it needs a key.

The queue (`transport.addr`) without `transport.curve_keys_dir`, a generation server (`engine.host`)
without `engine.api_key`: refused with one message naming the key and `async-rl keys`, unless the
address is this machine's alone or `insecure` opts out (with a warning). The queue itself refuses to
bind so, whoever builds it.
"""

import logging

import pytest

from async_rl.config import ConfigError, resolve_secret
from async_rl.transport.auth import create_keys
from async_rl.transport.queue import TrajectoryQueueServer
from async_rl.utils.exposure import ExposedError, check_queue, check_server, is_loopback, queue_host


@pytest.mark.parametrize("host,local", [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True),
                                        ("localhost", True), ("0.0.0.0", False), ("*", False), ("::", False),
                                        ("10.0.0.1", False), ("192.168.1.5", False), ("", False),
                                        ("no-such-host.invalid", False)])
def test_only_loopback_is_this_machines_alone(host, local):
    assert is_loopback(host) is local


def test_the_host_a_queue_address_binds():
    assert queue_host("tcp://10.0.0.1:5555") == "10.0.0.1" and queue_host("tcp://*:0") == "*"
    assert queue_host("tcp://[::1]:5555") == "::1"
    assert queue_host("ipc:///tmp/q.sock") is None and queue_host("inproc://q") is None


@pytest.mark.parametrize("addr", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.1:5555", "tcp://[::]:5555"])
def test_a_queue_other_machines_reach_needs_curve_keys(addr, caplog):
    with pytest.raises(ExposedError) as err:
        check_queue(addr, "", insecure=False)
    message = str(err.value)
    assert message.startswith("transport.curve_keys_dir: ") and "`async-rl keys --out DIR`" in message
    assert "\n" not in message and "transport.insecure=true" in message
    check_queue(addr, "/some/keys", insecure=False)  # keys: fine
    with caplog.at_level(logging.WARNING):
        check_queue(addr, "", insecure=True)
    assert "transport.insecure=true" in caplog.text  # opted out, loudly


@pytest.mark.parametrize("addr", ["tcp://127.0.0.1:5555", "tcp://localhost:0", "ipc:///tmp/q", "inproc://q"])
def test_a_queue_this_machine_alone_reaches_needs_no_key(addr):
    check_queue(addr, "", insecure=False)


def test_a_server_other_machines_reach_needs_an_api_key(caplog):
    with pytest.raises(ExposedError, match=r"^engine\.api_key: .*`async-rl keys --out DIR`"):
        check_server("0.0.0.0", "", insecure=False)
    check_server("0.0.0.0", "env:TOKEN", insecure=False)
    check_server("127.0.0.1", "", insecure=False)
    with caplog.at_level(logging.WARNING):
        check_server("0.0.0.0", "", insecure=True)
    assert "engine.insecure=true" in caplog.text


def test_the_queue_itself_refuses_to_bind_unguarded_where_others_reach_it(tmp_path):
    with pytest.raises(ExposedError, match="transport.curve_keys_dir"):
        TrajectoryQueueServer("tcp://0.0.0.0:0", capacity=8)
    create_keys(tmp_path / "keys")
    with TrajectoryQueueServer("tcp://0.0.0.0:0", capacity=8, curve_keys_dir=str(tmp_path / "keys")) as server:
        assert server.address.startswith("tcp://0.0.0.0:")
    with TrajectoryQueueServer("tcp://0.0.0.0:0", capacity=8, insecure=True) as server:
        assert server.address.startswith("tcp://0.0.0.0:")


def test_async_rl_keys_writes_an_api_token_that_engine_api_key_reads_from_its_file(tmp_path):
    written = create_keys(tmp_path / "keys")
    token = resolve_secret(f"file:{tmp_path / 'keys' / 'api_key'}", "engine.api_key")
    assert tmp_path / "keys" / "api_key" in written and len(token) >= 40
    assert (tmp_path / "keys" / "api_key").stat().st_mode & 0o077 == 0
    with pytest.raises(ConfigError, match="engine.api_key: .*missing or empty"):
        resolve_secret(f"file:{tmp_path / 'nothing'}", "engine.api_key")

"""CURVE encryption and authentication of the trajectory queue, and so of the zmq weight channel on it.

Keys are made once with `async-rl keys --out DIR` (`create_keys`), every file readable by its
owner only:

    DIR/server.key           the trainer's public key                 (both sides)
    DIR/server.key_secret    the trainer's key pair                   (trainer side only)
    DIR/client.key           a producer's public key
    DIR/client.key_secret    a producer's key pair                    (rollout side only)
    DIR/authorized_clients/  public keys of the producers the trainer admits (a copy of client.key;
                             admit another producer by copying its public key file here)
    DIR/api_key              a bearer token for the generation servers (engine.api_key=file:DIR/api_key)

With `transport.curve_keys_dir=DIR` the trainer's ROUTER is a CURVE server (`CurveServer`)
whose zmq context runs a ZAP handler that admits only the public keys of
DIR/authorized_clients. Everything on the connection is encrypted: trajectories, acks,
controls, BULK weight buckets. A refused producer never reaches the queue (no HELLO, no
broadcast, no weights). The trainer counts every refused handshake (`queue/auth_refused`),
logs a refused key once per peer address, and a handshake that fails before ZAP (no CURVE,
another server key) once per kind, and goes on serving the others. A refused producer's
`connect` fails at once with `HandshakeRefusedError` saying why (`client_handshake_error`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from async_rl.config import CURVE_KEY_FILES, missing_curve_files

logger = logging.getLogger(__name__)

KEY = "transport.curve_keys_dir"
AUTHORIZED = "authorized_clients"
API_KEY = "api_key"  # the generation servers' bearer token, beside the CURVE keys
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

# why a handshake failed, by (monitor event, value); value None = any value of that event
_WHY: dict[tuple[int, int | None], str] = {
    (zmq.EVENT_HANDSHAKE_FAILED_AUTH, None): "the client key is not among the trainer's authorised keys "
                                             f"({AUTHORIZED}/ of its {KEY})",
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
        f"one side uses CURVE and the other does not (set {KEY} on both sides, or on neither)",
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC):
        "the CURVE handshake did not decrypt: the producer holds another server public key than the trainer's",
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, None): "the handshake broke the protocol",
    (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, None): "the other side closed the connection during the handshake "
                                                  "(a peer without CURVE, or keys that do not match)",
}


class HandshakeRefusedError(PermissionError):
    """The trainer refused this producer's connection at the handshake (CURVE/ZAP)."""


def why_refused(event: int, value: int) -> str:
    return _WHY.get((event, value)) or _WHY.get((event, None)) or f"handshake failed (event {event}, {value})"


def create_keys(out_dir: str | os.PathLike) -> list[Path]:
    """Write a server and a client key pair, the authorised-clients directory and the generation servers' API
    token (`api_key`, for engine.api_key=file:DIR/api_key); never overwrite keys."""
    out = Path(out_dir)
    taken = [n for n in ("server.key", "server.key_secret", "client.key", "client.key_secret", AUTHORIZED, API_KEY)
             if (out / n).exists()]
    if taken:
        raise FileExistsError(f"keys --out: {out / taken[0]} exists; keys are never overwritten "
                              "(choose a new directory)")
    old_umask = os.umask(0o077)  # secret files are never readable by others, not even for a moment
    try:
        out.mkdir(parents=True, exist_ok=True)
        written = [Path(p) for name in ("server", "client") for p in zmq.auth.create_certificates(out, name)]
        (out / AUTHORIZED).mkdir()
        written.append(Path(shutil.copyfile(out / "client.key", out / AUTHORIZED / "client.key")))
        (out / API_KEY).write_text(secrets.token_urlsafe(32) + "\n")
        written.append(out / API_KEY)
    finally:
        os.umask(old_umask)
    for path in written:
        path.chmod(0o600)
    return written


def _keys_dir(keys_dir: str, side: str) -> Path:
    missing = missing_curve_files(keys_dir, side)
    if missing:
        raise ValueError(f"{KEY}: {Path(keys_dir) / missing[0]} is missing; the {side} side needs "
                         f"{' and '.join(CURVE_KEY_FILES[side])} (make keys with `async-rl keys --out DIR`)")
    return Path(keys_dir)


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, private = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{KEY}: {path} is not a key file ({exc})") from None
    if secret and not private:
        raise ValueError(f"{KEY}: {path} holds no secret key")
    if secret and path.stat().st_mode & 0o077:
        logger.warning("%s is readable by other users; chmod 600 it", path)
    return public, private


def client_curve_options(keys_dir: str) -> dict[int, bytes]:
    """Socket options that make a producer's socket a CURVE client of the trainer in `keys_dir`."""
    d = _keys_dir(keys_dir, "rollout")
    server_public, _ = _load(d / "server.key", secret=False)
    public, secret = _load(d / "client.key_secret", secret=True)
    return {zmq.CURVE_SERVERKEY: server_public, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}


def client_handshake_error(frames: list[Any], addr: str) -> HandshakeRefusedError:
    """The error a producer raises for a handshake-failed monitor event seen while connecting."""
    event = parse_monitor_message(frames)
    return HandshakeRefusedError(f"the trainer at {addr} refused this producer at the handshake: "
                                 f"{why_refused(event['event'], event['value'])}")


class _Zap(ThreadAuthenticator):
    """The stock ZAP thread, remembering the address of the request in hand (for the refusal log)."""

    peer = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)


class CurveServer:
    """Trainer side: a zmq context whose ZAP thread admits the keys of `keys_dir/authorized_clients`.

    `socket` makes the (one) CURVE server socket; its owner monitors it (transport/monitor.py),
    hands each failed handshake to `refused`, and calls `close` once the socket is closed."""

    def __init__(self, keys_dir: str):
        d = _keys_dir(keys_dir, "trainer")
        self.public, self.secret = _load(d / "server.key_secret", secret=True)
        try:
            self.allowed = set(zmq.auth.load_certificates(d / AUTHORIZED))  # z85 public keys
        except (OSError, ValueError) as exc:
            raise ValueError(f"{KEY}: cannot read {d / AUTHORIZED} ({exc})") from None
        if not self.allowed:
            raise ValueError(f"{KEY}: {d / AUTHORIZED} holds no public key (*.key); no producer could connect")
        self.context = zmq.Context()
        self._zap = _Zap(self.context, log=logging.getLogger(f"{__name__}.zap"))
        self._zap.start()
        self._zap.configure_curve_callback("*", credentials_provider=self)
        self._logged: set[Any] = set()
        logger.info("CURVE on the trajectory queue: %d authorised producer key(s) in %s", len(self.allowed),
                    d / AUTHORIZED)

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = self.secret, self.public
        return sock

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question (in its thread): is this z85 public key admitted?"""
        if key in self.allowed:
            return True
        if (self._zap.peer, key) not in self._logged:
            self._logged.add((self._zap.peer, key))
            logger.warning("refused a producer at %s: its client key %s... is not in %s/ (further refusals "
                           "of it are only counted in queue/auth_refused)", self._zap.peer,
                           key[:8].decode(errors="replace"), AUTHORIZED)
        return False

    def refused(self, event: dict[str, Any]) -> None:
        """A failed handshake the socket's monitor reported: logged once per kind (ZAP logs its own)."""
        kind = (event["event"], event["value"])
        if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH and kind not in self._logged:
            self._logged.add(kind)  # before ZAP: the monitor does not say which peer it was
            logger.warning("refused a connection at %s: %s (further ones are only counted in "
                           "queue/auth_refused)", event["endpoint"].decode(errors="replace"), why_refused(*kind))

    def close(self) -> None:
        """After the server socket is closed: stop the ZAP thread, end the context."""
        self._zap.stop()
        self.context.destroy(linger=0)

"""Authentication of every socket with ZeroMQ CURVE, keyed from a shared cluster secret.

Every process of a cluster knows the cluster secret (a file readable only by its owner).
From it we derive, deterministically, one CURVE key pair for servers and one for clients.
A peer without the secret cannot complete a handshake (it does not know the server's
public key) and a ZAP handler additionally admits only the derived client key, so a
process without the secret can neither call actors nor register as a node. Rejected
attempts are dropped and logged, without key material and a few lines per flood, by the
handshake monitor of each server socket (:mod:`rlactors.transport`).
"""

from __future__ import annotations

import hashlib
import os
import secrets as _secrets
import threading
from pathlib import Path

import structlog
import zmq
import zmq.auth.thread
from zmq.utils import z85

log = structlog.get_logger("rlactors.security")

__all__ = ["Security", "load_secret", "new_secret_file"]


def _derive_keypair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    seed = hashlib.blake2b(
        secret, key=b"rlactors-curve-v1", person=role.ljust(16, b"\0")[:16], digest_size=32
    )
    secret_key = z85.encode(seed.digest())
    return zmq.curve_public(secret_key), secret_key


MECHANISMS = ("curve", "plain")


class Security:
    """Socket authentication for a cluster, derived from its secret. Never logs or prints the secret.

    ``curve`` (default): CURVE handshake and encryption of every byte. ``plain``: the peer
    proves it knows a token derived from the secret (ZMQ PLAIN + ZAP) and traffic is not
    encrypted — for trusted networks (an HPC fabric) where encrypting tensors costs too much;
    a sniffer on the network could capture the token, never the secret file itself.
    """

    def __init__(self, secret: bytes, mechanism: str = "curve") -> None:
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        if mechanism not in MECHANISMS:
            raise ValueError(f"security mechanism must be one of {MECHANISMS}, not {mechanism!r}")
        self.mechanism = mechanism
        self.server_public, self._server_secret = _derive_keypair(secret, b"server")
        self.client_public, self._client_secret = _derive_keypair(secret, b"client")
        self._token = hashlib.blake2b(secret, key=b"rlactors-plain-v1", digest_size=24).hexdigest().encode()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._auth_lock = threading.Lock()

    def __repr__(self) -> str:  # keep keys out of logs and tracebacks
        return f"Security({self.mechanism})"

    def apply_server(self, sock: zmq.Socket) -> None:
        self._ensure_authenticator(sock.context)
        sock.zap_domain = b"rlactors"
        if self.mechanism == "plain":
            sock.plain_server = True
            return
        sock.curve_secretkey = self._server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def apply_client(self, sock: zmq.Socket) -> None:
        if self.mechanism == "plain":
            sock.plain_username = b"rlactors"
            sock.plain_password = self._token
            return
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self._client_secret

    def _ensure_authenticator(self, ctx: zmq.Context) -> None:
        with self._auth_lock:
            if self._auth is not None:
                return
            auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=_ZapLog())
            auth.start()
            if self.mechanism == "plain":
                auth.configure_plain(domain="rlactors", passwords={"rlactors": self._token.decode()})
            else:
                auth.configure_curve_callback(
                    domain="rlactors", credentials_provider=_Provider(self.client_public)
                )
            self._auth = auth

    def stop(self) -> None:
        with self._auth_lock:
            if self._auth is not None:
                self._auth.stop()
                self._auth = None


class _Provider:
    def __init__(self, allowed: bytes) -> None:
        self._allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        # A refusal is logged by the server socket's handshake monitor (rlactors.transport).
        return z85.encode(key) == self._allowed if len(key) == 32 else key == self._allowed


class _ZapLog:
    """Adapter: zmq.auth logs through this; denials are warnings, the rest debug."""

    def debug(self, msg: str, *args: object) -> None:
        pass

    info = debug

    def warning(self, msg: str, *args: object) -> None:
        log.warning("zap: " + (msg % args if args else msg))

    error = warning

    def exception(self, msg: str, *args: object) -> None:
        log.error("zap: " + (msg % args if args else msg))


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read a cluster secret file; refuses files others can read."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"cluster secret file {p} does not exist (create one with `rlactors secret {p}`)"
        )
    mode = p.stat().st_mode & 0o077
    if mode:
        raise PermissionError(
            f"cluster secret file {p} is readable by others (mode {oct(p.stat().st_mode & 0o777)}); chmod 600 it"
        )
    data = p.read_bytes().strip()
    if len(data) < 16:
        raise ValueError(f"cluster secret in {p} is too short (need at least 16 bytes)")
    return data


def new_secret_file(path: str | os.PathLike[str]) -> Path:
    """Create a new random secret file with mode 600 (does not overwrite an existing one)."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_secrets.token_urlsafe(32) + "\n")
    return p

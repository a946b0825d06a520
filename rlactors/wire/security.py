"""Authentication of every socket, keyed from a cluster secret, with two credentials.

Every process of a cluster holds one of two credentials. The **control** credential is the
cluster secret itself (a file readable only by its owner, or, for an embedded cluster over
ipc, random bytes in the driver's memory): drivers, the head and the node agents hold it,
and it opens the control plane — the head's ``spawn`` and ``register_node``, the agents'
``start_worker`` — which starts processes on every node. The **call** credential is derived
from the secret (one way): it opens actors, the head's lookups, events and key-value store,
and nothing that starts a process. A worker is handed only the call credential, unless its
actor was spawned with ``control=True``.

From the call credential we derive, deterministically, the servers' CURVE key pair and the
call clients' key pair; from the secret, the control clients' key pair. A ZAP handler admits
the client keys a process knows (the call key; the control key too where the process holds
it) and names each connection's credential in its ``User-Id``, so that a :class:`Service`
refuses a :func:`control_plane` method to a peer that connected with the call key. A client
presents the control key only to the head and the agents (:attr:`Security.calls` is what it
presents to actors). Rejected handshakes are dropped and logged, without key material and a
few lines per flood, by the handshake monitor of each server socket (:mod:`rlactors.wire.transport`).
"""

from __future__ import annotations

import hashlib
import os
import secrets as _secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog
import zmq
import zmq.auth.thread
from zmq.utils import z85

log = structlog.get_logger("rlactors.wire.security")

__all__ = [
    "SECRET_PREFIX",
    "Security",
    "control_plane",
    "control_plane_act",
    "is_control_plane",
    "is_secret",
    "load_secret",
    "module_allowed",
    "new_secret",
    "new_secret_file",
]

F = TypeVar("F", bound=Callable[..., Any])


def _derive_keypair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    seed = hashlib.blake2b(
        secret, key=b"rlactors-curve-v1", person=role.ljust(16, b"\0")[:16], digest_size=32
    )
    secret_key = z85.encode(seed.digest())
    return zmq.curve_public(secret_key), secret_key


def _token(secret: bytes, role: bytes) -> bytes:
    return hashlib.blake2b(secret, key=b"rlactors-plain-v2", person=role, digest_size=24).hexdigest().encode()


def call_credential_of(secret: bytes) -> bytes:
    """The call credential derived from a cluster secret (the secret cannot be recovered from it)."""
    return hashlib.blake2b(secret, key=b"rlactors-call-v1", digest_size=32).hexdigest().encode()


MECHANISMS = ("curve", "plain")
CALL, CONTROL = "call", "control"  # the two credentials; the PLAIN usernames


class Security:
    """Socket authentication for a cluster, from its secret (``control``: the secret, the default)
    or from a worker's call credential. Never logs or prints either.

    ``curve`` (default): CURVE handshake and encryption of every byte. ``plain``: the peer
    proves it knows a token derived from its credential (ZMQ PLAIN + ZAP) and traffic is not
    encrypted — for trusted networks (an HPC fabric) where encrypting tensors costs too much,
    and for ipc; a sniffer on the network could capture the tokens, never the secret itself.
    """

    def __init__(self, secret: bytes, mechanism: str = "curve", *, control: bool = True) -> None:
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        if mechanism not in MECHANISMS:
            raise ValueError(f"security mechanism must be one of {MECHANISMS}, not {mechanism!r}")
        self.mechanism = mechanism
        self.control = control
        self._secret = secret if control else None
        call = call_credential_of(secret) if control else secret
        self._call = call
        self.server_public, self._server_secret = _derive_keypair(call, b"server")
        self.client_public, self._client_secret = _derive_keypair(call, b"client")
        self._call_token = _token(call, b"call")
        self._control_public = self._control_secret = self._control_token = b""
        if control:
            self._control_public, self._control_secret = _derive_keypair(secret, b"control")
            self._control_token = _token(secret, b"control")
        self._calls: Security | None = None
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._auth_lock = threading.Lock()

    @classmethod
    def from_credential(cls, credential: str, mechanism: str) -> Security:
        """The Security of a worker, from what its agent handed it (:meth:`credential`)."""
        kind, _, value = credential.partition(":")
        if kind not in (CALL, CONTROL) or not value:
            raise ValueError("malformed rlactors credential")
        if kind == CONTROL:
            return cls(bytes.fromhex(value), mechanism)
        return cls(value.encode(), mechanism, control=False)

    def credential(self, *, control: bool) -> str:
        """What a worker needs to rebuild a Security: the call credential, or with ``control`` the
        secret itself (only from a process that holds it)."""
        if control:
            if self._secret is None:
                raise PermissionError(
                    "this process holds only the call credential; it cannot hand out control"
                )
            return f"{CONTROL}:{self._secret.hex()}"
        return f"{CALL}:{self._call.decode()}"

    @property
    def calls(self) -> Security:
        """This process's call credential alone: what it presents to actors (never the control key,
        which, over ``plain``, a server sees)."""
        if not self.control:
            return self
        if self._calls is None:
            self._calls = Security(self._call, self.mechanism, control=False)
        return self._calls

    def __repr__(self) -> str:  # keep keys out of logs and tracebacks
        return f"Security({self.mechanism}, {CONTROL if self.control else CALL})"

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
        """Present this process's strongest credential (the control one where it holds it)."""
        if self.mechanism == "plain":
            sock.plain_username = (CONTROL if self.control else CALL).encode()
            sock.plain_password = self._control_token if self.control else self._call_token
            return
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self._control_public if self.control else self.client_public
        sock.curve_secretkey = self._control_secret if self.control else self._client_secret

    def peer_has_control(self, frames: Sequence[Any]) -> bool:
        """Whether a message received on a server socket of ours came over a connection that
        presented the control credential (its ZAP ``User-Id``). False where we cannot tell."""
        if not self.control:
            return False
        want = CONTROL if self.mechanism == "plain" else self._control_public.decode()  # z85, as ZAP names it
        for f in frames:
            if isinstance(f, zmq.Frame):
                try:
                    return bool(f.get("User-Id") == want)
                except zmq.ZMQError:
                    return False
        return False

    def _ensure_authenticator(self, ctx: zmq.Context) -> None:
        with self._auth_lock:
            if self._auth is not None:
                return
            auth = _start_authenticator(ctx)
            if self.mechanism == "plain":
                passwords = {CALL: self._call_token.decode()}
                if self.control:
                    passwords[CONTROL] = self._control_token.decode()
                auth.configure_plain(domain="rlactors", passwords=passwords)
            else:
                allowed = {self.client_public} | ({self._control_public} if self.control else set())
                auth.configure_curve_callback(domain="rlactors", credentials_provider=_Provider(allowed))
            self._auth = auth

    def stop(self) -> None:
        with self._auth_lock:
            if self._auth is not None:
                self._auth.stop()
                self._auth = None


ZAP_REBIND_S = 2.0  # how long a new authenticator waits for a stopped one's ZAP address to free


def _start_authenticator(ctx: zmq.Context) -> zmq.auth.thread.ThreadAuthenticator:
    """A started ZAP handler on ``ctx``. A context has one ZAP address, and libzmq closes a socket
    in its own thread: right after another authenticator on ``ctx`` stopped (a cluster shut down
    and a new one started in the same process), binding it can fail with EADDRINUSE for a moment,
    so that is retried briefly."""
    deadline = time.monotonic() + ZAP_REBIND_S
    while True:
        auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=_ZapLog())
        try:
            auth.start()
            return auth
        except zmq.ZMQError as e:
            if auth.zap_socket is not None:
                auth.zap_socket.close(linger=0)
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


def control_plane(fn: F | None = None, *, what: str = "") -> Any:
    """Mark a served method as control plane: a :class:`Service` with security answers it only to
    peers that connected with the control credential (see the module docstring). ``what`` names
    the act in the refusal ("killing an actor"); ``@control_plane`` or
    ``@control_plane(what=...)``."""

    def mark(f: F) -> F:
        f.__rlactors_control__ = what or True  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def is_control_plane(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, "__rlactors_control__", False))


def control_plane_act(fn: Callable[..., Any]) -> str:
    """What a control-plane method does, as its refusal names it ('' when not said)."""
    what = getattr(fn, "__rlactors_control__", "")
    return what if isinstance(what, str) else ""


def module_allowed(module: str, prefixes: Sequence[str] | None) -> bool:
    """Whether an actor class's module passes an allow-list of dotted prefixes (None or empty:
    everything). ``"nodes"`` and ``"nodes."`` both admit ``nodes`` and ``nodes.*``, not ``nodes_x``."""
    if not prefixes:
        return True
    for p in prefixes:
        p = p.rstrip(".")
        if module == p or module.startswith(p + "."):
            return True
    return False


class _Provider:
    def __init__(self, allowed: set[bytes]) -> None:
        self._allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        # A refusal is logged by the server socket's handshake monitor (rlactors.wire.transport).
        return (z85.encode(key) if len(key) == 32 else key) in self._allowed


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


def new_secret() -> bytes:
    """A fresh random cluster secret (an embedded cluster over ipc keeps one in memory)."""
    return _secrets.token_urlsafe(32).encode()


def new_secret_file(path: str | os.PathLike[str]) -> Path:
    """Create a new random secret file with mode 600 (does not overwrite an existing one)."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_secret().decode() + "\n")
    return p


SECRET_PREFIX = "secret/"  # keys under it are read and written with the control credential only


def is_secret(key: str) -> bool:
    """Whether a key-value key is secret (the servers' API keys live under ``secret/``)."""
    return key.startswith(SECRET_PREFIX)

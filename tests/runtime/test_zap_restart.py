"""A process that stops a secured cluster and starts another at once gets its ZAP handler: libzmq
frees the context's one ZAP address in its own thread, a moment after the old handler stopped
(an embedded cluster per test, a service that reconnects)."""

from __future__ import annotations

import zmq

from rlactors.wire.security import _start_authenticator


def test_an_authenticator_starts_right_after_another_stopped() -> None:
    ctx = zmq.Context()
    try:
        for _ in range(100):  # without the retry, most of these fail with EADDRINUSE here
            auth = _start_authenticator(ctx)
            assert auth.is_alive()
            auth.stop()
    finally:
        ctx.term()

"""A small HTTP/1.1 layer over asyncio transports and httptools (uvicorn's C parser), in two
halves that share no code: :mod:`.server`, what the OpenAI-compatible endpoint serves on, and
:mod:`.client`, the keep-alive connection pools the rollout client posts through
(nodes/rollout/pool.py). Home-made because each is the least CPU per call of what was measured
(bench/RESULTS.md, "Rollout client" and "OpenAI-compatible endpoint"); tested at the protocol's
edges on raw sockets and by a property-based fuzz of answers (tests/rollout/test_http1*.py).
"""

from nodes.rollout.http1.client import ClientError, ClientPool, LineSink
from nodes.rollout.http1.server import (
    ErrorBody,
    Gate,
    Handler,
    HTTPLimits,
    HTTPServer,
    Request,
    Response,
    Stream,
)

__all__ = [
    "ClientError",
    "ClientPool",
    "ErrorBody",
    "Gate",
    "HTTPLimits",
    "HTTPServer",
    "Handler",
    "LineSink",
    "Request",
    "Response",
    "Stream",
]

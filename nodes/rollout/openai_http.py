"""What the OpenAI-compatible endpoint's routes share over HTTP: OpenAI's (or, on the Messages API's
routes, Anthropic's) error body as an answer (:class:`EndpointError`), JSON answers, the API key's
check and the ids of what it answers."""

from __future__ import annotations

import itertools
import os
import secrets
from typing import Any

import orjson

from nodes.rollout.http1 import Request, Response
from protocols.http import anthropic
from protocols.http.openai import error_body

__all__ = ["EndpointError", "api_key_is", "bearer_is", "json_response", "new_id", "read_json"]


class EndpointError(Exception):
    """A request the endpoint refuses: OpenAI's error body with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"
        self.headers: dict[str, str] = {}  # e.g. Retry-After on a 429

    def response(self, shape: str = "openai") -> Response:
        """The answer: OpenAI's error body, or Anthropic's (``shape="anthropic"``:
        ``{"type": "error", "error": {"type", "message"}}``, the type from the status)."""
        if shape == "anthropic":
            body = anthropic.error_body(self.status, str(self))
        else:
            body = error_body(str(self), self.type, self.param, self.code)
        out = json_response(body, self.status)
        out.headers.update(self.headers)
        return out


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, orjson.dumps(obj))


def bearer_is(header: str | None, key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time (as SGLang's servers compare theirs)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


def api_key_is(headers: dict[str, str], key: str) -> bool:
    """Whether a request carries ``key``: ``Authorization: Bearer <key>`` (OpenAI's SDK, the
    session API's clients) or ``x-api-key: <key>`` (Anthropic's SDK), compared in constant time."""
    if bearer_is(headers.get("authorization"), key):
        return True
    given = headers.get("x-api-key")
    return given is not None and secrets.compare_digest(given.strip().encode(), key.encode())


def new_id(prefix: str, sep: str = "_") -> str:
    """An id for a completion, a response or an output item: this process's random part (64 bits
    from :mod:`secrets`, drawn again in a forked child), then a count, so ids are unique across a
    run's processes without a ``uuid4`` per id. Not a secret: what an id names (a stored response)
    is found only through its own episode's base_url."""
    return f"{prefix}{sep}{_ids.prefix}{next(_ids.count):x}"


class _Ids:
    def __init__(self) -> None:
        self.draw()

    def draw(self) -> None:
        self.prefix, self.count = secrets.token_hex(8), itertools.count()


_ids = _Ids()
os.register_at_fork(after_in_child=_ids.draw)


def read_json(request: Request) -> Any:
    """The request's body, decoded (400 when it is not JSON)."""
    try:
        return orjson.loads(request.body)
    except orjson.JSONDecodeError as e:
        raise EndpointError(400, f"the request body is not valid JSON: {e}") from None

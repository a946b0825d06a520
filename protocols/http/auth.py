"""SGLang 0.5.23's HTTP authentication: which key opens which route, and the keys a client holds.

SGLang (``srt/utils/auth.py``) has two keys. ``--api-key`` guards normal routes (``/generate``,
``/model_info``, ...). Routes it marks admin (weight updates and groups, ``/flush_cache``,
``/abort_request``, pause and continue, ...) need the ``--admin-api-key`` when one is set (the
plain key no longer opens them), else the plain key, else nothing. ``/health*``, ``/ready*`` and
``/metrics`` are always open, as is ``OPTIONS``. A refused request gets 401 ``{"error":
"Unauthorized"}``; a token is ``Authorization: Bearer <key>``, compared in constant time.

:func:`decide` is that decision (the reference server's middleware uses it); :class:`ServerKeys`
is what a client holds: it picks the key a route needs (:meth:`ServerKeys.headers`), and is an
``httpx`` auth callable, so ``httpx.Client(auth=keys)`` sends the right key on every call.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from protocols.runtime.codec import register

__all__ = ["ADMIN_ROUTES", "OPEN_PREFIXES", "ServerKeys", "decide"]

# The routes SGLang 0.5.23 decorates ADMIN_OPTIONAL, among those an SGLang-protocol server of ours
# serves or a client of ours calls (http_server.py has more: LoRA, memory, profiling, ...).
ADMIN_ROUTES = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/get_weights_by_name",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/start_profile",
        "/stop_profile",
    }
)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang matches these by prefix


def _bearer_is(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, space, token = header.partition(" ")
    return bool(space) and scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def decide(
    method: str, path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None
) -> bool:
    """Whether SGLang 0.5.23 lets this request through (False: 401)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if path in ADMIN_ROUTES:
        key = admin_api_key or api_key
    else:  # normal, and any route the server does not have (404 only once the key is right)
        key = api_key
    return not key or _bearer_is(authorization, key)


@register
@dataclass(frozen=True)
class ServerKeys:
    """The keys an SGLang-protocol server was started with (``--api-key``, ``--admin-api-key``), as
    its clients hold them; empty: the server takes none. Never printed (``repr`` hides them)."""

    api_key: str = field(default="", repr=False)  # --api-key: every route but the open ones
    admin_api_key: str = field(default="", repr=False)  # --admin-api-key: the admin routes ("": api_key)

    @classmethod
    def new(cls) -> ServerKeys:
        """A fresh random pair (256 bits each)."""
        return cls(secrets.token_urlsafe(32), secrets.token_urlsafe(32))

    def __bool__(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def key_for(self, path: str) -> str:
        """The key ``path`` needs ("" for none): the admin key for an admin route when there is
        one, else the plain key."""
        if path.startswith(OPEN_PREFIXES):
            return ""
        if path in ADMIN_ROUTES:
            return self.admin_api_key or self.api_key
        return self.api_key

    def headers(self, path: str) -> dict[str, str]:
        """The ``Authorization`` header for ``path`` (none when it needs no key)."""
        key = self.key_for(path)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def server_args(self) -> list[str]:
        """The flags that start a server (SGLang's or ours) with these keys."""
        args = ["--api-key", self.api_key] if self.api_key else []
        return args + (["--admin-api-key", self.admin_api_key] if self.admin_api_key else [])

    def __call__(self, request: Any) -> Any:
        """As ``httpx``'s ``auth=``: set the key ``request``'s route needs."""
        key = self.key_for(request.url.path)
        if key:
            request.headers["Authorization"] = f"Bearer {key}"
        return request

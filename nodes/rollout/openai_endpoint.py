"""An OpenAI-compatible chat endpoint over the rollout plane, so agent code written against the
OpenAI SDK (or any framework that takes a ``base_url``) is trained unchanged.

``/v1/chat/completions`` renders the messages with the model's chat template (tools included,
nodes/rollout/chat.py), generates through an :class:`~nodes.rollout.client.SGLangClient` (aborts and
resumes, sticky routing, per-token policy versions, retries and failover as for any episode), reads
tool calls back from the output (Hermes ``<tool_call>`` blocks) and answers as OpenAI does, streamed
(SSE chunks, tool-call deltas included) or not (nodes/rollout/chat_completions.py).
``/v1/responses`` (OpenAI's Responses API, what the OpenAI Agents SDK calls) and ``/v1/messages``
(Anthropic's Messages API, what the Anthropic SDK calls; its ``/v1/messages/count_tokens`` too) are
served by the same turns, token-exact too (nodes/rollout/responses.py, nodes/rollout/messages.py).
``/v1/models`` lists the model.

Each episode has its own base_url (``/episodes/<id>/v1``; the standalone server's is ``/v1``), and
is one token sequence, continuation by continuation (nodes/rollout/turns.py: an agent that edits
its history starts another). This module is the HTTP side: the server, its routes, the key, paths
mounted beside them (online mode's session API), the episodes' base_urls and the standalone command
line. Errors are OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) with its status
codes (nodes/rollout/openai_http.py), Anthropic's (``{"type": "error", "error": {"type", "message"}}``)
on the Messages API's routes; no request stops the endpoint. The key, when set, is accepted as
``Authorization: Bearer <key>`` or as Anthropic's ``x-api-key: <key>``.

Standalone, in front of any SGLang or reference server::

    python -m nodes.rollout.openai_endpoint --server-url http://127.0.0.1:30000 --model-path DIR --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from nodes.rollout.chat_completions import answer_chat
from nodes.rollout.http1 import HTTPLimits, HTTPServer, Request, Response
from nodes.rollout.http1.server import internal_error
from nodes.rollout.messages import answer_count_tokens, answer_messages
from nodes.rollout.openai_http import EndpointError, api_key_is, json_response
from nodes.rollout.responses import answer_responses
from nodes.rollout.turns import DEFAULT_MAX_TOKENS, ChatRequest, Episode, Turn, Turns
from protocols.http.auth import ServerKeys

__all__ = ["ChatEndpoint", "ChatRequest", "EndpointArgs", "EndpointError", "Episode", "Turn"]

log = structlog.get_logger(__name__)

# what each route serves: [/episodes/<id>]/v1/...
ROUTES = {
    "/v1/chat/completions": "POST",
    "/v1/responses": "POST",
    "/v1/messages": "POST",
    "/v1/messages/count_tokens": "POST",
    "/v1/models": "GET",
}
# what answers each POST route: (turns, request, episode, client, model name) -> its answer
ANSWERS = {
    "/v1/chat/completions": answer_chat,
    "/v1/responses": answer_responses,
    "/v1/messages": answer_messages,
    "/v1/messages/count_tokens": answer_count_tokens,
}


class ChatEndpoint:
    """The OpenAI-compatible endpoint: ``client`` generates (an SGLangClient, or anything with its
    ``agenerate``; an episode may bring its own), ``tokenizer`` renders and decodes, ``model`` is the
    name ``/v1/models`` gives."""

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        model: str = "policy",
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        default_temperature: float = 1.0,
        tool_parser: str = "hermes",
        api_key: str = "",
        limits: HTTPLimits | None = None,
        counters: dict[str, int] | None = None,
    ) -> None:
        """``default_*``: what a request that does not say gets (OpenAI's temperature is 1);
        ``tool_parser``: how tool calls are read from the output (nodes/rollout/chat.py);
        ``api_key``: when set, every request must carry ``Authorization: Bearer <api_key>`` or
        ``x-api-key: <api_key>`` (else 401, from its headers, before any of its body is read), as the
        session API of online mode needs (nodes/rollout/sessions.py); ``limits``: the server's bounds
        (:class:`~nodes.rollout.http1.HTTPLimits`); ``counters``: where the server counts what it
        refused (``http_*``)."""
        self.api_key = api_key
        self.mounts: dict[str, Callable[[Request], Awaitable[Response | None]]] = {}
        self.client, self.tokenizer, self.model = client, tokenizer, model
        defaults = {"max_new_tokens": default_max_tokens, "temperature": default_temperature}
        self.turns = Turns(tokenizer, tool_parser, defaults)
        self.episodes: dict[str, Episode] = {}
        self.default = Episode("default", keep_samples=False)  # the standalone server's /v1
        self.url = ""
        self._server = HTTPServer(
            self._handle,
            lambda status, msg: EndpointError(status, msg).response(),
            limits,
            self._gate,
            counters,
        )
        self.counters = self._server.counters

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port); returns the root URL."""
        self.url = f"http://{host}:{await self._server.start(host, port)}"
        return self.url

    async def aclose(self) -> None:
        await self._server.aclose()

    def mount(self, prefix: str, handler: Callable[[Request], Awaitable[Response | None]]) -> None:
        """Serve the paths under ``prefix`` with ``handler`` (behind the same key), e.g. the session
        API's ``/rl/v1/``."""
        self.mounts[prefix] = handler

    def open_episode(self, episode_id: str | None = None, client: Any = None) -> tuple[Episode, str]:
        """A new episode and its base_url (give it to ``openai.AsyncOpenAI(base_url=...)``; the
        Anthropic SDK's ``base_url`` is the same without its ``/v1``); its completions generate
        through ``client`` (default: the endpoint's)."""
        ep = Episode(episode_id or uuid.uuid4().hex, client=client)
        self.episodes[ep.id] = ep
        return ep, f"{self.url}/episodes/{ep.id}/v1"

    def close_episode(self, episode_id: str) -> Episode:
        """Stop serving an episode; its samples are the caller's."""
        return self.episodes.pop(episode_id)

    async def _handle(self, request: Request) -> Response | None:
        """Route ``request``: ``[/episodes/<id>]/v1/chat/completions``, ``.../v1/responses`` and
        ``.../v1/messages[/count_tokens]`` (POST: :data:`ANSWERS`), ``.../v1/models`` (GET), the
        mounted paths (the key was checked from the head: :meth:`_gate`). Every failure is OpenAI's
        error body (Anthropic's on the Messages API's paths; a 500's names the id its log line
        carries); none stops the endpoint."""
        try:
            for prefix, handler in self.mounts.items():
                if request.path.startswith(prefix):
                    return await handler(request)
            ep: Episode | None = self.default
            route = request.path
            if route.startswith("/episodes/"):
                eid, _, rest = route[len("/episodes/") :].partition("/")
                ep, route = self.episodes.get(eid), "/" + rest
                if ep is None and route in ROUTES:
                    raise EndpointError(404, f"no episode {eid!r} is open here", code="episode_not_found")
            allowed = ROUTES.get(route)
            if allowed is None:
                raise EndpointError(404, f"{request.method} {request.path}: Not Found")
            if request.method != allowed:
                raise EndpointError(405, f"{request.method} {request.path}: Method Not Allowed")
            if route == "/v1/models":
                return json_response(
                    {
                        "object": "list",
                        "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "rlactors"}],
                    }
                )
            assert ep is not None
            if ep is self.default and self.client is None:  # e.g. online mode's: sessions only
                raise EndpointError(
                    404,
                    "this endpoint serves episodes only: use an episode's (a session's) base_url",
                    code="episode_not_found",
                )
            answer = ANSWERS[route]
            ep.inflight += 1
            try:
                return await answer(self.turns, request, ep, ep.client or self.client, self.model)
            finally:
                ep.inflight -= 1
        except EndpointError as e:
            return e.response(_shape(request.path))
        except Exception:  # a bug behind the endpoint: a 500 with an id, it serves on
            error_id = uuid.uuid4().hex[:12]
            log.exception("openai_endpoint.error", path=request.path, error_id=error_id)
            return EndpointError(500, internal_error(error_id)).response(_shape(request.path))

    def _gate(self, request: Request) -> Response | None:
        """The key, checked from the request's head: the server calls this before reading its body."""
        if self.api_key and not api_key_is(request.headers, self.api_key):
            return EndpointError(
                401,
                "a missing or wrong API key: send Authorization: Bearer <the run's key>",
                code="invalid_api_key",
            ).response(_shape(request.path))
        return None


def _shape(path: str) -> str:
    """The error shape a path's clients read: Anthropic's on the Messages API's, else OpenAI's."""
    return "anthropic" if "/v1/messages" in path else "openai"


@dataclass
class EndpointArgs:
    """The command line of ``python -m nodes.rollout.openai_endpoint``: the endpoint alone, in front
    of SGLang-protocol servers, to try an agent without training."""

    server_url: list[str] = field(default_factory=list)  # an SGLang or reference server (at least one)
    model_path: str = ""  # the served model's folder (its tokenizer and chat template); required
    model_name: str = ""  # the name /v1/models gives ("": the model folder's name)
    tool_parser: str = "hermes"  # how tool calls are read from the output: hermes (= qwen25) or module:fn
    host: str = "127.0.0.1"  # the address to listen on
    port: int = 8000  # the port to listen on (0: a free one)
    # the servers' --api-key ("": $RLACTORS_SERVER_API_KEY, else none)
    api_key: str = field(default="", repr=False)
    # the servers' --admin-api-key ("": $RLACTORS_SERVER_ADMIN_API_KEY, else none)
    admin_api_key: str = field(default="", repr=False)


def parse_args(argv: list[str] | None = None) -> EndpointArgs:
    """:class:`EndpointArgs` from the command line (flags, ``--help`` and defaults made from it)."""
    from nodes.common.flags import add_flags, from_namespace

    ap = argparse.ArgumentParser(
        prog="python -m nodes.rollout.openai_endpoint", description=EndpointArgs.__doc__
    )
    add_flags(ap, EndpointArgs)
    args: EndpointArgs = from_namespace(ap.parse_args(argv), EndpointArgs)
    if not args.server_url or not args.model_path:
        ap.error("--server-url (one or more) and --model-path are required")
    args.api_key = args.api_key or os.environ.get("RLACTORS_SERVER_API_KEY", "")
    args.admin_api_key = args.admin_api_key or os.environ.get("RLACTORS_SERVER_ADMIN_API_KEY", "")
    return args


def main(argv: list[str] | None = None) -> None:
    """Serve the endpoint in front of SGLang-protocol servers (:class:`EndpointArgs`)."""
    args = parse_args(argv)

    async def serve() -> None:
        from pathlib import Path

        from transformers import AutoTokenizer

        from nodes.rollout.client import ClientConfig, SGLangClient

        tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
        keys = ServerKeys(args.api_key, args.admin_api_key)
        client = SGLangClient(args.server_url, ClientConfig(keys=keys))
        name = args.model_name or Path(args.model_path).name
        endpoint = ChatEndpoint(client, tokenizer, name, tool_parser=args.tool_parser)
        url = await endpoint.start(args.host, args.port)
        print(f"base_url: {url}/v1", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await endpoint.aclose()
            await client.aclose()

    run: Any = asyncio.run
    try:
        import uvloop

        run = uvloop.run  # the loop a rollout actor (and so its endpoint) runs on
    except ImportError:
        pass
    try:
        run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

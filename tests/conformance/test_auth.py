"""Authentication as SGLang 0.5.23 does it (``--api-key``, ``--admin-api-key``), on the reference
server and on SGLang's own code, with the keys; and the launcher's choice of when to use keys.

SGLang's side is its unchanged ``srt/utils/auth.py`` middleware in front of every route its
``srt/entrypoints`` declare, at the level each is decorated with (tests/conformance/sglang_auth_app.py,
run by SGLang's venv: seconds, where its full server takes minutes on CPU). Wherever SGLang's venv
is present (``scripts/sglang-setup.sh``; the SGLang stage), every answer's 401-or-not is compared
with the reference server's; without it, with :func:`protocols.http.auth.decide`, itself checked against
SGLang there. A full SGLang server with keys runs in tests/sglang/test_recipe_sglang.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nodes.common.procs import free_port
from nodes.inference.launcher import ReferenceServerConfig, ServerSupervisor, SGLangServerConfig, wants_keys
from protocols.http.auth import ServerKeys, decide
from tests.helpers.servers import start_reference_server, stop_server

HERE = Path(__file__).resolve().parent
SGLANG_PYTHON = (
    os.environ.get("RLACTORS_CONFORMANCE_SGLANG")
    or os.environ.get("RLACTORS_SGLANG_PYTHON")
    or str(Path.home() / ".cache" / "rlactors" / "sglang-0.5.23" / "bin" / "python")
)
HAVE_SGLANG = Path(SGLANG_PYTHON).exists()

KEY, ADMIN = "plain-key-1", "admin-key-2"
CONFIGS = {"api": ServerKeys(KEY, ""), "admin": ServerKeys("", ADMIN), "both": ServerKeys(KEY, ADMIN)}
TOKENS = {
    "none": None,
    "wrong": "Bearer wrong-key",
    "plain": f"Bearer {KEY}",
    "admin": f"Bearer {ADMIN}",
    "lowercase": f"bearer {KEY}",  # the scheme is case-insensitive
    "basic": f"Basic {KEY}",  # not a bearer token
    "bare": KEY,
}
# every route of the reference server, and one it does not have (checked before the 404)
ROUTES = [
    ("POST", "/generate"), ("PUT", "/generate"), ("POST", "/abort_request"), ("POST", "/pause_generation"),
    ("POST", "/continue_generation"), ("GET", "/flush_cache"), ("POST", "/flush_cache"), ("GET", "/health"),
    ("GET", "/health_generate"), ("GET", "/model_info"), ("GET", "/get_model_info"),
    ("GET", "/get_weight_version"), ("POST", "/update_weight_version"), ("GET", "/server_info"),
    ("GET", "/get_server_info"), ("GET", "/v1/loads"), ("GET", "/get_weights_by_name"),
    ("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
    ("POST", "/update_weights_from_distributed"), ("POST", "/update_weights_from_tensor"),
    ("POST", "/destroy_weights_update_group"),
    ("POST", "/begin_weight_update"), ("POST", "/end_weight_update"), ("GET", "/no_such_route"),
    ("OPTIONS", "/generate"),
]  # fmt: skip


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as c:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{url} exited with {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if c.get(url + "/health").status_code == 200:
                    return
            time.sleep(0.1)  # start-up poll interval
    raise AssertionError(f"{url} did not come up in {timeout_s} s")


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[tuple[str, str], str]]:
    """(server, key config) -> URL: a sim reference server per config (keys as flags), and SGLang's
    auth app per config when its venv is here."""
    procs: list[tuple[subprocess.Popen, bool]] = []
    urls: dict[tuple[str, str], str] = {}
    try:
        if HAVE_SGLANG:  # start these first: they come up while the reference servers start
            for name, keys in CONFIGS.items():
                port = free_port()
                args = [str(port), keys.api_key or "-", keys.admin_api_key or "-"]
                p = subprocess.Popen(
                    [SGLANG_PYTHON, str(HERE / "sglang_auth_app.py"), *args], start_new_session=True
                )
                procs.append((p, False))
                urls["sglang", name] = f"http://127.0.0.1:{port}"
        for name, keys in CONFIGS.items():
            proc, url = start_reference_server(["--backend", "sim", *keys.server_args()])
            procs.append((proc, True))
            urls["reference", name] = url
        for (server, _), url in urls.items():
            if server == "sglang":
                _wait_up(
                    url, next(p for p, ours in procs if not ours and str(p.args[2]) == url.rsplit(":", 1)[1])
                )
        yield urls
    finally:
        for p, ours in procs:
            if ours:
                stop_server(p)
            else:
                p.terminate()
                p.wait(timeout=20)


def _answers(url: str) -> dict[tuple[str, str, str], tuple[int, bytes]]:
    """(method, path, token) -> (status, body) for every route and token."""
    out = {}
    with httpx.Client(base_url=url, timeout=30) as c:
        for method, path in ROUTES:
            for token, header in TOKENS.items():
                headers = {"Authorization": header} if header else {}
                content = b"{not json" if method in ("POST", "PUT") else None  # refused before it runs
                r = c.request(method, path, headers=headers, content=content)
                out[method, path, token] = (r.status_code, r.content)
    return out


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_route_and_token_as_sglang_decides(servers: dict, config: str) -> None:
    keys = CONFIGS[config]
    ours = _answers(servers["reference", config])
    theirs = _answers(servers["sglang", config]) if HAVE_SGLANG else None
    for (method, path, token), (status, body) in ours.items():
        allowed = decide(method, path, TOKENS[token], keys.api_key, keys.admin_api_key)
        where = f"{method} {path} with token {token!r}, keys {config}"
        assert (status != 401) == allowed, f"{where}: {status} {body[:200]!r}"
        if status == 401:
            assert body == b'{"error":"Unauthorized"}', where
        if theirs is not None:
            their_status, their_body = theirs[method, path, token]
            assert (their_status == 401) == (status == 401), f"{where}: SGLang {their_status}, ours {status}"
            if their_status == 401:
                assert their_body == body, where


def test_the_levels_spelled_out(servers: dict) -> None:
    """The rules in words, on the reference server with both keys (and with only the plain key)."""
    both, api = servers["reference", "both"], servers["reference", "api"]

    def status(url: str, method: str, path: str, key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, url + path, headers=headers, content=b"{}", timeout=30).status_code

    assert status(both, "GET", "/model_info", None) == 401
    assert status(both, "GET", "/model_info", KEY) == 200
    assert status(both, "GET", "/model_info", ADMIN) == 401  # normal routes take the plain key only
    assert (
        status(both, "POST", "/update_weight_version", KEY) == 401
    )  # admin: the plain key no longer opens it
    assert (
        status(both, "POST", "/update_weight_version", ADMIN) == 400
    )  # through, then refused: no new_version
    assert status(both, "GET", "/health_generate", None) == 200  # open for probes
    assert status(both, "GET", "/no_such_route", KEY) == 404  # the key first, then the 404
    assert status(api, "POST", "/update_weight_version", KEY) == 400  # no admin key: the plain one opens it
    info = httpx.get(both + "/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    assert KEY not in info and ADMIN not in info  # /server_info lists the arguments, not the keys


@pytest.mark.skipif(not HAVE_SGLANG, reason=f"SGLang 0.5.23 not installed at {SGLANG_PYTHON}")
def test_our_admin_routes_are_sglangs() -> None:
    """protocols.http.auth.ADMIN_ROUTES holds exactly the routes SGLang decorates admin among those it lists."""
    from protocols.http.auth import ADMIN_ROUTES

    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import sglang_auth_app as m; " + (
        "print('\\n'.join(p for p, _, level in m.declared_routes() if level))"
    )
    out = subprocess.run([SGLANG_PYTHON, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    theirs = set(out.stdout.split())
    assert ADMIN_ROUTES - {"/update_weights_from_tensor", "/start_profile", "/stop_profile"} <= theirs
    assert {"/update_weights_from_tensor", "/start_profile", "/stop_profile"} <= theirs


# -- the launcher ---------------------------------------------------------------------------------


def test_launcher_default_keys_beyond_loopback_only() -> None:
    ref = ReferenceServerConfig(backend="sim")
    assert not ServerSupervisor(ref, host="127.0.0.1").keys  # loopback: none by default
    assert not ServerSupervisor(ref, host="localhost").keys
    remote = ServerSupervisor(ref, host="10.1.2.3", port=1).keys  # beyond loopback: always (not started here)
    assert remote.api_key and remote.admin_api_key and remote.api_key != remote.admin_api_key
    assert ServerSupervisor(ref, host="10.1.2.3", port=1).keys != remote  # a fresh pair unless one is given
    given = ServerKeys.new()
    assert ServerSupervisor(ref, host="192.168.0.7", port=1, keys=given).keys == given
    assert ServerSupervisor(ReferenceServerConfig(auth="on"), host="127.0.0.1", keys=given).keys == given
    assert not ServerSupervisor(ReferenceServerConfig(auth="off"), host="10.1.2.3", port=1).keys
    assert (
        wants_keys("auto", "0.0.0.0")
        and wants_keys("auto", "node7.cluster")
        and not wants_keys("auto", "::1")
    )
    with pytest.raises(ValueError, match="auth = 'yes'"):
        wants_keys("yes", "127.0.0.1")


def test_launcher_gives_sglang_its_keys_in_a_private_file() -> None:
    """SGLang takes keys only as flags: they go in a --config file only this user can read, not
    on the command line other users can see; the file goes with the server."""
    given = ServerKeys.new()
    sup = ServerSupervisor(SGLangServerConfig(model_path="m", auth="on"), host="127.0.0.1", keys=given)
    path = sup._key_file()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        import yaml  # SGLang reads it with yaml.safe_load

        assert yaml.safe_load(path.read_text()) == {
            "api-key": given.api_key,
            "admin-api-key": given.admin_api_key,
        }
    finally:
        asyncio.run(sup.stop())
    assert not path.exists()


async def test_launcher_starts_a_keyed_server_on_request() -> None:
    """auth = "on" on loopback: the reference server refuses a request without the key, answers
    with it, and the key is not on its command line."""
    sup = ServerSupervisor(ReferenceServerConfig(backend="sim", auth="on"), host="127.0.0.1")
    await sup.start()
    try:
        async with httpx.AsyncClient(base_url=sup.url, timeout=30) as c:
            assert (await c.get("/model_info")).status_code == 401
            assert (await c.post("/pause_generation", json={})).status_code == 401
            assert (await c.get("/model_info", headers=sup.keys.headers("/model_info"))).status_code == 200
        async with httpx.AsyncClient(base_url=sup.url, timeout=30, auth=sup.keys) as c:  # as our clients
            assert (await c.post("/pause_generation", json={})).status_code == 200
            assert (await c.post("/continue_generation", json={})).status_code == 200
        assert sup.proc is not None
        cmdline = await asyncio.to_thread(Path(f"/proc/{sup.proc.pid}/cmdline").read_bytes)
        assert sup.keys.api_key.encode() not in cmdline and sup.keys.admin_api_key.encode() not in cmdline
    finally:
        await sup.stop()

"""The side of a verifiers v1 environment that runs in the environment's own Python environment
(nodes/rollout/environments/pyenvs.py made it), run by path with that environment's interpreter:
it imports verifiers and the standard library only, never rlactors.

``describe``: resolve the env config (``vf.resolve_env_config``), check that the installed
verifiers speaks the wire this file was written for, install what the harness's program needs
(``Harness.setup`` on a local subprocess runtime: a PEP 723 script's packages, once, now rather than
at an episode), and print the taskset's tasks as JSON. ``server``: verifiers' own env server
(``serve_env``, as prime-rl runs it) on a ZeroMQ address. ``bridge``: an HTTP front for the rollout
actors, driving episodes with verifiers' own client (``EnvClient``): ``GET /health`` (whether the env
server was heard from within ``SILENT_S``: a health answer or an episode's reply), ``POST /run`` (one episode; its traces' rewards, metrics, agents and
ids as JSON). nodes/rollout/environments/verifiers_v1.py is the trainer's side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Any

SUPPORTED = ("0.4.",)  # verifiers releases whose wire this bridge speaks (tests/envs/test_v1_contract.py)
API_KEY_VAR = "RLACTORS_EPISODE_API_KEY"  # the episodes' endpoint key, by name (not Prime's)
SILENT_S = 30.0  # the env server heard from nothing this long is unhealthy (its actor replaces it)
clock = time.monotonic  # the bridge's clock (tests move it)


def wire_problems() -> list[str]:
    """What of verifiers' wire differs from what this bridge uses (empty: it matches)."""
    import verifiers
    import verifiers.v1 as vf
    from verifiers.v1.serve import EnvClient, RunRequest

    problems = []
    if not verifiers.__version__.startswith(SUPPORTED):
        problems.append(
            f"verifiers {verifiers.__version__} is not a supported release ({', '.join(SUPPORTED)}x)"
        )
    expect = {
        RunRequest: {"task_data", "client", "model", "sampling"},
        vf.WireEpisode: {"traces", "errors", "ok", "is_timeout"},
        vf.Trace: {"id", "agent", "rewards", "metrics", "errors", "ok", "is_timeout", "calls"},
        vf.Reward: {"score", "weight"},
        vf.AgentInfo: {"name", "trainable"},
        vf.EvalClientConfig: {"base_url", "api_key_var", "headers", "type"},
    }
    for cls, fields in expect.items():
        if missing := fields - set(cls.model_fields):
            problems.append(f"{cls.__name__} lacks {sorted(missing)}")
    for name in ("run", "health", "wait_for_server_startup", "close"):
        if not callable(getattr(EnvClient, name, None)):
            problems.append(f"EnvClient has no {name}()")
    import inspect

    from verifiers.v1.serve.server import EnvServer

    if "max_concurrent" not in inspect.signature(EnvServer.__init__).parameters:
        problems.append("EnvServer takes no max_concurrent (the gate on episodes in flight)")
    from verifiers.v1.clients.client import SESSION_ID_HEADER

    if SESSION_ID_HEADER != "X-Session-ID":
        problems.append(f"the session header is {SESSION_ID_HEADER!r}, not 'X-Session-ID'")
    return problems


def describe(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved env config, the wire check and the taskset's tasks (``describe``)."""
    import verifiers

    try:
        problems = wire_problems()
    except ImportError as e:  # an older verifiers: no verifiers.v1, or not the parts used here
        problems = [f"{type(e).__name__}: {_line(e)}"]
    if problems:
        return {"error": f"verifiers {verifiers.__version__}'s wire does not match: " + "; ".join(problems)}
    import verifiers.v1 as vf

    try:
        cfg = vf.resolve_env_config(config)
        tasks = [task.data.model_dump(mode="json") for task in vf.load_taskset(cfg.taskset)]
        env = vf.load_environment(cfg)
    except Exception as e:  # the user's taskset: its failure is one line for the run's config error
        return {"error": f"{type(e).__name__}: {_line(e)}"}
    harnesses = {name: h.id for name, h in cfg.agent_harnesses().items()}
    asyncio.run(_prepare_programs(cfg))
    return {
        "verifiers": verifiers.__version__,
        "env_id": cfg.env_id,
        "env_class": type(env).__name__,
        "harnesses": harnesses,
        "tasks": tasks,
    }


async def _prepare_programs(cfg: Any) -> None:
    """Install what each local harness's program needs (its PEP 723 script's environment) now."""
    import verifiers.v1 as vf
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    for name, h in cfg.agent_harnesses().items():
        runtime_cfg = getattr(getattr(cfg, name), "runtime", None)
        if not isinstance(runtime_cfg, vf.SubprocessConfig):
            continue
        # a name of its own: verifiers makes the runtime's folder with mkdir (no exist_ok), and two
        # runs may describe at once, or a killed one may have left its folder behind
        runtime = SubprocessRuntime(runtime_cfg, name=f"rlactors-prepare-{name}-{uuid.uuid4().hex[:12]}")
        await runtime.start()
        try:
            await vf.load_harness(h).setup(runtime)
        finally:
            await runtime.teardown()


def serve(config: dict[str, Any], address: str, max_concurrent: int | None = None) -> None:
    """verifiers' env server on ``address`` until SIGTERM (``server``), running at most
    ``max_concurrent`` episodes at once (verifiers' gate; None: no bound)."""
    import verifiers.v1 as vf
    from verifiers.v1.serve import serve_env

    serve_env(
        max_workers=1, address=address, config=vf.resolve_env_config(config), max_concurrent=max_concurrent
    )


async def bridge(address: str, host: str, port: int, silent_s: float = SILENT_S) -> None:
    """The HTTP front of the env server at ``address`` (``bridge``); prints ``ready`` when serving."""
    from aiohttp import web
    from verifiers.v1.serve import EnvClient

    client = EnvClient(address)
    # The env server answers health on the loop that starts every episode's program: with many
    # episodes in flight on a loaded machine its answer can take longer than one probe of ours. So
    # /health answers at once from the last time the server was heard (a health answer, or an
    # episode's reply), and a probe of its own runs in the background: a server silent for
    # silent_s is unhealthy. A server whose process ends is found by its actor at once.
    heard = {"at": clock()}
    probing: list[asyncio.Task[None]] = []

    async def probe() -> None:
        if await client.health(timeout=silent_s):
            heard["at"] = clock()

    async def health(_: web.Request) -> web.Response:
        if not probing or probing[0].done():
            probing[:] = [asyncio.create_task(probe())]
        silent = clock() - heard["at"]
        ok = silent < silent_s
        return web.json_response({"ok": ok, "silent_s": round(silent, 1)}, status=200 if ok else 503)

    async def run(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            episode = await client.run(
                client={"type": "eval", "base_url": body["base_url"], "api_key_var": API_KEY_VAR},
                model=body["model"],
                sampling=body.get("sampling") or {},
                task_data=body["task"],
            )
        except Exception as e:  # the env server's failure, as data: the trainer drops the group
            return web.json_response({"error": f"{type(e).__name__}: {_line(e)}"})
        heard["at"] = clock()
        return web.json_response(_summary(episode))

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_get("/health", health)
    app.router.add_post("/run", run)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await client.close()


def _summary(episode: Any) -> dict[str, Any]:
    """What the trainer reads of an episode: per trace its id (the X-Session-ID of its model
    calls), agent, trainability, rewards ``{name: {score, weight}}``, metrics and errors."""

    def errors(errs: list[Any]) -> list[str]:
        return [f"{e.type}: {_line(e.message)}" for e in errs]

    return {
        "ok": episode.ok,
        "is_timeout": episode.is_timeout,
        "errors": errors(episode.errors),
        "traces": [
            {
                "id": t.id,
                "agent": t.agent.name,
                "trainable": t.agent.trainable,
                "ok": t.ok,
                "is_timeout": t.is_timeout,
                "errors": errors(t.errors),
                "calls": len(t.calls),
                "rewards": {
                    k: None if r is None else {"score": r.score, "weight": r.weight}
                    for k, r in t.rewards.items()
                },
                "metrics": dict(t.metrics),
            }
            for t in episode.traces
        ],
    }


def _line(e: Any) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("describe")
    d.add_argument("--config", required=True, help="the env config, JSON")
    s = sub.add_parser("server")
    s.add_argument("--config", required=True, help="the env config, JSON")
    s.add_argument("--address", required=True, help="tcp://host:port")
    s.add_argument("--max-concurrent", type=int, default=None, help="episodes run at once (more wait)")
    b = sub.add_parser("bridge")
    b.add_argument("--address", required=True, help="the env server's tcp://host:port")
    b.add_argument("--host", required=True)
    b.add_argument("--port", type=int, required=True)
    b.add_argument(
        "--silent-s", type=float, default=SILENT_S, help="the env server unheard this long: unhealthy"
    )
    args = ap.parse_args(argv)
    if args.cmd == "describe":
        json.dump(describe(json.loads(args.config)), sys.stdout)
    elif args.cmd == "server":
        serve(json.loads(args.config), args.address, args.max_concurrent)
    else:
        try:
            asyncio.run(bridge(args.address, args.host, args.port, args.silent_s))
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()

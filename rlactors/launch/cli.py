"""The ``rlactors`` command: ``up cluster.toml``, ``status``, ``stack``, ``pool``, ``down``, ``secret``,
and the commands other packages contribute through the ``rlactors.commands`` entry-point group
(``export``, from nodes/trainer/export.py), which this layer never imports by name.

``up`` starts the head and one node agent per host (locally, over ssh, or with srun inside
a Slurm allocation), waits until every node has registered, and records the cluster in
``$RLACTORS_STATE_DIR/cluster.json`` (default ``~/.rlactors``) so that ``status``,
``down`` and ``rlactors.connect()`` find it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.status import Status
from rich.table import Table

from rlactors.api.runs import NoSuchRun, live_runs, read_run, read_state, state_file
from rlactors.base.errors import ActorNotFoundError, ClusterError
from rlactors.launch.config import (
    ClusterConfig,
    ConfigError,
    NodeConfig,
    agent_command,
    head_command,
    load_cluster_config,
)
from rlactors.wire.security import new_secret_file

console = Console(stderr=True)
out = Console()


def _tail(path: Path, n: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _launch(cmd: list[str], log: Path, cwd: str | None = None) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd
        )


async def _nodes(address: str, secret: str, security: str) -> list[dict[str, Any]]:
    from rlactors.api.cluster import connect

    cluster = await connect(address, secret_file=secret, timeout=5, security=security)
    try:
        return await cluster.nodes()
    finally:  # leave, not just close: a head told to stop waits for the clients still connected
        await cluster._client.leave()


def cmd_up(args: argparse.Namespace) -> int:
    """``rlactors up cluster.toml``: start the head, then an agent per node, record the cluster in
    the state file, and wait until every node has registered; on failure stop what was started."""
    cfg: ClusterConfig = load_cluster_config(args.config, args.set)
    sf = state_file()
    if not _clear_stale_record(sf):
        return 1
    secret = _ensure_secret(Path(cfg.cluster.secret_file).expanduser())
    log_dir = Path(cfg.cluster.log_dir).expanduser()
    log_dir.mkdir(parents=True, exist_ok=True)
    retain = cfg.head.retain_finished if args.retain_finished is None else args.retain_finished
    head_log = log_dir / "head.log"
    head = _launch(head_command(cfg, str(secret), retain), head_log)
    state: dict[str, Any] = {
        "address": cfg.address,
        "secret_file": str(secret),
        "config": str(Path(args.config).resolve()),
        "head_pid": head.pid,
        "security": cfg.cluster.security,
        "agents": {},
        "log_dir": str(log_dir),
    }
    agents: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with console.status(f"starting head at {cfg.address}") as status:
            _wait_for_head(cfg, secret, head, head_log)
            for node in cfg.nodes:
                agents[node.node_id] = _start_agent(cfg, node, secret, log_dir)
                state["agents"][node.node_id] = {
                    "pid": agents[node.node_id].pid,
                    "host": node.host,
                    "launch": node.launch,
                }
            sf.parent.mkdir(parents=True, exist_ok=True)
            sf.write_text(json.dumps(state, indent=2))
            _wait_for_nodes(cfg, secret, agents, log_dir, status)
    except (ClusterError, ConfigError, OSError) as e:
        console.print(f"[red]rlactors up failed:[/] {e}")
        for p in [*agents.values(), head]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        sf.unlink(missing_ok=True)
        return 1
    console.print(f"[green]cluster up[/]: head {cfg.address}, {len(cfg.nodes)} node(s); logs in {log_dir}")
    out.print(
        f"connect with: rlactors.connect()  (or RLACTORS_ADDRESS={cfg.address} RLACTORS_SECRET_FILE={secret})"
    )
    return 0


def _clear_stale_record(sf: Path) -> bool:
    """False if the recorded cluster still runs; a record whose head is gone is removed."""
    if not sf.exists():
        return True
    state = _load_state()  # an unreadable record raises, naming the file and `rlactors down`
    if _running(state.get("head_pid")):
        console.print(f"[red]a cluster is already running (recorded in {sf})[/]: run `rlactors down` first")
        return False
    console.print(f"[yellow]removed a stale cluster record[/] {sf}: its head is not running")
    sf.unlink()
    return True


def _ensure_secret(secret: Path) -> Path:
    if not secret.exists():
        new_secret_file(secret)
        console.print(f"created cluster secret {secret} (mode 600); every host needs this file")
    return secret


def _wait_for_head(cfg: ClusterConfig, secret: Path, head: subprocess.Popen[bytes], head_log: Path) -> None:
    """Until the head answers (each try waits up to 5 s for it); ClusterError if it exits or stays
    silent for 30 s."""
    deadline = time.monotonic() + 30
    while True:
        if head.poll() is not None:
            raise ClusterError(
                f"the head exited with code {head.returncode}; its log ({head_log}):\n{_tail(head_log)}"
            )
        try:
            asyncio.run(_nodes(cfg.address, str(secret), cfg.cluster.security))
            return
        except ClusterError:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the head did not answer at {cfg.address} within 30s; log: {head_log}"
                ) from None


def _start_agent(
    cfg: ClusterConfig, node: NodeConfig, secret: Path, log_dir: Path
) -> subprocess.Popen[bytes]:
    cmd = agent_command(cfg, node, str(secret), str(log_dir))
    try:
        return _launch(cmd, log_dir / f"agent-{node.node_id}.log")
    except OSError as e:
        raise ClusterError(
            f"cannot start the agent for node {node.node_id} (host {node.host}, launch {node.launch}): {e}"
        ) from e


def _wait_for_nodes(
    cfg: ClusterConfig,
    secret: Path,
    agents: dict[str, subprocess.Popen[bytes]],
    log_dir: Path,
    status: Status,
) -> None:
    """Until every node has registered with the head; ClusterError naming the node if its agent
    exits, or the pending ones past ``cluster.start_timeout``."""
    deadline = time.monotonic() + cfg.cluster.start_timeout
    want = {n.node_id: n for n in cfg.nodes}
    while True:
        registered = {
            n["node_id"]
            for n in asyncio.run(_nodes(cfg.address, str(secret), cfg.cluster.security))
            if n["alive"]
        }
        pending = [nid for nid in want if nid not in registered]
        status.update(
            f"waiting for nodes: {len(registered)}/{len(want)} registered"
            + (f" (pending: {', '.join(pending)})" if pending else "")
        )
        if not pending:
            return
        for nid in pending:
            p = agents[nid]
            if p.poll() is not None:
                log = log_dir / f"agent-{nid}.log"
                raise ClusterError(
                    f"the agent for node {nid} (host {want[nid].host}, launch {want[nid].launch}) "
                    f"exited with code {p.returncode}; its log ({log}):\n{_tail(log)}"
                )
        if time.monotonic() > deadline:
            raise ClusterError(
                f"nodes {', '.join(pending)} (hosts {', '.join(want[n].host for n in pending)}) "
                f"did not register within {cfg.cluster.start_timeout:.0f}s; logs in {log_dir}"
            )
        time.sleep(0.3)  # between polls of the head's node list


def _seconds(text: str) -> float:
    """A number of seconds from the command line, >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


RUN_HELP = (
    "an embedded run's folder (its run.out_dir), which records how to reach it while it runs "
    "(default: the cluster `rlactors up` started, else the only live run)"
)


def _load_state() -> dict[str, Any]:
    sf = state_file()
    if not sf.exists():
        raise ClusterError(f"no running cluster recorded in {sf}; start one with `rlactors up cluster.toml`")
    return read_state(sf)


def _running(pid: object) -> bool:
    """Whether ``pid`` is a live process we started (pids of exited processes get reused)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    return any(k in _cmdline(pid) for k in ("rlactors.launch.daemons", "ssh", "srun"))


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"
    return f"{int(seconds) // 3600}h{int(seconds) % 3600 // 60:02d}m"


def _fmt_res(total: dict[str, float], used: dict[str, float]) -> str:
    return ", ".join(f"{k} {used.get(k, 0):g}/{v:g}" for k, v in sorted(total.items()) if v or used.get(k))


def _doing(a: dict[str, Any]) -> str:
    """What an actor is doing, in a few words."""
    reason = escape(a["reason"])  # a reason may hold brackets rich would read as markup
    if a["state"] in ("DEAD", "STOPPED"):
        return reason or a["state"].lower()
    if a["state"] != "ALIVE":
        return a["state"].lower() + (f": {reason}" if reason else "")
    act = a.get("activity")
    if act is None and a["heard_s"] is not None and a["heard_s"] < 2:
        return "[red]not answering[/] (its process does: a blocked event loop?)"
    if act is None:
        return "[red]not answering[/]"
    if not act["running"]:
        return "idle"
    calls = "1 call" if act["running"] == 1 else f"{act['running']} calls"
    return f"running {calls}; oldest {escape(act['oldest_method'])} for {_age(act['oldest_s'])}"


WIDE = 120  # columns from which `status` shows every column; narrower, the compact view


def _tables(status: dict[str, Any], width: int = 200) -> Group:
    """The status as two tables: nodes, then actors (live ones first). Under ``WIDE`` columns the
    actors' table keeps name, state, pid, last heard and what each is doing (the last folded), so
    that it still reads at 80; ``--json`` has every field."""
    compact = width < WIDE
    style: dict[str, Any] = {"box": box.SIMPLE_HEAD, "pad_edge": False} if compact else {}
    nodes = Table(title="nodes", title_justify="left", **style)
    for col in ("node", "host", "state", "last heard", "resources used/total"):
        nodes.add_column(col, no_wrap=col != "resources used/total")
    for n in status["nodes"]:
        nodes.add_row(
            n["node_id"],
            n["host"],
            "[green]alive[/]" if n["alive"] else "[red]dead[/]",
            _age(n["heard_s"]) + " ago",
            _fmt_res(n["total"], n["used"]),
        )
    actors = Table(title="actors", title_justify="left", **style)
    wide = ["name", "class", "id", "node", "run", "state", "in state", "restarts", "pid", "last heard"]
    columns = ["name", "state", "pid", "heard", "doing"] if compact else [*wide, "doing"]
    for col in columns:
        actors.add_column(col, no_wrap=col != "doing", overflow="fold" if col == "doing" else "ellipsis")
    states = {"ALIVE": "[green]ALIVE[/]", "DEAD": "[red]DEAD[/]", "STOPPED": "[dim]STOPPED[/]"}
    for a in status["actors"]:
        heard = a["heard_s"]
        cells = {
            "name": a["name"] or "-",
            "class": a["class_name"].rsplit(".", 1)[-1],
            "id": a["actor_id"],
            "node": a["node_id"],
            "run": a.get("run") or "-",
            "state": states.get(a["state"], f"[yellow]{a['state']}[/]"),
            "in state": _age(a["state_s"]),
            "restarts": str(a["restarts"]),
            "pid": str(a["pid"]),
            "last heard": "-" if heard is None else _age(heard) + " ago",
            "heard": "-" if heard is None else _age(heard),
            "doing": _doing(a),
        }
        actors.add_row(*(cells[c] for c in columns))
    if status.get("retain_finished_s"):
        actors.caption = (
            f"a finished run's stopped actors are dropped {_age(status['retain_finished_s'])} after they stop"
        )
        actors.caption_justify = "left"
    return Group(nodes, actors)


Where = tuple[str | None, str | None, str | None]  # address, secret file, security mechanism


def _where(args: argparse.Namespace) -> Where:
    """The cluster a command inspects: ``--run RUN_DIR`` (an embedded run's record), ``--address``,
    the cluster ``rlactors up`` started, else the only live embedded run."""
    run = getattr(args, "run", None)
    if run:
        if args.address:
            raise NoSuchRun("pass either --run or --address, not both")
        r = read_run(run)
        return r.address, r.secret_file, r.security
    if args.address or os.environ.get("RLACTORS_ADDRESS"):
        return args.address, args.secret_file, None
    sf = state_file()
    if sf.exists() and _running(_load_state().get("head_pid")):
        return None, args.secret_file, None
    runs = live_runs()
    if len(runs) == 1:
        return runs[0].address, runs[0].secret_file, runs[0].security
    if len(runs) > 1:
        lines = "; ".join(r.describe() for r in runs)
        raise NoSuchRun(f"{len(runs)} runs are live here: name one with --run RUN_DIR: {lines}")
    return None, args.secret_file, None  # connect() says there is no cluster


async def _statuses(where: Where, every: float | None) -> AsyncIterator[dict[str, Any]]:
    """The head's status, once or (``every`` seconds) until interrupted, over one connection."""
    from rlactors.api.cluster import connect

    address, secret, security = where
    cluster = await connect(address, secret_file=secret, timeout=5, security=security)
    try:
        while True:
            yield await cluster._client.head_call("status")
            if every is None:
                return
            await asyncio.sleep(every)
    finally:
        await cluster._client.leave()


def cmd_status(args: argparse.Namespace) -> int:
    every = args.watch
    where = _where(args)

    async def show() -> None:
        live: Live | None = None
        try:
            async for status in _statuses(where, every):
                if args.json:  # one document, or one line per refresh
                    sys.stdout.write(json.dumps(status, indent=None if every else 2) + "\n")
                    sys.stdout.flush()
                elif every is None:
                    out.print(_tables(status, out.width))
                elif live is None:
                    live = Live(_tables(status, out.width), console=out, auto_refresh=False)
                    live.start()
                else:
                    live.update(_tables(status, out.width), refresh=True)
        finally:
            if live is not None:
                live.stop()

    try:
        asyncio.run(show())
    except KeyboardInterrupt:
        return 0
    except ClusterError as e:
        if (gone := _head_gone(args.address)) is not None:
            raise gone from e
        raise
    return 0


def _head_gone(address: str | None) -> ClusterError | None:
    """The clearer error when the cluster this shell started has a head that exited."""
    sf = state_file()
    if address is None and sf.exists() and not _running(_load_state().get("head_pid")):
        return ClusterError(
            f"the cluster recorded in {sf} is not running (its head has exited); `rlactors down` clears the record"
        )
    return None


async def _stacks(where: Where, names: list[str], timeout_s: float) -> str:
    from rlactors.api.cluster import connect

    address, secret, security = where
    cluster = await connect(address, secret_file=secret, timeout=5, security=security)
    try:
        return str(await cluster.stacks(names or None, timeout_s=timeout_s))
    finally:
        await cluster._client.leave()


def cmd_stack(args: argparse.Namespace) -> int:
    try:
        text = asyncio.run(_stacks(_where(args), args.actors, args.timeout))
    except ClusterError as e:
        if (gone := _head_gone(args.address)) is not None:
            raise gone from e
        raise
    sys.stdout.write(text + "\n")  # plain text: stacks hold brackets rich would read as markup
    return 0


POOL_ACTOR = "inference-pool"  # nodes/inference/pool.py's POOL_NAME (the CLI does not import nodes)


async def _pool_call(where: Where, method: str, *args: Any, model: str = "") -> Any:
    """Call ``method`` of the cluster's ``inference-pool`` actor (the one a run creates), or of
    ``inference-pool-<model>``: the pool of another model of the run (``[models.<model>]``)."""
    from rlactors.api.cluster import connect

    address, secret, security = where
    cluster = await connect(address, secret_file=secret, timeout=5, security=security)
    try:
        try:
            pool = await cluster.get_actor(f"{POOL_ACTOR}-{model}" if model else POOL_ACTOR)
        except ActorNotFoundError:
            if model:
                raise ClusterError(
                    f"no {POOL_ACTOR}-{model} actor in this cluster: the run has no model {model!r} "
                    "([models.<name>] in its config); `rlactors pool ls` lists its models"
                ) from None
            raise ClusterError(
                f"no {POOL_ACTOR} actor in this cluster: start a run on it first "
                "(python recipes/gsm8k_grpo.py --cluster cluster.toml)"
            ) from None
        return await getattr(pool, method)(*args)
    finally:
        await cluster._client.leave()


def _pool_table(status: dict[str, Any]) -> Table:
    model = f"model {status['model']!r}" if status.get("model") else "policy"
    t = Table(
        title=f"inference pool ({model}): {status['replacements']}/{status['max_replacements']} replacements used"
    )
    for col in ("server", "state", "version", "name", "node", "since"):
        t.add_column(col)
    for s in status["servers"]:
        since = _age(time.time() - s["since"]) if s.get("since") else ""
        version = str(s["version"]) if s["version"] >= 0 else ""
        t.add_row(escape(s["url"]), s["state"], version, s["name"] or "(added)", s["node"], since)
    return t


def cmd_pool(args: argparse.Namespace) -> int:
    where = _where(args)
    model = args.model or ""
    if args.action == "ls":
        status = asyncio.run(_pool_call(where, "status", model=model))
        if args.json:
            sys.stdout.write(json.dumps(status, indent=2) + "\n")
            return 0
        out.print(_pool_table(status))
        for name, other in (status.get("models") or {}).items():  # teachers, judges: never pushed to
            out.print(_pool_table(other) if "servers" in other else f"model {name!r}: {other.get('error')}")
        return 0
    when = "serves from the next weight publish" if not model else "serving"
    if args.action == "add":
        row = asyncio.run(_pool_call(where, "add", args.url, model=model))
        out.print(f"{escape(row['url'])}: {row['state']} ({when})")
    elif args.action == "launch":
        urls = asyncio.run(_pool_call(where, "launch", args.n, args.node, model=model))
        out.print(
            f"launched {', '.join(urls)}: {'joining (serve from the next weight publish)' if not model else 'live'}"
        )
    else:
        row = asyncio.run(_pool_call(where, "remove", args.url, not args.no_drain, model=model))
        gone = "it leaves at the next publish" if not model else "stopped once drained"
        out.print(f"{escape(row['url'])}: {row['state']} (no new requests; {gone})")
    return 0


async def _down(address: str, secret: str, security: str) -> int:
    from rlactors.api.cluster import connect

    cluster = await connect(address, secret_file=secret, timeout=5, security=security)
    try:
        return await cluster._client.head_call("shutdown_cluster")
    finally:
        await cluster._client.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    """The process has exited (a zombie whose parent has not reaped it counts as exited)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def cmd_down(args: argparse.Namespace) -> int:
    sf = state_file()
    try:
        state = _load_state()
    except ClusterError as e:
        if not sf.exists():
            raise
        console.print(
            f"[yellow]{e}[/]\nremoving it; look for leftover `rlactors.launch.daemons` processes with ps"
        )
        sf.unlink()
        return 1
    head_answered = False
    try:
        n = asyncio.run(
            _down(state.get("address", ""), state.get("secret_file", ""), state.get("security", "curve"))
        )
        console.print(f"stopped {n} node agent(s) and the head")
        head_answered = True
    except (ClusterError, OSError, ValueError) as e:
        console.print(f"[yellow]head not reachable ({e}); killing recorded processes[/]")
    agents = state.get("agents")
    pids = [
        state.get("head_pid"),
        *(a.get("pid") for a in (agents.values() if isinstance(agents, dict) else [])),
    ]
    # Only processes we started (a stale state file may name pids since reused by others).
    for pid in [p for p in pids if _running(p)]:
        # Told to stop by the head, a process gets a while to exit on its own; else at once.
        if not _wait_gone(pid, 10 if head_answered else 0):
            # SIGTERM first: srun ends its step and ssh's remote side gets a hang-up; then SIGKILL.
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, sig)
                if _wait_gone(pid, 5):
                    break
    sf.unlink(missing_ok=True)
    console.print("[green]cluster down[/]")
    return 0


def cmd_secret(args: argparse.Namespace) -> int:
    p = new_secret_file(args.path)
    console.print(f"created {p} (mode 600)")
    return 0


COMMANDS_GROUP = "rlactors.commands"


def _contributed_commands(sub: Any) -> None:
    """Add the subcommands installed packages contribute: each entry point of the ``rlactors.commands``
    group names a function that takes the subparsers, adds its parser and sets ``handler`` (parsed
    arguments -> exit code) as its default. One that fails to load is reported and left out."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=COMMANDS_GROUP):
        try:
            ep.load()(sub)
        except Exception as e:  # a broken plugin must not take the built-in commands down with it
            console.print(
                f"[yellow]warning:[/] command {ep.name!r} ({ep.value}) unavailable: {escape(str(e))}"
            )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="rlactors", description="Run and inspect rlactors clusters.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster from a cluster.toml")
    up.add_argument("config", help="the cluster.toml: head, nodes and how to launch their agents")
    up.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    up.add_argument(
        "--retain-finished",
        type=_seconds,
        metavar="SECONDS",
        help="how long `rlactors status` lists a finished run's stopped actors after they stopped "
        "(default: [head] retain_finished; 0: no time bound, the head keeps the last 100 ended actors)",
    )
    st = sub.add_parser(
        "status", help="nodes and actors: state, when last heard from, what each actor is doing"
    )
    st.add_argument("--address", help="the head's address (default: the cluster `rlactors up` started)")
    st.add_argument("--secret-file", help="the cluster secret (default: the one `rlactors up` recorded)")
    st.add_argument("--run", metavar="RUN_DIR", help=RUN_HELP)
    st.add_argument(
        "--json", action="store_true", help="print JSON for scripts (one line per refresh with --watch)"
    )
    st.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    sk = sub.add_parser(
        "stack",
        help="what every actor is doing and who waits on whom: wait cycles, the ends of wait chains, stacks",
    )
    sk.add_argument("actors", nargs="*", metavar="ACTOR", help="actor names or ids (default: all)")
    sk.add_argument("--address", help="the head's address (default: the cluster `rlactors up` started)")
    sk.add_argument("--secret-file", help="the cluster secret (default: the one `rlactors up` recorded)")
    sk.add_argument("--run", metavar="RUN_DIR", help=RUN_HELP)
    sk.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the workers' answers (default 5)"
    )
    po = sub.add_parser("pool", help="a run's inference servers: list, add, launch, remove")
    po_sub = po.add_subparsers(dest="action", required=True)
    ls = po_sub.add_parser("ls", help="the servers, their state and the version they serve")
    ls.add_argument("--json", action="store_true", help="print JSON for scripts")
    add = po_sub.add_parser("add", help="take a server already running at URL (joins at the next publish)")
    add.add_argument("url")
    la = po_sub.add_parser("launch", help="start N servers with the run's launcher config")
    la.add_argument("n", nargs="?", type=int, default=1)
    la.add_argument("--node", help="the node to start them on (default: where resources are free)")
    rm = po_sub.add_parser("rm", help="stop routing to URL, let its requests finish, then let it go")
    rm.add_argument("url")
    rm.add_argument("--no-drain", action="store_true", help="return at once; running requests fail over")
    for p in (ls, add, la, rm):
        p.add_argument(
            "--model",
            help="another model of the run ([models.<name>]: a teacher, a judge) instead of the policy",
        )
        p.add_argument("--address", help="the head's address (default: the cluster `rlactors up` started)")
        p.add_argument("--secret-file", help="the cluster secret (default: the one `rlactors up` recorded)")
        p.add_argument("--run", metavar="RUN_DIR", help=RUN_HELP)
    sub.add_parser("down", help="stop the cluster started by `rlactors up`")
    se = sub.add_parser("secret", help="create a new cluster secret file")
    se.add_argument("path", help="where to write it (mode 600; an existing file is not overwritten)")
    _contributed_commands(sub)
    args = ap.parse_args(argv)
    builtin = {
        "up": cmd_up,
        "status": cmd_status,
        "stack": cmd_stack,
        "pool": cmd_pool,
        "down": cmd_down,
        "secret": cmd_secret,
    }
    handler = builtin[args.cmd] if args.cmd in builtin else args.handler
    try:
        sys.exit(handler(args))
    except NoSuchRun as e:  # bad input: the run named is not there
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)  # one line, however narrow
        sys.exit(2)
    except (ClusterError, ConfigError, FileExistsError, FileNotFoundError, PermissionError) as e:
        console.print(f"[red]error:[/] {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()

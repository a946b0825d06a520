"""The cluster's stacks report: who waits on whom, wait-for cycles, and what the waited-on are doing.

``await cluster.stacks()`` gathers, from every worker's event loop (see
:mod:`rlactors.base.forensics`), its incoming calls with their await chains, its outgoing calls and its
threads; a worker whose loop is stuck is reported unresponsive with the stacks it dumped on a
signal; a dead actor is reported dead. This module turns those answers into a
:class:`StacksReport`: an edge A → B of the wait-for graph is a call A made to B still waiting for
its reply (queued behind B's ``max_concurrency`` or running there); :attr:`StacksReport.cycles`
are the graph's cycles, :attr:`StacksReport.waited_on` the actors at the ends of its longest
chains. ``str(report)`` is the text ``rlactors stack`` prints.

The graph holds every call a driver has pending, from the caller's side: an ``ActorGroup`` call is
an edge to each rank, and a rank whose call failed stays one while the group call still waits. A
rank blocked in a ``torch.distributed`` collective waits on each member of its group that is not
in one (unresponsive, dead, or elsewhere). The ends are ranked, the culprit first: dead, then
unresponsive, then a member whose call failed, then a wait cycle, then an actor busy in a call;
an actor waited on only through methods marked :func:`rlactors.backpressure` (a staleness bound,
a buffer waiting for data) comes last, labelled as back-pressure by design.

A wait that is no actor call, noted by the code that waits (:func:`rlactors.base.forensics.waiting`: a
rollout client's dispatch paused while the trainer pushes weights), is an edge to what it names
(``the weight push``, no actor); an end reached only by such waits is back-pressure when they are
(never the culprit), else busy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ActorStacks",
    "IncomingCall",
    "NotedWait",
    "OutgoingCall",
    "StacksReport",
    "WaitCycle",
    "WaitEdge",
    "WaitEnd",
    "collective_frame",
]

MAX_PATHS = 20_000  # path expansions when looking for cycles and longest chains (graphs are small)
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')


def _age(s: float | None) -> str:
    return "?" if s is None else f"{s:.1f} s"


def innermost(stack: list[str]) -> str:
    """The innermost frame of a stack (outermost first) or a faulthandler dump, as
    ``func (file:line)``; '' when there is none."""
    frames = [m for line in stack for m in [_FRAME.search(line)] if m]
    if not frames:
        return ""
    # the innermost frame outside the runtime's own code says what the actor's code waits in
    ours = [f for f in frames if "/rlactors/" not in f.group(1)]
    f = (ours or frames)[-1]
    return f"{f.group(3)} ({f.group(1).rsplit('/', 1)[-1]}:{f.group(2)})"


# a thread's block in a dump; "Stack": faulthandler's dump of the one thread the signal landed on
_THREAD = re.compile(r"^(?:(?:Current thread|Thread) (0x[0-9a-fA-F]+)|Stack) ")


def dump_loop_thread(dump: str, loop_thread: int | None) -> list[str]:
    """The loop thread's frames from a stacks dump (faulthandler's format), outermost first. The
    dump lists every thread, most recent call first; the loop's is found by its ident (the signal
    may have landed on any thread, so "Current thread" need not be the loop's). Without the ident,
    or in a dump of one thread (see ``rlactors.base.forensics.register_dump``): the thread the
    signal landed on."""
    blocks = [(m.group(1), b) for b in dump.strip().split("\n\n") for m in [_THREAD.match(b)] if m]
    block = ""
    if loop_thread is not None:
        block = next((b for ident, b in blocks if ident and int(ident, 16) == loop_thread), "")
    if not block:
        block = next((b for _, b in blocks if not b.startswith("Thread")), blocks[0][1] if blocks else "")
    return list(reversed([line for line in block.splitlines()[1:] if line.strip()]))


def collective_frame(stack: list[str]) -> str:
    """The ``torch.distributed`` function a stack (outermost first) waits in, as ``func
    (file:line)``; '' when it is not in one."""
    frames = [m for line in stack for m in [_FRAME.search(line)] if m]
    for f in reversed(frames):
        if "/torch/distributed/" in f.group(1) and f.group(3) not in ("wrapper", "_wrapper", "inner"):
            return f"{f.group(3)} ({f.group(1).rsplit('/', 1)[-1]}:{f.group(2)})"
    return ""


@dataclass
class IncomingCall:
    """A call an actor received and has not answered: running, or queued (behind its
    ``max_concurrency``, or behind the sync thread's current call)."""

    method: str
    age_s: float
    state: str  # "running" | "queued"
    stack: list[str]  # its await chain (async) or its thread's stack (sync), outermost first
    call_id: int = 0
    caller: str | None = None  # matched from the callers' outgoing calls in this report
    thread: bool = False  # a sync method (runs on the worker thread)
    backpressure: str = ""  # why a wait in it is by design (rlactors.backpressure), if it is


@dataclass
class OutgoingCall:
    """A call an actor (or driver) made that is still waiting for its reply."""

    target: str  # the target actor's name (its id when unnamed)
    actor_id: str
    method: str
    age_s: float
    origin: str | None = None  # the incoming method it was made from
    call_id: int = 0
    failed: str = ""  # a group call's member that failed (the error) while the call still waits


@dataclass
class NotedWait:
    """Waits that are no actor call, noted by the code that waits (:func:`rlactors.base.forensics.waiting`),
    alike ones together: ``count`` of them wait (``what``) on ``on``, the oldest for ``age_s``."""

    what: str  # "dispatch paused"
    on: str  # what they wait on: "the weight push", a server's URL
    age_s: float
    count: int = 1
    origin: str | None = None  # the incoming method they wait in
    backpressure: str = ""  # why the wait is by design, if it is

    def __str__(self) -> str:
        n = f" ({self.count} waits)" if self.count > 1 else ""
        src = f" (from {self.origin})" if self.origin else ""
        bp = f", back-pressure by design: {self.backpressure}" if self.backpressure else ""
        return f"{self.what}{n} on {self.on}{src} for {_age(self.age_s)}{bp}"


@dataclass
class ActorStacks:
    """One actor's (or the driver's) part of the report."""

    name: str  # the actor's name, its id when unnamed; "driver …" for a driver
    actor_id: str
    state: str  # ALIVE, DEAD, RESTARTING, PENDING, UNKNOWN (no such actor), DRIVER, NOT_AN_ACTOR
    class_name: str = ""
    node_id: str = ""
    pid: int | None = None
    reason: str = ""  # why it is dead
    responsive: bool = True  # its loop answered in time
    unresponsive_s: float | None = None  # for how long its loop has not ticked (when not responsive)
    max_concurrency: int | None = None
    incoming: list[IncomingCall] = field(default_factory=list)
    outgoing: list[OutgoingCall] = field(default_factory=list)
    waits: list[NotedWait] = field(default_factory=list)  # waits that are no actor call
    threads: dict[str, list[str]] = field(default_factory=dict)  # name -> stack, outermost first
    loop_lag_s: float | None = None
    max_loop_lag_s: float | None = None  # since the last report
    dump: str | None = None  # the faulthandler dump of an unresponsive worker
    loop_thread: int | None = None  # its loop's thread ident (to find the loop's stack in a dump)
    collective: dict[str, Any] | None = (
        None  # the torch.distributed group it joined (rlactors.api.collective)
    )
    collective_wait: str = ""  # set by build_report: blocked in a collective, and who is missing
    # Another process's driver: its calls are as its loop noted them this long ago (it notes them
    # every ``note_interval_s`` while the loop runs). None: noted now (this process's own).
    noted_s: float | None = None
    note_interval_s: float | None = None

    @property
    def loop_blocked_s(self) -> float | None:
        """For a driver whose loop has stopped noting its calls (synchronous code, a stopped
        process): about how long it has not run; None otherwise."""
        if self.noted_s is None or self.note_interval_s is None:
            return None
        # up to one interval between notes, and one more between beats, is a loop that runs
        blocked = self.noted_s - self.note_interval_s
        return blocked if blocked > self.note_interval_s else None

    def in_collective(self) -> tuple[str, IncomingCall | None]:
        """The ``torch.distributed`` function one of its threads waits in, and the running call
        it serves (None: another thread); ('', None) when none does."""
        for c in self.running:
            op = collective_frame(c.stack)
            if op:
                return op, c
        for stack in self.threads.values():
            op = collective_frame(stack)
            if op:
                return op, None
        return "", None

    @property
    def queued(self) -> list[IncomingCall]:
        return [c for c in self.incoming if c.state == "queued"]

    @property
    def running(self) -> list[IncomingCall]:
        return [c for c in self.incoming if c.state == "running"]

    def summary(self) -> str:
        """What it is doing, in one line."""
        if self.state == "DEAD":
            return f"dead: {self.reason or 'process exited'}"
        if self.state in ("UNKNOWN", "NOT_AN_ACTOR"):
            return self.reason or "no such actor"
        if self.state in ("PENDING", "RESTARTING"):
            return self.state.lower() + (f": {self.reason}" if self.reason else "")
        blocked = self.loop_blocked_s
        if blocked is not None:  # what it waits on is as of then: its replies may have come since
            o = max(self.outgoing, key=lambda o: o.age_s, default=None)
            was = f"; as of then, waiting on {o.target}.{o.method}" if o is not None else ""
            return (
                f"its event loop has not run for about {_age(blocked)} (synchronous code in the driver, "
                f"or the process stopped){was}"
            )
        if not self.responsive:
            where = innermost(dump_loop_thread(self.dump, self.loop_thread)) if self.dump else ""
            how = f"unresponsive for {_age(self.unresponsive_s)}" if self.unresponsive_s else "unresponsive"
            return how + (
                f": its loop is stuck in {where}" if where else " (no stacks came: a stopped process?)"
            )
        parts = [self.collective_wait] if self.collective_wait else []
        for c in sorted(self.running, key=lambda c: -c.age_s)[:1]:
            at = innermost(c.stack)
            parts.append(f"running {c.method} for {_age(c.age_s)}" + (f", in {at}" if at else ""))
        if len(self.running) > 1:
            parts.append(f"{len(self.running)} calls running")
        if self.queued:
            parts.append(f"{len(self.queued)} queued")
        if self.outgoing:
            o = max(self.outgoing, key=lambda o: o.age_s)
            parts.append(f"waiting on {o.target}.{o.method} for {_age(o.age_s)}")
        parts.extend(str(w) for w in self.waits[:1])
        return "; ".join(parts) or "idle"

    def text(self, *, threads: bool = False) -> str:
        """Its section of the report; ``threads``: every thread's stack too."""
        what = ", ".join(
            x
            for x in (
                self.class_name.rsplit(".", 1)[-1],
                self.actor_id if self.actor_id != self.name else "",
                f"node {self.node_id}" if self.node_id else "",
                f"pid {self.pid}" if self.pid else "",
                f"max_concurrency={self.max_concurrency}" if self.max_concurrency else "",
                f"loop lag {self.loop_lag_s * 1000:.0f} ms" if self.loop_lag_s is not None else "",
                f"calls as of {_age(self.noted_s)} ago" if self.noted_s is not None else "",
            )
            if x
        )
        lines = [f"{self.name} ({what}): {self.summary()}" if what else f"{self.name}: {self.summary()}"]
        for c in self.incoming:
            why = ""
            if c.state == "queued":
                why = (
                    " behind the sync thread"
                    if c.thread
                    else f" behind max_concurrency={self.max_concurrency}"
                )
            src = f" from {c.caller}" if c.caller else ""
            bp = f" (back-pressure by design: {c.backpressure})" if c.backpressure else ""
            lines.append(f"  call {c.method}{src}: {c.state}{why} for {_age(c.age_s)}{bp}")
            lines.extend("    " + s for s in c.stack)
        for o in self.outgoing:
            src = f" (from {o.origin})" if o.origin else ""
            failed = f"; its call failed ({o.failed}) and the group call still waits" if o.failed else ""
            lines.append(f"  waits on {o.target}.{o.method}{src} for {_age(o.age_s)}{failed}")
        lines.extend(f"  {w}" for w in self.waits)
        if self.dump:
            lines.append("  stacks dumped by signal (most recent call first):")
            lines.extend("    " + s for s in self.dump.rstrip().splitlines())
        if threads:
            for tname, stack in self.threads.items():
                lines.append(f"  thread {tname}:")
                lines.extend("    " + s for s in stack)
        return "\n".join(lines)

    @classmethod
    def from_answer(cls, a: dict[str, Any]) -> ActorStacks:
        """From the head's entry for one actor (``Head.stacks``)."""
        loop = a.get("loop") or {}
        return cls(
            name=a.get("name") or a.get("actor_id", "?"),
            actor_id=a.get("actor_id", ""),
            state=a.get("state", "UNKNOWN"),
            class_name=a.get("class_name", ""),
            node_id=a.get("node_id", ""),
            pid=a.get("pid"),
            reason=a.get("reason", ""),
            responsive=bool(a.get("responsive", a.get("state") != "ALIVE")),
            unresponsive_s=a.get("unresponsive_s"),
            max_concurrency=a.get("max_concurrency"),
            incoming=[
                IncomingCall(
                    c["method"],
                    c["age_s"],
                    c["state"],
                    c["stack"],
                    c["call_id"],
                    thread=c.get("thread", False),
                    backpressure=c.get("backpressure", ""),
                )
                for c in a.get("incoming", [])
            ],
            outgoing=[_outgoing(o) for o in a.get("outgoing", [])],
            waits=[
                NotedWait(
                    w["what"],
                    w["on"],
                    w["age_s"],
                    w.get("count", 1),
                    w.get("from"),
                    w.get("backpressure", ""),
                )
                for w in a.get("waits", [])
            ],
            threads={t["name"]: t["stack"] for t in a.get("threads", [])},
            loop_lag_s=loop.get("lag_s"),
            max_loop_lag_s=loop.get("max_lag_s"),
            dump=a.get("dump"),
            loop_thread=a.get("loop_thread"),
            collective=a.get("collective"),
            noted_s=a.get("noted_s"),
            note_interval_s=a.get("note_interval_s"),
        )

    @classmethod
    def driver(cls, client_id: str, outgoing: list[dict[str, Any]]) -> ActorStacks:
        """A driver process: only its outgoing calls."""
        return cls(
            name=client_id,
            actor_id=client_id,
            state="DRIVER",
            outgoing=[_outgoing(o) for o in outgoing],
        )


def _outgoing(o: dict[str, Any]) -> OutgoingCall:
    return OutgoingCall(
        o.get("name") or o["actor_id"],
        o["actor_id"],
        o["method"],
        o["age_s"],
        o.get("from"),
        o["call_id"],
        o.get("failed", ""),
    )


@dataclass
class WaitEdge:
    """``waiter`` waits on ``target``: its call of ``method`` there has no reply yet, or (``state``
    "collective") it is blocked in the collective ``method`` that ``target`` has not joined."""

    waiter: str
    target: str
    method: str
    age_s: float
    origin: str | None  # the waiter's incoming method that made the call
    # "running" or "queued" there; "unseen" when the target did not report it; "answered?" when
    # it did not and the waiter is a driver whose view is older than that (the reply may have come
    # since: no wait the culprit is looked for on); "failed" for a group member whose call failed
    # while the group call waits; "collective"; "noted": a wait that is no actor call
    # (rlactors.base.forensics.waiting), ``method`` saying what waits
    state: str
    behind: str = ""  # what a queued call waits behind ("max_concurrency=1", "the sync thread")
    backpressure: str = ""  # why this wait is by design (the target's method is marked so)
    note: str = ""  # the failure ("failed"), or where the missing member is ("collective")

    def __str__(self) -> str:
        waiter = f"{self.waiter}.{self.origin}" if self.origin else self.waiter
        if self.state == "collective":
            return f"{waiter} waits on {self.target} in {self.method} ({self.note}, {_age(self.age_s)})"
        if self.state == "noted":
            bp = f", back-pressure by design: {self.backpressure}" if self.backpressure else ""
            n = f"{self.note}, " if self.note else ""
            return (
                f"{waiter} waits on {self.target}: {self.method} ({n}no actor call{bp}, {_age(self.age_s)})"
            )
        there = {
            "running": "running there",
            "queued": "queued there",
            "failed": f"failed there: {self.note}; the group call still waits",
            "answered?": f"not seen there; {self.note}",
        }.get(self.state, "not seen there")
        there += f" behind {self.behind}" if self.behind else ""
        there += f", back-pressure by design: {self.backpressure}" if self.backpressure else ""
        return f"{waiter} waits on {self.target}.{self.method} ({there}, {_age(self.age_s)})"


@dataclass
class WaitCycle:
    """Actors that wait on each other in a ring: none can go on until another does."""

    actors: list[str]  # a → b → … (→ back to the first)
    edges: list[WaitEdge]

    def __str__(self) -> str:
        ring = " → ".join([*self.actors, self.actors[0]])
        return "\n".join([f"wait cycle: {ring}", *(f"  {e}" for e in self.edges)])


# How bad an end of a wait chain is, the culprit first: an actor that somebody waits on and that
# is dead, unresponsive, failed a call it still owes, in a wait cycle, or busy; an actor waited on
# only through back-pressure by design comes last and is never the culprit.
KINDS = ("dead", "unresponsive", "failed", "cycle", "busy", "backpressure")


@dataclass
class WaitEnd:
    """An actor at the end of a wait chain: others wait on it, it waits on no one (or it is in a
    wait cycle)."""

    name: str
    chain: list[str]  # the longest chain of waiters ending here, first waiter first
    stacks: ActorStacks
    kind: str = "busy"  # one of KINDS
    why: str = ""  # what the waiters' edges add (a failed call, a collective it is missing from)

    @property
    def summary(self) -> str:
        """One line: who, at the end of which chain, doing what."""
        what = self.stacks.summary() + (f"; {self.why}" if self.why else "")
        if self.kind == "backpressure":
            what += " (back-pressure by design)"
        return f"{self.name} at the end of {' → '.join(self.chain)}: {what}"


@dataclass
class StacksReport:
    """What every actor is doing, who waits on whom, and the cycles and chain ends of that graph."""

    actors: list[ActorStacks]
    cycles: list[WaitCycle]
    waited_on: list[WaitEnd]  # the culprit first (see KINDS), then by chain length
    edges: list[WaitEdge]
    taken_s: float = 0.0

    def __getitem__(self, name: str) -> ActorStacks:
        for a in self.actors:
            if name in (a.name, a.actor_id):
                return a
        raise KeyError(name)

    @property
    def culprit(self) -> WaitEnd | None:
        """The end of a wait chain to look at first: dead, unresponsive, failed, in a cycle or
        busy, and waited on; None when only back-pressure waits (or nothing) remain."""
        return next((w for w in self.waited_on if w.kind != "backpressure"), None)

    @property
    def unresponsive(self) -> list[ActorStacks]:
        return [a for a in self.actors if not a.responsive]

    @property
    def dead(self) -> list[ActorStacks]:
        return [a for a in self.actors if a.state == "DEAD"]

    def __str__(self) -> str:
        n = len([a for a in self.actors if a.state != "DRIVER"])
        head = f"stacks of {n} actor{'s' * (n != 1)}, taken in {self.taken_s:.2f} s"
        head += f"; {len(self.cycles)} wait cycle{'s' * (len(self.cycles) != 1)}" if self.cycles else ""
        out = [head]
        culprit = self.culprit
        if culprit is not None:
            out += ["", f"CULPRIT ({culprit.kind}): {culprit.summary}"]
            out += [f"  {e}" for e in self.edges if e.target == culprit.name]
        if self.cycles:
            out += ["", "WAIT CYCLES", *(str(c) for c in self.cycles)]
        if self.waited_on:
            out += ["", "WAITED ON (the ends of the wait chains, the culprit first)"]
            out += [w.summary for w in self.waited_on]
        if self.edges:
            out += ["", "WHO WAITS ON WHOM", *(str(e) for e in self.edges)]
        out += ["", "ACTORS"]
        ends = {w.name for w in self.waited_on if w.kind != "backpressure"}
        order = sorted(self.actors, key=lambda a: (a.state == "DRIVER", a.state == "DEAD", a.name))
        busy = [a for a in order if a.incoming or a.outgoing or not a.responsive or a.state != "ALIVE"]
        for a in busy:
            out.append(a.text(threads=a.name in ends and a.responsive))
        idle = [a.name for a in order if a not in busy]
        if idle:
            out.append(f"idle: {', '.join(idle)}")
        return "\n".join(out)


def _where(m: ActorStacks | None, name: str) -> str:
    """Where a group member that is not in the collective is, in a few words."""
    if m is None:
        return f"{name} is not in this report"
    if m.state in ("DEAD", "UNKNOWN", "PENDING", "RESTARTING"):
        return f"{name} is {m.summary()}"
    if not m.responsive:
        return f"{name} is unresponsive" + (f" for {_age(m.unresponsive_s)}" if m.unresponsive_s else "")
    return f"{name} is elsewhere: {m.summary()}"


def _collective_edges(actors: list[ActorStacks], by_id: dict[str, ActorStacks]) -> list[WaitEdge]:
    """A rank blocked in a collective waits on each member of its group that is not in one."""
    edges = []
    for a in actors:
        if not a.responsive or not a.collective:
            continue
        op, call = a.in_collective()
        if not op:
            continue
        g = a.collective
        missing = []
        for actor_id, name in g.get("members", []):
            if actor_id == a.actor_id:
                continue
            m = by_id.get(actor_id)
            if m is not None and m.responsive and m.state == "ALIVE" and m.in_collective()[0]:
                continue  # in it too
            missing.append((m.name if m is not None else name or actor_id, _where(m, name or actor_id)))
        where = (
            f"group {g.get('group')!r} ({g.get('backend')}, rank {g.get('rank')} of {g.get('world_size')})"
        )
        a.collective_wait = f"blocked in {op}, a collective of {where}" + (
            "; not in it: " + "; ".join(w for _, w in missing) if missing else ""
        )
        for name, w in missing:
            edges.append(
                WaitEdge(
                    a.name,
                    name,
                    op,
                    call.age_s if call else 0.0,
                    call.method if call else None,
                    "collective",
                    note=w,
                )
            )
    return edges


def _kind(end: str, a: ActorStacks | None, into: list[WaitEdge], in_cycle: bool) -> tuple[str, str]:
    """How bad an end is (see KINDS), and what its waiters' edges add."""
    failed = [e for e in into if e.state == "failed"]
    missed = [e for e in into if e.state == "collective"]
    noted = [e for e in into if e.state == "noted"]
    why = [f"{e.waiter}: {e.method}" + (f" ({e.note})" if e.note else "") for e in noted]
    if failed:
        why.append(f"its {failed[0].method} failed ({failed[0].note}) and {failed[0].waiter} still waits")
    if missed:
        peers = sorted({e.waiter for e in missed})
        verb = "waits" if len(peers) == 1 else "wait"
        why.append(f"{', '.join(peers)} {verb} for it in {missed[0].method.split(' ')[0]}")
    if a is not None and a.state == "NOT_AN_ACTOR":  # reached only by noted waits
        kind = "backpressure" if all(e.backpressure for e in into) else "busy"
    elif a is None or a.state in ("DEAD", "UNKNOWN"):
        kind = "dead"
    elif not a.responsive:
        kind = "unresponsive"
    elif failed or missed:
        kind = "failed"
    elif in_cycle:
        kind = "cycle"
    elif into and all(e.backpressure for e in into):
        kind = "backpressure"
    else:
        kind = "busy"
    return kind, "; ".join(why)


def _answering(a: ActorStacks | None) -> bool:
    """An actor that is alive and reported the calls it has (so one it did not report, it has not)."""
    return a is not None and a.state == "ALIVE" and a.responsive


def build_report(actors: list[ActorStacks], taken_s: float = 0.0) -> StacksReport:
    """The wait-for graph of these actors' outgoing calls and collectives, its cycles and chain ends
    (the culprit first)."""
    by_id = {a.actor_id: a for a in actors if a.actor_id}
    incoming = {(a.actor_id, c.call_id, c.method): c for a in actors for c in a.incoming}
    edges: list[WaitEdge] = []
    for a in actors:
        for o in a.outgoing:
            c = None if o.failed else incoming.get((o.actor_id, o.call_id, o.method))
            if c is not None:
                c.caller = f"{a.name}.{o.origin}" if o.origin else a.name
            callee = by_id.get(o.actor_id)
            target = callee.name if callee is not None else o.target
            behind = ""
            if c is not None and c.state == "queued" and callee is not None:
                behind = "the sync thread" if c.thread else f"max_concurrency={callee.max_concurrency}"
            state = "failed" if o.failed else (c.state if c else "unseen")
            note = o.failed
            # a driver's view, and a live target that told us all it runs: the reply may have come
            if state == "unseen" and a.noted_s is not None and _answering(callee):
                state, note = (
                    "answered?",
                    f"as the driver saw it {_age(a.noted_s)} ago: its reply may have come since",
                )
            bp = c.backpressure if c is not None else ""
            edges.append(WaitEdge(a.name, target, o.method, o.age_s, o.origin, state, behind, bp, note))
        for w in a.waits:
            n = f"{w.count} waits" if w.count > 1 else ""
            edges.append(WaitEdge(a.name, w.on, w.what, w.age_s, w.origin, "noted", "", w.backpressure, n))
    edges += _collective_edges(actors, by_id)
    live = [e for e in edges if e.state != "answered?"]  # no chain runs through a wait that may be over
    graph: dict[str, list[str]] = {}
    for e in live:
        if e.target not in graph.setdefault(e.waiter, []):
            graph[e.waiter].append(e.target)
    cycles = _cycles(graph)
    in_cycle = {m for c in cycles for m in c}
    waiters = {e.waiter for e in live}
    targets = {e.target for e in live}
    ends = [t for t in targets if t not in waiters or t in in_cycle]
    stub = {a.name: a for a in actors}
    for e in edges:  # what noted waits name and no actor is
        if e.state == "noted" and e.target not in stub:
            stub[e.target] = ActorStacks(e.target, "", "NOT_AN_ACTOR", reason="no actor")
    waited_on = []
    for t in ends:
        kind, why = _kind(t, stub.get(t), [e for e in live if e.target == t], t in in_cycle)
        stacks = stub.get(t) or ActorStacks(t, "", "UNKNOWN", reason="not in this report")
        waited_on.append(WaitEnd(t, _longest_chain_to(t, graph), stacks, kind, why))
    waited_on.sort(key=lambda w: (KINDS.index(w.kind), -len(w.chain), w.name))
    return StacksReport(
        actors=actors,
        cycles=[
            WaitCycle(
                c,
                [
                    e
                    for i, m in enumerate(c)
                    for e in live
                    if e.waiter == m and e.target == c[(i + 1) % len(c)]
                ],
            )
            for c in cycles
        ],
        waited_on=waited_on,
        edges=sorted(edges, key=lambda e: -e.age_s),
        taken_s=taken_s,
    )


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The graph's elementary cycles, each once (rotated to start at its least member)."""
    found: dict[tuple[str, ...], list[str]] = {}
    budget = [MAX_PATHS]

    def walk(start: str, node: str, path: list[str], on: set[str]) -> None:
        for nxt in graph.get(node, []):
            budget[0] -= 1
            if budget[0] < 0:
                return
            if nxt == start:
                i = path.index(min(path))
                ring = path[i:] + path[:i]
                found.setdefault(tuple(ring), ring)
            elif nxt not in on and nxt > start:  # each cycle is walked from its least member only
                on.add(nxt)
                walk(start, nxt, [*path, nxt], on)
                on.discard(nxt)

    for s in sorted(graph):
        walk(s, s, [s], {s})
    return list(found.values())


def _longest_chain_to(end: str, graph: dict[str, list[str]]) -> list[str]:
    """The longest simple chain of waiters that ends at ``end`` (first waiter first)."""
    waiters_of: dict[str, list[str]] = {}
    for w, ts in graph.items():
        for t in ts:
            waiters_of.setdefault(t, []).append(w)
    best = [end]
    budget = [MAX_PATHS]

    def back(node: str, path: list[str]) -> None:
        nonlocal best
        if len(path) > len(best):
            best = path
        for w in waiters_of.get(node, []):
            budget[0] -= 1
            if budget[0] < 0 or w in path:
                continue
            back(w, [w, *path])

    back(end, [end])
    return best

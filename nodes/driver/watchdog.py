"""The stall watchdog: a step that runs too long leaves a report and a line naming what it waits on.

:class:`StallWatchdog` watches the training loop's steps (``begin``/``end``). When one has run past
its bound (``run.stall_after_s``; 0: the larger of 600 s and 10 times the median step so far), it writes
``<out>/stalls/step-N.txt`` — the cluster's forensics report (who waits on whom, stacks; when the
runtime has ``cluster.stacks``), each server's ``/v1/loads``, the governor's and the buffer's
counters, what each rollout actor's client is waiting on — and prints one line naming the culprit:
a server that does not answer; an actor somebody waits on that is dead, unresponsive, failed a call
it still owes (a rank missing from its peers' collective) or in a wait cycle (the forensics
report's culprit); a server holding a request far past the others; the rollout actor holding the
oldest episode in flight; or what the forensics report ends at. Waits that are back-pressure by
design (the governor's staleness bound, the buffer waiting for groups, a rollout actor's dispatch
paused while the trainer pushes weights) never head it; a paused dispatch is said so, after what
the push waits on. The line ends
with the command that shows the cluster's stacks now. It keeps watching (one report per bound of
stall) and kills nothing.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx  # a /v1/loads per server when a stall is examined: rare calls, not /generate's wire
import structlog

from rlactors.base.aio import wait_for

__all__ = ["StallWatchdog", "stall_bound"]

log = structlog.get_logger(__name__)

ASK_TIMEOUT_S = 10.0  # each question the diagnosis asks (an actor, a server) gets this long
# culprits of the forensics report that head the line before the rollout's facts (rlactors.api.stacks.KINDS)
SEVERE = ("dead", "unresponsive", "failed", "cycle")


def stall_bound(configured: float, durations: list[float]) -> float:
    """``configured`` when set (> 0), else the larger of 600 s and 10 times the median step."""
    if configured > 0:
        return configured
    return max(600.0, 10 * statistics.median(durations)) if durations else 600.0


class StallWatchdog:
    """Watches the loop's steps over ``plane`` (recipes/gsm8k_plane.py's Plane: its cluster,
    governor, buffer, rollout actors and the servers' URLs); reports go to ``<out>/stalls``."""

    def __init__(
        self, plane: Any, out: Path, stall_after_s: float = 0.0, report: Any = print, command: str = ""
    ) -> None:
        """``command``: what an operator runs to see the stacks now (``rlactors stack --run …``)."""
        self.plane, self.dir, self.configured, self.report = plane, out / "stalls", stall_after_s, report
        self.command = command
        self.durations: list[float] = []
        self._step: int | None = None
        self._started = 0.0
        self._reported = 0  # stall bounds already reported for the running step
        self._task: asyncio.Task | None = None
        self.reports: list[Path] = []

    def begin(self, step: int) -> None:
        """Step ``step`` starts now."""
        self._step, self._started, self._reported = step, time.monotonic(), 0
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="stall-watchdog")

    def end(self) -> None:
        """The running step is done."""
        if self._step is not None:
            self.durations.append(time.monotonic() - self._started)
        self._step = None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self._step is None:
                continue
            bound = stall_bound(self.configured, self.durations)
            running = time.monotonic() - self._started
            if running >= bound * (self._reported + 1):
                self._reported += 1
                try:
                    await self.diagnose(self._step, running)
                except Exception:  # the watchdog must never stop the run
                    log.exception("stall_watchdog.failed")

    async def diagnose(self, step: int, running_s: float) -> tuple[str, Path]:
        """Write the report for ``step`` and print the line; returns both."""
        p = self.plane
        facts: dict[str, Any] = {}
        stacks = ""
        if hasattr(p.cluster, "stacks"):
            try:
                stacks_report = await wait_for(p.cluster.stacks(), ASK_TIMEOUT_S * 2)
                stacks = str(stacks_report)
                facts["waited_on"] = [
                    getattr(w, "name", str(w))
                    for w in getattr(stacks_report, "waited_on", [])
                    if getattr(w, "kind", "") != "backpressure"
                ]
                culprit = getattr(stacks_report, "culprit", None)
                if culprit is not None:
                    facts["culprit"] = {
                        "name": culprit.name,
                        "kind": culprit.kind,
                        "summary": culprit.summary,
                    }
            except Exception as e:  # the report is written whatever part of it fails
                stacks = f"(the forensics report failed: {type(e).__name__}: {e})"
        facts["servers"] = await self._loads(p.sync.live)
        facts["governor"] = await _ask(p.governor.stats())
        facts["buffer"] = await _ask(p.buffer.stats())
        facts["oldest_in_flight"] = await _ask(p.buffer.oldest_in_flight())
        names = {}
        for r in p.rollouts:
            actor_id = getattr(getattr(r, "handle", r), "actor_id", None)
            stats = await _ask(r.stats())
            name = getattr(getattr(r, "handle", r), "name", None) or str(actor_id)
            names[actor_id] = name
            facts.setdefault("rollouts", {})[name] = (
                {k: stats.get(k) for k in ("inflight", "paused", "waiting", "episodes_done", "failure")}
                if isinstance(stats, dict)
                else stats
            )
        who, why = self.blame(facts, names, running_s)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step-{step}.txt"
        text = (
            f"step {step} has run for {running_s:.0f} s (bound {stall_bound(self.configured, self.durations):.0f} s)\n"
            f"waiting on: {who} ({why})\n\n== facts\n{json.dumps(facts, indent=2, default=str)}\n\n"
            f"== who waits on whom (cluster.stacks)\n{stacks or '(not available)'}\n"
        )
        path.write_text(text)
        self.reports.append(path)
        line = f"stall: step {step} has run for {running_s:.0f} s, waiting on {who} ({why}); report {path}"
        if self.command:
            line += f"; stacks now: {self.command}"
        self.report(line)
        return line, path

    @staticmethod
    def blame(facts: dict[str, Any], names: dict[Any, str], running_s: float) -> tuple[str, str]:
        """The end of the wait chain, from the facts: ``(who, why)``."""
        for url, load in facts.get("servers", {}).items():
            if isinstance(load, str):
                return f"server {url}", f"it does not answer: {load}"
        culprit = facts.get("culprit")
        if isinstance(culprit, dict) and culprit.get("kind") in SEVERE:
            # "X at the end of a → b → X: what it is doing": the line names X, then what
            what = culprit["summary"].split(": ", 1)[-1]
            return culprit["name"], what
        rollouts = facts.get("rollouts", {})
        paused = sorted(n for n, r in rollouts.items() if isinstance(r, dict) and r.get("paused"))
        if paused:  # a weight push is on: its requests are held by design, the push is what runs
            held = (
                f"{', '.join(paused)} {'holds its' if len(paused) == 1 else 'hold their'} requests while"
                " the trainer pushes weights: back-pressure by design"
            )
            if isinstance(culprit, dict) and culprit.get("kind") != "backpressure":
                return culprit["name"], culprit["summary"].split(": ", 1)[-1] + f"; {held}"
            return "the weight push", held
        oldest = facts.get("oldest_in_flight")
        if isinstance(oldest, dict):
            holder = names.get(oldest["actor_id"]) or oldest["actor_id"]
            waiting = (rollouts.get(holder) or {}).get("waiting") or {}
            if waiting:
                url, w = max(waiting.items(), key=lambda kv: kv[1]["oldest_s"])
                if w["oldest_s"] >= min(60.0, running_s / 2):
                    return (
                        f"server {url}",
                        f"{holder}'s request there has run {w['oldest_s']:.0f} s with no answer",
                    )
            return holder, f"its episode {oldest['group']} has been in flight {oldest['age_s']:.0f} s"
        if facts.get("waited_on"):
            return facts["waited_on"][0], "the end of the longest wait chain"
        return "the buffer", "no episode is in flight; see the governor's counters in the report"

    async def _loads(self, urls: list[str]) -> dict[str, Any]:
        keys = getattr(self.plane.sync, "keys", None)  # the servers' (protocols.http.auth), if they take any
        async with httpx.AsyncClient(timeout=ASK_TIMEOUT_S, auth=keys or None) as http:

            async def one(url: str) -> Any:
                try:
                    r = await http.get(f"{url}/v1/loads")
                    return r.json() if r.status_code == 200 else f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    return (
                        f"{type(e).__name__} after {ASK_TIMEOUT_S:.0f} s"
                        if isinstance(e, httpx.TimeoutException)
                        else repr(e)
                    )

            return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))


async def _ask(aw: Any) -> Any:
    """An actor's answer, or what went wrong asking (a stalled actor must not stall the report)."""
    try:
        return await wait_for(aw, ASK_TIMEOUT_S)
    except Exception as e:  # a stalled or dead actor: its answer is what went wrong
        return f"(no answer: {type(e).__name__}: {e})"

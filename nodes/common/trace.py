"""A timeline of every run: Chrome trace events (Perfetto, chrome://tracing) from every process,
and the last steps drawn as a picture.

Each process records into its own :data:`TRACE`, a bounded ring buffer that records nothing until
someone drains it (so a run without ``run.trace`` pays nothing): the rollout actors their generate
requests (one async span per request from first post to result, aborts and resumes included, on
the track of the server that answered; its ``trace_id`` is the trajectory's), the trainer ranks
each train step's phases (proximal log-probs, forward/backward per micro-batch, optimizer) and rank
0 each weight push's (pause, gather and broadcast per bucket, resume). The driver drains them after
each step and :class:`TraceWriter` appends them to ``trace.json`` as it goes, with its own spans
(the step's wait, train and publish, evaluations) and counters (the governor's capacity and running
episodes, the buffer's size). :func:`plot_timeline` draws the last steps' lanes as a PNG.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nodes.common.disk import DiskFullError, append_whole

__all__ = ["TRACE", "TraceBuffer", "TraceWriter", "plot_timeline"]

US = 1e6


class TraceBuffer:
    """This process's trace events, oldest dropped past ``maxlen``; off until :meth:`drain`."""

    def __init__(self, maxlen: int = 50_000) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self.enabled = False
        self.track = "process"  # this process's track (an actor sets its name)

    def span(self, name: str, start: float, end: float, thread: str = "main", **args: Any) -> None:
        """A complete span (``time.time()`` seconds) on this process's track."""
        if self.enabled:
            self.events.append(
                {
                    "ph": "X",
                    "name": name,
                    "ts": start * US,
                    "dur": max(0.0, end - start) * US,
                    "proc": self.track,
                    "thread": thread,
                    "args": args,
                }
            )

    @contextlib.contextmanager
    def phase(self, name: str, thread: str = "main", **args: Any) -> Iterator[None]:
        """Record the ``with`` block as a span."""
        if not self.enabled:
            yield
            return
        start = time.time()
        try:
            yield
        finally:
            self.span(name, start, time.time(), thread, **args)

    def async_span(self, name: str, key: str, start: float, end: float, track: str, **args: Any) -> None:
        """A span on another track that may overlap others there (a request at a server)."""
        if self.enabled:
            common = {"cat": name, "name": name, "id": key, "proc": track, "thread": "requests"}
            self.events.append({"ph": "b", "ts": start * US, "args": args, **common})
            self.events.append({"ph": "e", "ts": end * US, **common})

    def counter(self, name: str, **values: float) -> None:
        if self.enabled:
            self.events.append(
                {
                    "ph": "C",
                    "name": name,
                    "ts": time.time() * US,
                    "proc": self.track,
                    "thread": "main",
                    "args": values,
                }
            )

    def drain(self) -> list[dict[str, Any]]:
        """The events so far (and record from now on)."""
        self.enabled = True
        out = list(self.events)
        self.events.clear()
        return out


TRACE = TraceBuffer()


class TraceWriter:
    """``trace.json`` written as the run goes: a JSON array of trace events (a run stopped midway
    leaves an unterminated array, which Perfetto and chrome://tracing read)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("wb", buffering=0)  # each write goes out whole or not at all
        append_whole(self._file, "[\n", "the run's timeline")
        self._first = True
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[int, str], int] = {}

    def write(self, events: list[dict[str, Any]]) -> None:
        """Append ``events`` (a :class:`TraceBuffer`'s, from any process)."""
        lines: list[dict[str, Any]] = []
        for e in events:
            pid = self._pid(e.pop("proc"), lines)
            tid = self._tid(pid, e.pop("thread"), lines)
            lines.append({**e, "pid": pid, "tid": tid})
        text = "".join(
            ("" if self._first and i == 0 else ",\n") + json.dumps(line, default=str)
            for i, line in enumerate(lines)
        )
        if text:  # a full disk: DiskFullError, the events before kept as they were
            append_whole(self._file, text, "the run's timeline")
            self._first = False

    def _pid(self, track: str, lines: list[dict[str, Any]]) -> int:
        if track not in self._pids:
            self._pids[track] = pid = len(self._pids) + 1
            lines.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": track}})
            lines.append(
                {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
            )
        return self._pids[track]

    def _tid(self, pid: int, thread: str, lines: list[dict[str, Any]]) -> int:
        if (pid, thread) not in self._tids:
            self._tids[(pid, thread)] = tid = len(self._tids) + 1
            lines.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
        return self._tids[(pid, thread)]

    def close(self) -> None:
        if not self._file.closed:
            try:
                append_whole(self._file, "\n]\n", "the run's timeline")
            except DiskFullError:  # left unterminated, which the viewers read
                pass
            finally:
                self._file.close()


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a ``trace.json``, terminated or not."""
    text = path.read_text().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return list(json.loads(text))


def plot_timeline(trace_json: Path, out_png: Path, last_steps: int = 3) -> Path | None:
    """The last ``last_steps`` steps as lanes (one per track) of spans; None without steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = read_trace(trace_json)
    names = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"
    }
    steps = sorted((e for e in events if e.get("ph") == "X" and e["name"] == "step"), key=lambda e: e["ts"])[
        -last_steps:
    ]
    if not steps:
        return None
    t0, t1 = steps[0]["ts"], max(e["ts"] + e["dur"] for e in steps)
    bars: dict[int, list[tuple[float, float, str]]] = {}
    opened: dict[tuple[int, str], float] = {}
    for e in events:
        ph = e.get("ph")
        if ph == "X":
            bars.setdefault(e["pid"], []).append((e["ts"], e["dur"], e["name"]))
        elif ph == "b":
            opened[(e["pid"], str(e["id"]))] = e["ts"]
        elif ph == "e" and (start := opened.pop((e["pid"], str(e["id"])), None)) is not None:
            bars.setdefault(e["pid"], []).append((start, e["ts"] - start, e["name"]))
    rows = sorted(pid for pid, spans in bars.items() if any(s < t1 and s + d > t0 for s, d, _ in spans))
    colors: dict[str, Any] = {}
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    for y, pid in enumerate(rows):
        shown = sorted((b for b in bars[pid] if b[0] < t1 and b[0] + b[1] > t0), key=lambda b: -b[1])
        for i, (start, dur, name) in enumerate(shown):  # outer spans first; nested ones thinner, on top
            depth = sum(1 for s, d, _ in shown[:i] if s <= start and start + dur <= s + d)
            color = colors.setdefault(name, cmap(len(colors) % 20))
            ax.barh(y, dur / US, left=(start - t0) / US, height=0.8 * 0.7**depth, color=color, linewidth=0)
    ax.set_yticks(range(len(rows)), [names.get(pid, str(pid)) for pid in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"the last {len(steps)} steps ({trace_json.name})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png

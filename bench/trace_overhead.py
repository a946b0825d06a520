"""What the run's timeline costs (nodes/common/trace.py), against the step time of a real run.

    python bench/trace_overhead.py runs/gsm8k_grpo      # a run made with run.trace = true (the default)

Two parts: the cost of recording one event in a process (a span, a request's async span; and with
recording off), measured here; and, from the run's trace.json, per step: the driver's own tracing
time (its "trace" spans: draining every actor and writing), and the events each process recorded,
priced at the measured cost. The overhead is their sum over the step time; target <= 2%.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

from nodes.common.trace import TraceBuffer, TraceWriter, read_trace


def per_event_us(n: int = 200_000) -> dict[str, float]:
    """Microseconds to record one event, on and off, and to write one to trace.json."""
    out = {}
    for label, enabled in (("span", True), ("span_off", False)):
        buf = TraceBuffer(maxlen=n)
        buf.enabled = enabled
        t0 = time.perf_counter()
        for i in range(n):
            buf.span("forward/backward", 1.0, 2.0, minibatch=0, microbatch=i)
        out[label] = (time.perf_counter() - t0) / n * 1e6
    buf = TraceBuffer(maxlen=2 * n)
    buf.enabled = True
    t0 = time.perf_counter()
    for i in range(n):
        buf.async_span(
            "generate", f"r{i}", 1.0, 2.0, "server a", rid=f"r{i}", trace_id="g/s0", prompt_tokens=9
        )
    out["request"] = (time.perf_counter() - t0) / n * 1e6
    events = buf.drain()
    path = Path("/tmp/trace_overhead_bench.json")
    w = TraceWriter(path)
    t0 = time.perf_counter()
    w.write(events)
    w.close()
    out["write"] = (time.perf_counter() - t0) / len(events) * 1e6
    path.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run's out_dir (holds trace.json)")
    args = ap.parse_args()
    cost = per_event_us()
    print(f"machine: {platform.machine()}, python {platform.python_version()}")
    print("per event (µs): " + ", ".join(f"{k} {v:.2f}" for k, v in cost.items()))
    events = read_trace(args.run / "trace.json")
    steps = sorted((e for e in events if e.get("ph") == "X" and e["name"] == "step"), key=lambda e: e["ts"])
    traces = sorted((e for e in events if e.get("ph") == "X" and e["name"] == "trace"), key=lambda e: e["ts"])
    recorded = [e for e in events if e.get("ph") in ("X", "b", "C")]
    step_s = statistics.median(e["dur"] for e in steps) / 1e6
    driver_s = statistics.median(e["dur"] for e in traces) / 1e6 if traces else 0.0
    per_step = len(recorded) / max(1, len(steps))
    record_s = per_step * (cost["request"] + cost["write"]) / 1e6  # the dearer kind, priced for every event
    print(f"{len(steps)} steps, median {step_s:.2f} s; {per_step:.0f} events per step (all processes)")
    print(f"driver's tracing per step: median {driver_s * 1e3:.1f} ms (drain every actor + write)")
    print(f"recording those events: {record_s * 1e3:.2f} ms per step (at the measured cost)")
    print(f"overhead: {(driver_s + record_s) / step_s:.2%} of step time (target <= 2%)")


if __name__ == "__main__":
    main()

"""A rollout client's dispatch paused while the trainer pushes weights is back-pressure by design:
``cluster.stacks()`` lists its held requests as a wait on the weight push, labelled so, and the
stall line never names a paused rollout actor the culprit (issue 39)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nodes.driver.watchdog import StallWatchdog
from nodes.rollout.client import PAUSED_BY_DESIGN, ClientConfig, GenRequest, SGLangClient
from rlactors.base.aio import wait_for
from rlactors.base.forensics import noted_waits
from tests.rollout.scripted import Answer, Posted, Serve, reply


async def _until(ok: Callable[[], bool], turns: int = 100) -> None:
    """Give the loop turns until ``ok()`` holds (the held requests reach their wait in a few)."""
    for _ in range(turns):
        if ok():
            return
        await asyncio.sleep(0)
    assert ok()


async def test_requests_held_over_a_pause_are_a_noted_back_pressure_wait(serve: Serve) -> None:
    posts: list[Posted] = []

    def server(request: Posted) -> Answer:
        posts.append(request)
        return reply([7])

    client = SGLangClient((await serve(server, "a")).urls, ClientConfig())
    client.pause()
    tasks = [
        asyncio.ensure_future(client.agenerate(GenRequest([1], {"max_new_tokens": 1}))) for _ in range(3)
    ]
    try:
        await _until(lambda: any(w["what"] == "dispatch paused" for w in noted_waits()))
        (w,) = [w for w in noted_waits() if w["what"] == "dispatch paused"]
        assert (w["on"], w["backpressure"], w["count"]) == ("the weight push", PAUSED_BY_DESIGN, 3)
        assert not posts
        client.resume()
        await wait_for(asyncio.gather(*tasks), 10)
        assert len(posts) == 3 and not [w for w in noted_waits() if w["what"] == "dispatch paused"]
    finally:
        for t in tasks:
            t.cancel()
        await client.aclose()


def _facts(paused: bool, culprit: dict | None) -> dict:
    facts: dict = {
        "servers": {"http://a": {"running": 0}},
        "rollouts": {"rollout-0": {"inflight": 2, "paused": paused, "waiting": {}}},
        "oldest_in_flight": {"actor_id": "r", "group": "gsm8k/e0/1", "age_s": 40.0},
    }
    if culprit:
        facts["culprit"] = culprit
    return facts


def test_the_stall_line_says_a_paused_dispatch_is_back_pressure_never_its_culprit() -> None:
    names = {"r": "rollout-0"}
    push = {
        "name": "trainer-0",
        "kind": "busy",
        "summary": "trainer-0 at the end of driver-1 → trainer-0: running push_weights for 40 s",
    }
    who, why = StallWatchdog.blame(_facts(True, push), names, 60.0)
    assert who == "trainer-0", why
    assert why == (
        "running push_weights for 40 s; rollout-0 holds its requests while the trainer pushes weights:"
        " back-pressure by design"
    )
    who, why = StallWatchdog.blame(_facts(True, None), names, 60.0)
    assert (who, why) == (
        "the weight push",
        "rollout-0 holds its requests while the trainer pushes weights: back-pressure by design",
    )
    # not paused: the episode in flight is what the line names, as before
    assert StallWatchdog.blame(_facts(False, None), names, 60.0)[0] == "rollout-0"

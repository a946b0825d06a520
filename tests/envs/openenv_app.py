"""A small OpenEnv environment built with the real ``openenv-core``, served as a real server process
(``uvicorn tests.envs.openenv_app:app``) in the tests.

Each episode: ``reset`` asks for a word; each ``step`` takes the model's message, rewards its length
(``min(1, len / 40)``) and counts the characters in the observation, done after ``TURNS`` steps. The
reward is the environment's own, so a run's rewards are these numbers.

``dying_app`` exits its process at its first step when ``$RLACTORS_TEST_DIE_ONCE`` names a file that
does not exist yet (it creates it first): the first server the run starts dies once, its replacement
lives. Each of its server processes notes, at its first session, its pid and the command line of the
process that started it in ``$RLACTORS_TEST_DIE_ONCE.servers`` (one JSON line), so that a test knows
which actor owned it and can check the process table for it. An episode reset with ``kind="hang"``
never gets an answer to its steps.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

TURNS = 2


class SayAction(Action):
    message: str = ""


class SayObservation(Observation):
    prompt: str = ""
    chars: int = 0


class SayEnv(Environment[SayAction, SayObservation, State]):
    """Asks for a word ``TURNS`` times; rewards each message's length."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.hangs = False

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SayObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.hangs = kwargs.get("kind") == "hang"
        return SayObservation(prompt=f"Say a word (seed {seed}).", done=False, reward=None)

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> SayObservation:
        if self.hangs:
            threading.Event().wait()  # never answers (the server's executor thread hangs)
        self._state.step_count += 1
        n = len(action.message)
        done = self._state.step_count >= TURNS
        return SayObservation(prompt="Another word.", chars=n, done=done, reward=min(1.0, n / 40))

    @property
    def state(self) -> State:
        return self._state


class DyingEnv(SayEnv):
    noted = False  # this process has noted itself in $RLACTORS_TEST_DIE_ONCE.servers

    def __init__(self) -> None:
        super().__init__()
        marker = os.environ.get("RLACTORS_TEST_DIE_ONCE")
        if marker and not DyingEnv.noted:
            DyingEnv.noted = True
            parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            with open(f"{marker}.servers", "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "parent_pid": os.getppid(), "parent": parent}) + "\n")

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> SayObservation:
        marker = os.environ.get("RLACTORS_TEST_DIE_ONCE")
        if marker and not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            os._exit(1)  # the server process dies mid-episode
        return super().step(action, timeout_s, **kwargs)


app = create_app(SayEnv, SayAction, SayObservation, env_name="say", max_concurrent_envs=64)
dying_app = create_app(DyingEnv, SayAction, SayObservation, env_name="say", max_concurrent_envs=64)

"""The endpoint's standalone mode (``python -m nodes.rollout.openai_endpoint``) in front of a sim
reference server, driven by the official ``openai`` SDK: it prints a base_url that works, and a
request that repeats the history it served continues that completion's token ids. The server takes
keys, which the endpoint gets from the environment (RLACTORS_SERVER_API_KEY, ..._ADMIN_API_KEY)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from nodes.inference.launcher import REPO_ROOT
from nodes.inference.models import ensure_tiny_checkpoint
from nodes.rollout.chat import continuation_ids, prompt_ids
from protocols.http.auth import ServerKeys
from tests.helpers.servers import reference_server

KEYS = ServerKeys("plain-key", "admin-key")
MAX_TOKENS = 16  # with "Hi", the sim's 16 tokens re-tokenise to other ids (and one more)


@pytest.fixture(scope="module")
def model_path() -> Path:
    return ensure_tiny_checkpoint()


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    """A sim server whose ids fit SmolLM2's tokenizer and that never ends early (no EOS)."""
    args = ["--backend", "sim", "--sim-vocab-size", "49152", "--sim-eos-prob", "0", *KEYS.server_args()]
    with reference_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def base_url(sim: str, model_path: Path) -> Iterator[str]:
    """The standalone endpoint as its own process on a free port; its printed base_url."""
    cmd = [
        sys.executable,
        "-m",
        "nodes.rollout.openai_endpoint",
        "--server-url",
        sim,
        "--model-path",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
            env={
                **os.environ,
                "RLACTORS_SERVER_API_KEY": KEYS.api_key,
                "RLACTORS_SERVER_ADMIN_API_KEY": KEYS.admin_api_key,
            },
        )
        try:
            # its first line (printed whole, flushed), or EOF if it exits first
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            line = proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
            if not line.startswith("base_url: "):
                err.seek(0)
                pytest.fail(f"no base_url printed (got {line!r}):\n{err.read().decode()[-3000:]}")
            yield line.removeprefix("base_url: ").strip()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            proc.stdout.close()  # type: ignore[union-attr]


async def _generate(server: str, ids: list[int]) -> list[int]:
    async with httpx.AsyncClient(timeout=60, auth=KEYS) as http:
        r = await http.post(
            f"{server}/generate",
            json={"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}},
        )
    r.raise_for_status()
    return list(r.json()["output_ids"])


async def test_standalone_prints_a_working_base_url_and_continues_token_exactly(
    base_url: str, sim: str, model_path: Path, tokenizer: Any
) -> None:
    assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
    assert not base_url.startswith("http://127.0.0.1:0/")  # the port bound, not the one asked for
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        assert [m.id for m in (await client.models.list()).data] == [model_path.name]
        first: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        r1 = await client.chat.completions.create(
            model=model_path.name, messages=first, max_tokens=MAX_TOKENS, temperature=0
        )
        assert r1.choices[0].finish_reason == "length" and r1.usage.completion_tokens == MAX_TOKENS
        p1 = prompt_ids(tokenizer, first, None)
        assert r1.usage.prompt_tokens == len(p1)

        new = [{"role": "user", "content": "And then?"}]
        second = [*first, r1.choices[0].message.model_dump(exclude_none=True), *new]
        r2 = await client.chat.completions.create(
            model=model_path.name, messages=second, max_tokens=MAX_TOKENS, temperature=0
        )
        # the sim's greedy tokens hash every id before them: ask it directly what it generates after
        # the first prompt, then after first prompt + that output + the new messages' rendering
        out1 = await _generate(sim, p1)
        assert r1.choices[0].message.content == tokenizer.decode(out1, skip_special_tokens=True)
        continued = p1 + out1 + continuation_ids(tokenizer, first, new, None, out1, "length")
        assert continued != prompt_ids(tokenizer, second, None)  # re-rendering would send other ids
        assert r2.usage.prompt_tokens == len(continued)
        out2 = await _generate(sim, continued)
        assert r2.choices[0].message.content == tokenizer.decode(out2, skip_special_tokens=True)

        edited = [*first, {"role": "assistant", "content": "edited"}, *new]
        r3 = await client.chat.completions.create(
            model=model_path.name, messages=edited, max_tokens=MAX_TOKENS, temperature=0
        )
        assert r3.usage.prompt_tokens == len(prompt_ids(tokenizer, edited, None))  # a new sample
    finally:
        await client.close()


def test_the_one_episode_keeps_only_the_newest_completions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The standalone server's episode lives as long as the server: it matches a request against
    the newest KEPT_COMPLETIONS answers (found by the answer repeated, not by a scan of all)."""
    from nodes.rollout import turns
    from nodes.rollout.workflows import Sample

    monkeypatch.setattr(turns, "KEPT_COMPLETIONS", 2)
    ep = turns.Episode("default")
    user = [{"role": "user", "content": "q"}]
    kept = []
    for i in range(3):
        reply = {"role": "assistant", "content": f"a{i}"}
        c = turns._Completion(user, None, reply, Sample([1, 2], 1.0), 2, [], "stop")
        ep.keep(c)
        kept.append(c)

    def find(i: int) -> Any:
        messages = [*user, {"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": "more"}]
        return ep.find(messages, None, 1.0)

    assert find(0) is None  # evicted
    assert find(1) == (kept[1], 2) and find(2) == (kept[2], 2)
    assert ep.find([*user, {"role": "assistant", "content": "a2"}], None, 1.0) is None  # nothing new
    other_temperature = [*user, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "x"}]
    assert ep.find(other_temperature, None, 0.5) is None

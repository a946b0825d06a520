"""Per-token data as arrays from the client's read of the server's answer (issue 40): the answer
is read into numpy arrays once, a resumed request's chunks are concatenated, a workflow's sample
(an agent episode's too) grows by concatenation, and its trajectory reaches the codec's frames
without a conversion."""

from __future__ import annotations

from typing import Any

import numpy as np

from nodes.rollout.agents import AgentConfig, AgentWorkflow
from nodes.rollout.chunks import parse_chunk, token_versions
from nodes.rollout.client import GenRequest, GenResult, SGLangClient
from nodes.rollout.reward import RewardRunner
from nodes.rollout.workflows import Sample
from protocols.http.sglang import weight_version_spans
from protocols.rl import IDS_DTYPE, LOGPROBS_DTYPE, MASK_DTYPE, VERSIONS_DTYPE
from protocols.runtime import codec
from tests.rollout.scripted import Answer, Script, Serve, reply
from tests.rollout.test_client_mock import FAST
from tests.rollout.test_openai_endpoint import Scripted, tokenizer  # noqa: F401 - the fixture

PROMPT = np.arange(100, 400, dtype=np.int32)  # over the codec's inline limit: its own frame


def arrays_of(res: GenResult) -> list[tuple[type, np.dtype]]:
    return [(type(a), a.dtype) for a in (res.ids, res.logprobs, res.versions)]


ARRAYS = [(np.ndarray, np.int32), (np.ndarray, np.float64), (np.ndarray, np.int32)]


def test_an_answer_parses_into_arrays_in_one_pass() -> None:
    entries = [[-0.5, 3, None], [None, 4, "x"], [-0.25, 5, None]]  # a null log-prob reads as 0.0
    current = {"output_ids": [3, 4, 5], "meta_info": {"output_token_logprobs": entries}}
    legacy = {"meta_info": {"output_token_logprobs": entries}}  # before SGLang 0.5: ids from the entries
    for answer in (current, legacy):
        ids, lps, _ = parse_chunk(answer)
        assert (type(ids), ids.dtype, type(lps), lps.dtype) == (np.ndarray, np.int32, np.ndarray, np.float64)
        assert ids.tolist() == [3, 4, 5] and lps.tolist() == [-0.5, 0.0, -0.25]
    versions, labelled = token_versions({"weight_versions": weight_version_spans(["1", "1", "2"], "2")}, 3, 0)
    assert (type(versions), versions.dtype, versions.tolist(), labelled) == (
        np.ndarray,
        np.int32,
        [1, 1, 2],
        3,
    )


async def test_the_answer_is_read_into_arrays_and_lists_are_a_view_of_them(serve: Serve) -> None:
    script = Script(a=[lambda b: reply([5, 6, 7], "stop")])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    try:
        res = await client.agenerate(GenRequest([1, 2], {"max_new_tokens": 8}))
    finally:
        await client.aclose()
    assert arrays_of(res) == ARRAYS
    assert (
        res.ids.tolist() == [5, 6, 7]
        and res.logprobs.tolist() == [-0.25] * 3
        and res.versions.tolist() == [0] * 3
    )
    # for code that reads lists: lists of Python numbers, made once
    assert res.output_ids == [5, 6, 7] and type(res.output_ids[0]) is int
    assert res.output_logprobs == [-0.25] * 3 and type(res.output_logprobs[0]) is float
    assert res.output_ids is res.output_ids


async def test_a_resumed_requests_chunks_are_concatenated_and_its_prefix_posted_from_arrays(
    serve: Serve,
) -> None:
    def aborted(body: dict) -> object:
        client.set_version(1)  # a push between the chunks: the second is stamped with the new version
        return reply([5, 6, 7], "abort", message="paused")

    script = Script(
        a=[aborted, lambda b: reply([8, 9], "abort", message="paused"), lambda b: reply([10], "stop")]
    )
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    try:
        # a workflow's sample posts its ids as an int32 array
        res = await client.agenerate(GenRequest(PROMPT, {"max_new_tokens": 10}, rid="r"))
    finally:
        await client.aclose()
    assert arrays_of(res) == ARRAYS and res.aborts == 2 and res.posts == 3
    assert res.ids.tolist() == [5, 6, 7, 8, 9, 10] and res.versions.tolist() == [0, 0, 0, 1, 1, 1]
    assert res.logprobs.tolist() == [-0.25] * 6
    [(_, first), (_, second), (_, third)] = script.posts
    assert first["input_ids"] == PROMPT.tolist()
    assert (
        second["input_ids"] == [*PROMPT.tolist(), 5, 6, 7]
        and second["sampling_params"]["max_new_tokens"] == 7
    )
    assert (
        third["input_ids"] == [*PROMPT.tolist(), 5, 6, 7, 8, 9]
        and third["sampling_params"]["max_new_tokens"] == 5
    )


async def test_a_streamed_answer_ends_as_arrays_and_its_callback_gets_lists(serve: Serve) -> None:
    got: list[tuple[list, list]] = []

    def streamed(body: dict) -> object:
        import orjson

        meta = {
            "finish_reason": {"type": "stop"},
            "completion_tokens": 2,
            "output_token_logprobs": [[-0.5, 3, None], [-0.75, 4, None]],
        }
        event = orjson.dumps({"output_ids": [3, 4], "text": "de", "meta_info": meta})
        return Answer(200, b"data: " + event + b"\n\ndata: [DONE]\n\n", {"Content-Type": "text/event-stream"})

    script = Script(a=[streamed])
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    try:
        on_tokens = lambda ids, lps, tops: got.append((ids, lps))  # noqa: E731
        res = await client.agenerate(GenRequest([1], {"max_new_tokens": 4}, on_tokens=on_tokens))
    finally:
        await client.aclose()
    assert script.posts[0][1]["stream"] is True
    assert arrays_of(res) == ARRAYS and res.ids.tolist() == [3, 4] and res.logprobs.tolist() == [-0.5, -0.75]
    assert got == [([3, 4], [-0.5, -0.75])] and type(got[0][0][0]) is int


def result(ids: list[int], version: int) -> GenResult:
    n = len(ids)
    return GenResult(
        "r", np.array(ids, np.int32), np.full(n, -0.5), np.full(n, version, np.int32), "stop", "", 0, [0], "u"
    )


def test_a_sample_started_from_an_array_grows_arrays_that_the_codec_sends_as_they_are() -> None:
    s = Sample(PROMPT, 1.0)
    s.add_output(result(list(range(300)), 2))
    twin = s.fork()
    s.add_context([7, 8])  # a feedback turn, as the template renders it: a list
    s.add_output(result([9] * 800, 3))
    twin.add_output(result([1], 4))
    fields = (s.ids, s.mask, s.logprobs, s.versions)
    assert [(type(a), a.dtype) for a in fields] == [
        (np.ndarray, np.int32),
        (np.ndarray, np.int8),
        (np.ndarray, np.float32),
        (np.ndarray, np.int32),
    ]
    p = len(PROMPT)
    assert s.ids.tolist() == [*PROMPT.tolist(), *range(300), 7, 8, *[9] * 800]
    assert s.mask.tolist() == [0] * p + [1] * 300 + [0, 0] + [1] * 800
    assert s.logprobs.tolist() == [0.0] * p + [-0.5] * 300 + [0.0, 0.0] + [-0.5] * 800
    assert s.versions.tolist() == [-1] * p + [2] * 300 + [-1, -1] + [3] * 800
    assert twin.ids.tolist() == [*PROMPT.tolist(), *range(300), 1] and twin.versions[-1] == 4  # grew apart
    t = s.trajectory(1.0, "g", p)
    frames = codec.encode(t)
    # each per-token field is its own frame, a view of the sample's array: no conversion, no copy
    assert [any(getattr(f, "obj", None) is a for f in frames[1:]) for a in fields] == [True] * 4


async def two_turns(client: Any, item: Any) -> float:
    """An agent that asks (a prompt long enough for every field to be a frame of its own), then
    sends the answer back with a follow-up, which continues the first completion's ids."""
    messages: list[Any] = [{"role": "user", "content": "word " * 1100}]
    r = await client.chat.completions.create(model="p", messages=messages)
    messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    await client.chat.completions.create(model="p", messages=messages)
    return 1.0


async def test_an_agent_episode_is_arrays_that_the_codec_sends_as_they_are(tokenizer: Any) -> None:  # noqa: F811
    wf = AgentWorkflow(
        tokenizer,
        RewardRunner(lambda c, i: 0.0),
        AgentConfig(agent="tests.rollout.test_client_arrays:two_turns", n_samples=2),
    )
    gen = Scripted(tokenizer, ["Hello there.", "Hi.", "And more.", "More."])
    try:
        group = await wf.arun_episode(gen, {}, "g")
    finally:
        await wf.endpoint.aclose()
    assert len(group.trajectories) == 2 and wf.counters["history_edits"] == 0  # one sequence per run
    for t in group.trajectories:
        fields = (t.input_ids, t.loss_mask, t.logprobs, t.versions)
        assert [(type(a), a.dtype) for a in fields] == [
            (np.ndarray, IDS_DTYPE),
            (np.ndarray, MASK_DTYPE),
            (np.ndarray, LOGPROBS_DTYPE),
            (np.ndarray, VERSIONS_DTYPE),
        ]
        assert t.loss_mask[: t.prompt_len].sum() == 0 and t.loss_mask[t.prompt_len] == 1
        model = t.loss_mask == 1  # the model's two answers, as the scripted generator stamped them
        assert (
            t.meta["turns"] == 2
            and set(t.versions[model].tolist()) == {7}
            and set(t.versions[~model]) == {-1}
        )
        frames = codec.encode(t)
        # each per-token field is its own frame, a view of the episode's array: no conversion, no copy
        assert [any(getattr(f, "obj", None) is a for f in frames[1:]) for a in fields] == [True] * 4


def test_a_sample_started_from_a_list_keeps_lists() -> None:
    s = Sample([1, 2], 0.5)  # a user's workflow may start one from a list: it keeps lists
    s.add_output(result([5, 6], 1))
    s.add_context([7])
    assert (s.ids, s.mask, s.logprobs, s.versions) == (
        [1, 2, 5, 6, 7],
        [0, 0, 1, 1, 0],
        [0.0, 0.0, -0.5, -0.5, 0.0],
        [-1, -1, 1, 1, -1],
    )
    s.trajectory(1.0, "g", 2).validate()


def test_a_result_assembled_through_its_lists_sets_its_arrays() -> None:
    # a wrapper that assembles a result chunk by chunk through the list names (as a test's recorder does)
    res = GenResult("r", [], [], [], "length", "", 0, [], "")
    for chunk in ([5, 6], [7]):
        res.output_ids += chunk
        res.output_logprobs += [-0.5] * len(chunk)
        res.output_versions += [2] * len(chunk)
    assert arrays_of(res) == ARRAYS and res.ids.tolist() == [5, 6, 7] and res.output_ids == [5, 6, 7]
    s = Sample(PROMPT[:2], 1.0)
    s.add_output(res)
    assert s.ids.tolist() == [*PROMPT[:2].tolist(), 5, 6, 7] and s.versions.tolist() == [-1, -1, 2, 2, 2]
    res.ids = np.array([9], np.int32)  # a new array: the list is made again
    assert res.output_ids == [9]

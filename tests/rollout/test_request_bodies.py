"""The bodies our side sends are built from protocols/http/sglang.py's types and read back by them."""

from __future__ import annotations

import typing

import pydantic
import pytest

from nodes.rollout.client import GenRequest, SGLangClient
from protocols.http.sglang import (
    GenerateBody,
    GenerateRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDistributedRequest,
    request_body,
)
from tests.rollout.scripted import Script, Serve, answer, reply
from tests.rollout.test_client_mock import FAST


async def test_every_generate_body_the_client_posts_is_a_generate_body_the_server_accepts(
    serve: Serve,
) -> None:
    # first post, a resume after an abort, and a retry after a 5xx
    script = Script(
        a=[
            lambda b: reply([5, 6], "abort", message="paused"),
            lambda b: answer(503),
            lambda b: reply([7], "length"),
            lambda b: reply([8], "length"),
        ]
    )
    [A] = (await serve(script)).urls
    client = SGLangClient([A], FAST)
    await client.agenerate(GenRequest([1, 2, 3], {"max_new_tokens": 3, "min_new_tokens": 1}, rid="r"))
    await client.agenerate(GenRequest([1, 2, 3], {"max_new_tokens": 1}, rid="t", top_logprobs_num=2))
    await client.aclose()
    assert len(script.posts) == 4
    for _, body in script.posts[:3]:
        assert set(body) == GenerateBody.__required_keys__  # the optional keys only when asked
        req = GenerateRequest.from_json(body)
        assert req.input_ids[:3] == [1, 2, 3] and req.return_logprob is True
    assert set(script.posts[3][1]) == GenerateBody.__required_keys__ | {"top_logprobs_num"}
    assert GenerateRequest.from_json(script.posts[3][1]).top_logprobs_num == 2
    assert [b["rid"] for _, b in script.posts] == ["r", "r-r1", "r-r1-t1", "t"]
    assert script.posts[2][1]["sampling_params"] == {"max_new_tokens": 1, "min_new_tokens": 0}


def test_generate_body_names_only_fields_of_the_generate_request() -> None:
    assert set(typing.get_type_hints(GenerateBody)) <= set(GenerateRequest.model_fields)


def test_request_body_sends_the_fields_set_and_refuses_a_bad_value_at_the_caller() -> None:
    bucket = UpdateWeightsFromDistributedRequest(names=["w"], dtypes=["bfloat16"], shapes=[[2, 3]])
    assert request_body(bucket) == {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]]}
    assert UpdateWeightsFromDistributedRequest.from_json(request_body(bucket)) == bucket
    with pytest.raises(pydantic.ValidationError, match="mode must be one of abort, retract, in_place"):
        PauseGenerationRequest(mode="drain")
    with pytest.raises(pydantic.ValidationError, match="names, dtypes and shapes must have the same length"):
        UpdateWeightsFromDistributedRequest(names=["w", "b"], dtypes=["bfloat16"], shapes=[[2]])

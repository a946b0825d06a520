"""The rollout client reads answers recorded from a real SGLang 0.5.23 server (CPU engine, tiny
model; tests/rollout/fixtures/sglang-0.5.23-responses.json): a sampled generation with logprobs,
a request aborted mid-generation, and one retracted across a weight update to version "7", whose
``weight_versions`` spans say which weights made which tokens. Recorded, not written by hand, so
the shapes are SGLang's own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nodes.rollout.chunks import parse_chunk, token_versions
from nodes.rollout.client import GenRequest, SGLangClient
from tests.rollout.scripted import Serve
from tests.rollout.scripted import answer as json_answer

ANSWERS = json.loads((Path(__file__).parent / "fixtures" / "sglang-0.5.23-responses.json").read_text())


def test_every_recorded_answer_parses() -> None:
    for name in ("generate_logprob", "generate_aborted", "generate_across_update"):
        ids, lps, meta = parse_chunk(ANSWERS[name])
        assert (ids.dtype, lps.dtype) == (np.int32, np.float64), name  # arrays, made once per answer
        assert len(ids) == len(lps) == meta["completion_tokens"] > 0, name
        assert ids.tolist() == ANSWERS[name]["output_ids"] and (lps <= 0).all(), name
        assert lps.tolist() == [e[0] for e in meta["output_token_logprobs"]], name
    assert ANSWERS["generate_aborted"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_versions_across_a_real_update_come_from_sglang_spans() -> None:
    meta = ANSWERS["generate_across_update"]["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "7"] and meta["num_retractions"] == 1
    n, before = meta["completion_tokens"], spans[0]["end"]
    vers, labelled = token_versions(meta, n, posted_at=6)
    # "default" (the server's label before any push) cannot be read: the post-time version stands in
    assert vers.dtype == np.int32 and vers.tolist() == [6] * before + [7] * (n - before)
    assert labelled == n - before


async def test_client_reports_the_recorded_versions(serve: Serve) -> None:
    answer = ANSWERS["generate_across_update"]
    servers = await serve(lambda request: json_answer(200, json=answer), "sglang")
    client = SGLangClient(servers.urls, version=6)
    try:
        res = await client.agenerate(GenRequest([12, 13, 14], {"max_new_tokens": 600}, rid="r"))
    finally:
        await client.aclose()
    assert res.output_ids == answer["output_ids"] and res.finish_reason == "length"
    assert res.output_versions[0] == 6 and res.output_versions[-1] == 7
    assert res.output_versions.count(7) == 600 - answer["meta_info"]["weight_versions"][0]["end"]

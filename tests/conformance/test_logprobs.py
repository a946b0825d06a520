"""/generate log-probs beyond the sampled token's: the prompt's (``logprob_start_len``), the top
``top_logprobs_num`` tokens, chosen tokens (``token_ids_logprob``) and their texts
(``return_text_in_logprobs``), in SGLang 0.5.23's shapes.

Each test runs against the server under test (the reference server's ``sim`` backend, or real
SGLang in the SGLang stage) and, in the main suite, the reference server's ``hf`` backend on the
same tiny checkpoint. Values are checked against each other (a prompt's log-prob of a token
equals the log-prob it had when it was generated; a token's entry in the top list equals its
``token_ids_logprob`` entry), so the checks hold for a real model and for the sim alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

PROMPT = [5, 17, 33, 41, 9, 12, 77, 150]
TOL = 2e-3  # a prefill and a decode step of the same position differ by float rounding


@pytest.fixture(params=["server", "hf"])
async def c(
    request: pytest.FixtureRequest, server_url: str, hf_url: str, is_reference: bool
) -> AsyncIterator[httpx.AsyncClient]:
    """The server under test, then (main suite only) the reference server's hf backend."""
    if request.param == "hf" and not is_reference:
        pytest.skip("the hf backend is the reference server's: it runs in the main suite")
    url = server_url if request.param == "server" else hf_url
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        yield client


async def gen(c: httpx.AsyncClient, ids: Any = PROMPT, n: int = 3, status: int = 200, **extra: Any) -> Any:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        **extra,
    }
    r = await c.post("/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


def entries_ok(rows: list[Any], ids: list[int], first_none: bool) -> None:
    """``[[logprob, id, text], ...]`` for ``ids``, log-probs <= 0, the first None if so said."""
    assert [t for _, t, _ in rows] == ids
    for k, (lp, _, text) in enumerate(rows):
        if k == 0 and first_none:
            assert lp is None
        else:
            assert isinstance(lp, float) and lp <= 0.0
        assert text is None


async def test_prompt_logprobs_start_at_logprob_start_len_with_none_first(c: httpx.AsyncClient) -> None:
    n = len(PROMPT)
    for start in (0, 3, n - 1):
        meta = (await gen(c, logprob_start_len=start))["meta_info"]
        entries_ok(meta["input_token_logprobs"], PROMPT[start:], first_none=True)
        assert meta["output_token_logprobs_length"] == 3 == len(meta["output_token_logprobs"])
    # at the prompt's end, or not asked for: none
    assert (await gen(c, logprob_start_len=n))["meta_info"]["input_token_logprobs"] == []
    assert (await gen(c))["meta_info"]["input_token_logprobs"] == []


async def test_logprob_start_len_past_the_prompt_is_refused(c: httpx.AsyncClient) -> None:
    body = await gen(c, logprob_start_len=len(PROMPT) + 1, status=400)
    assert "logprob_start_len" in body["error"]["message"]


async def test_a_prompt_token_has_the_logprob_it_was_generated_with(c: httpx.AsyncClient) -> None:
    """Generate 3 tokens greedily, then score prompt + the first two: the prompt log-prob of the
    second equals its output log-prob, and the next token is the third, with its log-prob."""
    out = await gen(c)
    o, lps = out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    scored = await gen(c, ids=PROMPT + o[:2], n=1, logprob_start_len=len(PROMPT))
    meta = scored["meta_info"]
    entries_ok(meta["input_token_logprobs"], o[:2], first_none=True)
    assert meta["input_token_logprobs"][1][0] == pytest.approx(lps[1], abs=TOL)
    assert scored["output_ids"] == [o[2]]
    assert meta["output_token_logprobs"][0][0] == pytest.approx(lps[2], abs=TOL)


async def test_the_cache_serves_no_token_before_logprob_start_len(c: httpx.AsyncClient) -> None:
    await gen(c)  # the whole prompt is cached now
    assert (await gen(c))["meta_info"]["cached_tokens"] == len(PROMPT) - 1
    assert (await gen(c, logprob_start_len=3))["meta_info"]["cached_tokens"] == 3
    assert (await gen(c, logprob_start_len=0))["meta_info"]["cached_tokens"] == 0


async def test_max_new_tokens_0_scores_the_prompt(c: httpx.AsyncClient) -> None:
    full = (await gen(c, logprob_start_len=0))["meta_info"]["input_token_logprobs"]
    body = await gen(c, n=0, logprob_start_len=0)
    assert body["output_ids"] == [] and body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    scored = body["meta_info"]["input_token_logprobs"]
    entries_ok(scored, PROMPT, first_none=True)
    assert [x[0] for x in scored[1:]] == pytest.approx([x[0] for x in full[1:]], abs=TOL)


async def test_top_logprobs_list_the_likeliest_tokens_the_greedy_one_first(c: httpx.AsyncClient) -> None:
    k = 3
    body = await gen(c, top_logprobs_num=k)
    meta = body["meta_info"]
    assert meta["input_top_logprobs"] == []  # no logprob_start_len: no prompt positions
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(body["output_ids"])
    for top, (lp, tid, _) in zip(tops, meta["output_token_logprobs"], strict=True):
        assert len(top) == k and all(text is None for _, _, text in top)
        vals = [v for v, _, _ in top]
        assert vals == sorted(vals, reverse=True) and len({t for _, t, _ in top}) == k
        assert top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-5)  # greedy: the top one
    start = 2
    meta = (await gen(c, top_logprobs_num=k, logprob_start_len=start))["meta_info"]
    itop = meta["input_top_logprobs"]
    assert len(itop) == len(PROMPT) - start and itop[0] is None
    assert all(len(t) == k for t in itop[1:])
    for t, (lp, tid, _) in zip(itop[1:], meta["input_token_logprobs"][1:], strict=True):
        assert t[0][0] >= lp - 1e-5  # nothing is likelier than the top one
        assert all(v >= lp - 1e-5 for v, x, _ in t if x == tid)


async def test_token_ids_logprob_reports_those_tokens_consistent_with_the_top_list(
    c: httpx.AsyncClient,
) -> None:
    top = (await gen(c, top_logprobs_num=2))["meta_info"]["output_top_logprobs"]
    want = [top[0][1][1], top[0][0][1], 3]  # the first step's runner-up, its top token, and another id
    meta = (await gen(c, token_ids_logprob=want, logprob_start_len=5))["meta_info"]
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == 3 and all([t for _, t, _ in row] == want for row in rows)
    assert rows[0][0][0] == pytest.approx(top[0][1][0], abs=TOL)
    assert rows[0][1][0] == pytest.approx(top[0][0][0], abs=TOL)
    irows = meta["input_token_ids_logprobs"]
    assert len(irows) == len(PROMPT) - 5 and irows[0] is None
    assert all([t for _, t, _ in row] == want for row in irows[1:])
    # a prompt position's entry for the prompt token itself is that token's prompt log-prob
    tok = PROMPT[6]
    meta = (await gen(c, token_ids_logprob=[tok], logprob_start_len=5))["meta_info"]
    assert meta["input_token_ids_logprobs"][1][0][0] == pytest.approx(
        meta["input_token_logprobs"][1][0], abs=TOL
    )
    assert "output_top_logprobs" not in meta  # top_logprobs_num not asked


async def test_return_text_in_logprobs_gives_each_entry_its_token_text(c: httpx.AsyncClient) -> None:
    meta = (await gen(c, top_logprobs_num=2, logprob_start_len=4, return_text_in_logprobs=True))["meta_info"]
    rows = [*meta["input_token_logprobs"], *meta["output_token_logprobs"]]
    rows += [e for t in [*meta["input_top_logprobs"], *meta["output_top_logprobs"]] if t for e in t]
    assert rows and all(isinstance(text, str) for _, _, text in rows)


async def test_no_logprob_fields_without_return_logprob(c: httpx.AsyncClient) -> None:
    meta = (
        await gen(c, return_logprob=False, logprob_start_len=0, top_logprobs_num=2, token_ids_logprob=[3])
    )["meta_info"]
    assert not [k for k in meta if "logprob" in k]


async def test_a_batch_asks_per_prompt(c: httpx.AsyncClient) -> None:
    out = await gen(c, ids=[PROMPT, PROMPT[:3]], n=2, logprob_start_len=[0, 1], top_logprobs_num=[1, 0])
    first, second = (x["meta_info"] for x in out)
    entries_ok(first["input_token_logprobs"], PROMPT, first_none=True)
    assert len(first["input_top_logprobs"]) == len(PROMPT) and len(first["output_top_logprobs"]) == 2
    entries_ok(second["input_token_logprobs"], PROMPT[1:3], first_none=True)
    assert "input_top_logprobs" not in second and "output_top_logprobs" not in second


async def test_the_hf_backend_agrees_with_real_sglang(
    server_url: str, hf_url: str, is_reference: bool
) -> None:
    """Same checkpoint, same requests: the reference server's hf backend and real SGLang give the
    same greedy tokens and the same log-probs (sampled, prompt, top, token ids) within float noise."""
    if is_reference:
        pytest.skip("compares with real SGLang: runs in the SGLang stage")
    extra = {"logprob_start_len": 2, "top_logprobs_num": 3, "token_ids_logprob": [3, 7, 1000]}
    async with (
        httpx.AsyncClient(base_url=server_url, timeout=120.0) as s,
        httpx.AsyncClient(base_url=hf_url, timeout=120.0) as h,
    ):
        for ids in (PROMPT, list(range(40, 100))):
            a, b = await gen(s, ids=ids, n=6, **extra), await gen(h, ids=ids, n=6, **extra)
            assert a["output_ids"] == b["output_ids"]
            ma, mb = a["meta_info"], b["meta_info"]
            for key in ("input_token_logprobs", "output_token_logprobs"):
                assert [t for _, t, _ in ma[key]] == [t for _, t, _ in mb[key]]
                assert [x[0] for x in ma[key]] == pytest.approx([x[0] for x in mb[key]], abs=1e-3)
            for key in (
                "input_top_logprobs",
                "output_top_logprobs",
                "input_token_ids_logprobs",
                "output_token_ids_logprobs",
            ):
                ra, rb = ma[key], mb[key]
                assert len(ra) == len(rb) and (ra[0] is None) == (rb[0] is None)
                for x, y in zip(ra, rb, strict=True):
                    if x is not None:
                        assert x[0][1] == y[0][1]  # the likeliest (or first asked) token
                        assert [e[0] for e in x] == pytest.approx([e[0] for e in y], abs=1e-3)

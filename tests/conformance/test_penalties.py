"""Sampling fields that change the logits, honoured as SGLang 0.5.23 defines them (issue 28
item 2): ``frequency_penalty`` and ``presence_penalty`` subtract per output occurrence / once,
``repetition_penalty`` divides a positive logit of an output token and multiplies a negative one,
``logit_bias`` is added last, ``min_new_tokens`` bars the stop tokens; and ``stop_regex`` ends a
request the way a stop string does. The reported log-probs are those of the changed logits.

Each test runs against the server under test (the reference server's ``sim`` backend, or real
SGLang in the SGLang stage) and, in the main suite, the reference server's ``hf`` backend. Checks
read the effect from log-prob differences, where the normaliser cancels, so they hold for a
model and for the sim alike; in the SGLang stage the hf backend's greedy tokens and log-probs
are compared with real SGLang's for the same requests.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

PROMPT = list(range(40, 60))
TOL = 2e-3
FORCED = 100  # a token logit_bias makes the greedy pick
OTHER = 7  # a token never picked: the yardstick the forced token's log-prob is read against


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


async def gen(c: httpx.AsyncClient, n: int = 6, ids: Any = PROMPT, **sampling: Any) -> Any:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, **sampling},
        "return_logprob": True,
        "token_ids_logprob": [FORCED, OTHER, PROMPT[0]],
    }
    r = await c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def margins(body: Any, token: int = 0) -> list[float]:
    """Per output position: log-prob of FORCED (``token`` 2: of a prompt token) minus that of
    OTHER, i.e. their logit difference."""
    return [row[token][0] - row[1][0] for row in body["meta_info"]["output_token_ids_logprobs"]]


async def test_logit_bias_forces_and_bans_tokens(c: httpx.AsyncClient) -> None:
    plain = await gen(c)
    forced = await gen(c, logit_bias={str(FORCED): 100.0})
    assert forced["output_ids"] == [FORCED] * 6
    lps = [x[0] for x in forced["meta_info"]["output_token_logprobs"]]
    assert all(lp > -1e-3 for lp in lps)  # the biased token holds all the mass, as reported
    banned = await gen(c, logit_bias={str(t): -100.0 for t in plain["output_ids"]})
    assert not set(banned["output_ids"]) & set(plain["output_ids"])


@pytest.mark.parametrize(
    ("penalty", "shift"),
    [
        ({"presence_penalty": 1.5}, lambda k: -1.5 if k else 0.0),
        ({"frequency_penalty": 0.5}, lambda k: -0.5 * k),
        ({"presence_penalty": -1.0, "frequency_penalty": 0.25}, lambda k: (1.0 - 0.25 * k) if k else 0.0),
    ],
    ids=["presence", "frequency", "both"],
)
async def test_additive_penalties_lower_an_output_tokens_logit(
    c: httpx.AsyncClient, penalty: dict[str, float], shift: Any
) -> None:
    """The forced token, output k times so far, has its logit lowered by frequency x k + presence
    (once k > 0): its margin over an unseen token moves by exactly that. Prompt tokens do not count."""
    bias = {str(FORCED): 100.0}
    base = await gen(c, logit_bias=bias)
    hit = await gen(c, logit_bias=bias, **penalty)
    assert hit["output_ids"] == base["output_ids"] == [FORCED] * 6
    moved = [a - b for a, b in zip(margins(hit), margins(base), strict=True)]
    assert moved == pytest.approx([shift(k) for k in range(6)], abs=TOL)
    assert margins(hit, token=2) == pytest.approx(margins(base, token=2), abs=TOL)


async def test_repetition_penalty_lowers_only_output_tokens(c: httpx.AsyncClient) -> None:
    """A positive logit is divided by the penalty, a negative one multiplied: either way an output
    token's logit drops (nothing before the first output; a prompt token is not penalised)."""
    bias = {str(FORCED): 100.0}
    base = await gen(c, logit_bias=bias)
    hit = await gen(c, logit_bias=bias, repetition_penalty=1.5)
    assert hit["output_ids"] == [FORCED] * 6
    moved = [a - b for a, b in zip(margins(hit), margins(base), strict=True)]
    assert moved[0] == pytest.approx(0.0, abs=TOL)
    assert all(m < -TOL for m in moved[1:]), moved
    assert margins(hit, token=2) == pytest.approx(margins(base, token=2), abs=TOL)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_min_new_tokens_bars_the_stop_token(c: httpx.AsyncClient, temperature: float) -> None:
    """EOS made the certain pick: it still comes only after min_new_tokens tokens."""
    eos = (await gen(c, n=1, logit_bias={"2": 100.0}, temperature=temperature))["output_ids"]
    assert eos == [2]
    body = await gen(c, n=8, logit_bias={"2": 100.0}, min_new_tokens=3, temperature=temperature)
    assert len(body["output_ids"]) == 4 and body["output_ids"][-1] == 2 and 2 not in body["output_ids"][:3]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


async def test_stop_regex_ends_the_request_like_a_stop_string(c: httpx.AsyncClient) -> None:
    """A literal pattern is trimmed off the text as a stop string is (SGLang looks the matched
    pattern up as text); a real regex ends the request at the same token, its text untrimmed."""
    plain = await gen(c, n=10)
    text = plain["text"]
    found = re.search(r"[A-Za-z]{3}", text[1:])
    assert found, text
    piece = found.group()
    literal = await gen(c, n=10, stop_regex=piece)
    assert literal["meta_info"]["finish_reason"] == {"type": "stop", "matched": piece}
    ids = literal["output_ids"]
    assert ids == plain["output_ids"][: len(ids)] and len(ids) < 10
    assert literal["text"] == text[: text.find(piece)]
    kept = await gen(c, n=10, stop_regex=piece, no_stop_trim=True)
    assert kept["text"] == text[: text.find(piece) + 3]
    pattern = f"{piece[0]}[{piece[1]}]{piece[2]}"  # the same text, but not found as a literal
    regex = await gen(c, n=10, stop_regex=[r"\d{9}", pattern])
    assert regex["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert regex["output_ids"] == ids and piece in regex["text"] and text.startswith(regex["text"])


# requests whose greedy tokens the penalties change on the tiny checkpoint (seen on SGLang 0.5.23)
COMPARED: list[dict[str, Any]] = [
    {"logit_bias": {"100": 1.0}},
    {"logit_bias": {"100": 1.0}, "presence_penalty": 1.0},
    {"logit_bias": {"100": 1.0}, "frequency_penalty": 0.3},
    {"logit_bias": {"100": 1.0}, "repetition_penalty": 2.0},
    {"logit_bias": {"100": 1.0, "200": 0.9}, "repetition_penalty": 1.3},
    {"logit_bias": {"2": 100.0}, "min_new_tokens": 3},
    {"frequency_penalty": -2.0},
    {"presence_penalty": -2.0, "logit_bias": {"5": -1.0}},
]


async def test_the_hf_backend_penalises_as_real_sglang(
    server_url: str, hf_url: str, is_reference: bool
) -> None:
    """Same checkpoint, same requests: the hf backend and real SGLang give the same greedy tokens
    and log-probs under each penalty (one at a time: SGLang applies several in an order it does
    not fix), and the penalties change the output."""
    if is_reference:
        pytest.skip("compares with real SGLang: runs in the SGLang stage")
    async with (
        httpx.AsyncClient(base_url=server_url, timeout=120.0) as s,
        httpx.AsyncClient(base_url=hf_url, timeout=120.0) as h,
    ):
        outputs = set()
        for sampling in COMPARED:
            a, b = await gen(s, n=8, **sampling), await gen(h, n=8, **sampling)
            assert a["output_ids"] == b["output_ids"], sampling
            la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
            lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
            assert la == pytest.approx(lb, abs=1e-3), sampling
            assert margins(a) == pytest.approx(margins(b), abs=1e-3), sampling
            outputs.add(tuple(a["output_ids"]))
        assert len(outputs) >= 5  # the penalties made a difference

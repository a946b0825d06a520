"""Fuzzing ``/generate``: hypothesis-generated bodies, well-formed and not, against a running
reference server, on the sim backend and on the hf backend (the tiny checkpoint). Every answer
must be 200 or 400, in time; the server must stay healthy and still serve a normal request
afterwards.

The values mix the right types with wrong ones (strings for numbers, floats for ints, booleans,
nulls, NaN, nested lists) in every field SGLang's contract types, plus raw bytes that are not
JSON, strings with lone surrogates (legal JSON, not text), empty and nested ``token_ids_logprob``,
log-prob requests past ``--max-logprob-entries``, logit_bias keys that are no token, grammars and
stop_regex patterns that do not compile. Generation lengths stay small (``max_new_tokens`` up to
8, or huge and refused).

The sim backend gets the most examples: the validation every body meets first is the same code on
both backends, and a sim server answers cheaply; the hf backend gets a third as many, for what
only it does with the bodies that pass (real generation, log-probs, penalties, grammars).
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.conformance.conftest import EXTERNAL_URL, SGLANG_PYTHON

pytestmark = pytest.mark.skipif(
    bool(EXTERNAL_URL or SGLANG_PYTHON), reason="fuzzes the reference server (sim and hf backends)"
)

REQUEST_TIMEOUT_S = 30.0  # a valid example generates at most a few tokens per sequence
EXAMPLES = {"sim": 1200, "hf": 400}  # /generate bodies per backend (plus a third as many raw byte strings)

# numbers that probe edges: sign, zero, float-for-int, past i64, NaN/inf
INTS = st.one_of(st.integers(-3, 8), st.sampled_from([2**31, 2**63, -(2**63) - 1, 10**30]))
FLOATS = st.one_of(
    st.floats(-3, 3, allow_nan=False), st.sampled_from([0.0, 1.0, 1.5, math.nan, math.inf, -math.inf, 1e300])
)
# strings with a lone surrogate (``"\\ud800"`` on the wire), and a pair that is one real character
ODD_TEXT = st.sampled_from(["hi\ud800", "\udc00x", "a\udbff\udfff", "ok \U0001f600"])
TEXT = st.one_of(st.text(max_size=8), ODD_TEXT)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
TOKEN = st.integers(0, 1000)
TOKENS = st.lists(TOKEN, min_size=1, max_size=12)


def field(right: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the right type, sometimes anything."""
    return st.one_of(right, right, right, ANY_JSON)


SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": field(st.one_of(st.integers(0, 8), st.just(10**9))),
    "min_new_tokens": field(st.integers(0, 4)),
    "temperature": field(FLOATS),
    "top_p": field(st.floats(0, 1)),
    "top_k": field(INTS),
    "min_p": field(st.floats(0, 1)),
    "n": field(st.integers(1, 4)),
    "stop": field(st.one_of(TEXT, st.lists(TEXT, max_size=3))),
    "stop_regex": field(
        st.one_of(st.sampled_from(["a", "(", "[z-a]", "a{2,1}", "x*", ""]), st.lists(TEXT, max_size=3))
    ),
    "stop_token_ids": field(st.lists(TOKEN, max_size=3)),
    "ignore_eos": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "no_stop_trim": field(st.booleans()),
    "frequency_penalty": field(FLOATS),
    "presence_penalty": field(FLOATS),
    "repetition_penalty": field(FLOATS),
    "sampling_seed": field(INTS),
    "regex": field(st.text(max_size=4)),
    "json_schema": field(st.sampled_from(["", "{}", "not json"])),
    "ebnf": field(st.sampled_from(["", 'root ::= "a"'])),
    "structural_tag": field(st.sampled_from(["", "{}"])),
    "logit_bias": field(
        st.dictionaries(st.one_of(st.integers(-2, 50_000).map(str), TEXT), FLOATS, max_size=3)
    ),
    "custom_params": field(st.dictionaries(st.text(max_size=4), SCALARS, max_size=2)),
    "bogus": ANY_JSON,  # unknown: always refused
}


@st.composite
def sampling_params(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), unique=True, max_size=6))
    sp = {k: draw(SAMPLING_FIELDS[k]) for k in keys}
    # keep valid examples short: an unbounded max_new_tokens would generate up to the context
    if not isinstance(sp.get("max_new_tokens"), int) or isinstance(sp.get("max_new_tokens"), bool):
        sp["max_new_tokens"] = draw(st.integers(0, 8))
    return sp


@st.composite
def generate_bodies(draw: st.DrawFn) -> Any:
    batch = draw(st.integers(1, 3))
    prompt = st.one_of(
        TOKENS,
        st.lists(TOKENS, min_size=1, max_size=batch),  # a batch
        st.lists(st.one_of(TOKEN, TOKENS), min_size=1, max_size=4),  # ragged
        ANY_JSON,
    )
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        body["input_ids"] = draw(prompt)
    else:
        body["text"] = draw(field(st.one_of(st.text(max_size=20), ODD_TEXT, st.lists(TEXT, max_size=3))))
    sp = draw(st.one_of(st.none(), sampling_params(), st.lists(sampling_params(), max_size=3), ANY_JSON))
    # keep valid examples short (SGLang's default is 128 new tokens, seconds on the hf backend)
    for one in sp if isinstance(sp, list) else [sp]:
        if isinstance(one, dict):
            one.setdefault("max_new_tokens", draw(st.integers(0, 8)))
    body["sampling_params"] = sp if sp is not None else {"max_new_tokens": draw(st.integers(0, 8))}
    extras = {
        "rid": field(st.one_of(st.text(min_size=1, max_size=8), ODD_TEXT, st.lists(TEXT, max_size=3))),
        "return_logprob": field(st.one_of(st.booleans(), st.lists(st.booleans(), max_size=3))),
        "stream": field(st.booleans()),
        "logprob_start_len": field(INTS),
        "top_logprobs_num": field(st.one_of(INTS, st.sampled_from([20, 10**6]))),
        "token_ids_logprob": field(
            st.one_of(
                st.just([]),
                st.just([[]]),
                st.lists(TOKEN, max_size=3),
                st.lists(st.lists(TOKEN, max_size=2), max_size=3),
            )
        ),
        "return_text_in_logprobs": field(st.booleans()),
        "lora_path": field(st.none()),
        "priority": field(INTS),
        "bogus_top_level": ANY_JSON,
    }
    for key in draw(st.lists(st.sampled_from(sorted(extras)), unique=True, max_size=4)):
        body[key] = draw(extras[key])
    return body


def encode(body: Any) -> bytes:
    return json.dumps(
        body
    ).encode()  # NaN and Infinity as Python writes them (SGLang's json.loads reads them)


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    generate_bodies().map(lambda b: encode(b)[: len(encode(b)) // 2]),  # cut off mid-way
)


@pytest.fixture(scope="module")
def sim(server_url: str) -> Any:
    """The reference server under test on its sim backend."""
    with httpx.Client(base_url=server_url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def hf(hf_url: str) -> Any:
    """The reference server on its hf backend (the tiny checkpoint)."""
    with httpx.Client(base_url=hf_url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


def post(http: httpx.Client, content: bytes) -> httpx.Response:
    r = http.post("/generate", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code in (200, 400), f"{r.status_code} {r.text[:500]} for {content[:500]!r}"
    if r.status_code == 400:
        assert "error" in r.json()
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many were served
    return r


BODIES = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RAW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(BODIES, max_examples=EXAMPLES["sim"])
@given(body=generate_bodies())
def test_fuzzed_generate_bodies_get_200_or_400_on_sim(sim: httpx.Client, body: Any) -> None:
    post(sim, encode(body))


@settings(RAW, max_examples=EXAMPLES["sim"] // 3)
@given(raw=RAW_BODIES)
def test_fuzzed_raw_bytes_get_400_on_sim(sim: httpx.Client, raw: bytes) -> None:
    post(sim, raw)


@settings(BODIES, max_examples=EXAMPLES["hf"])
@given(body=generate_bodies())
def test_fuzzed_generate_bodies_get_200_or_400_on_hf(hf: httpx.Client, body: Any) -> None:
    post(hf, encode(body))


@settings(RAW, max_examples=EXAMPLES["hf"] // 3)
@given(raw=RAW_BODIES)
def test_fuzzed_raw_bytes_get_400_on_hf(hf: httpx.Client, raw: bytes) -> None:
    post(hf, raw)


@pytest.mark.parametrize("backend", ["sim", "hf"])
def test_server_is_healthy_after_fuzzing(backend: str, request: pytest.FixtureRequest) -> None:
    """Runs after the fuzz tests above (pytest keeps file order)."""
    http: httpx.Client = request.getfixturevalue(backend)
    assert http.get("/health").status_code == 200
    r = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) <= 3

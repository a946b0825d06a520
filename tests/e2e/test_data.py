"""GSM8K data sources: offline generation, local files and hub fallback."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from nodes.driver.data import (
    PROMPT_SUFFIX,
    SYSTEM_PROMPT,
    DataConfig,
    DataUnavailableError,
    extract_final_answer,
    format_prompt,
    load_data,
    load_gsm8k,
)

ROWS = [
    {"question": "Natalia sold clips to 48 friends in April and half as many in May. How many in all?",
     "answer": "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"},
    {"question": "A shop sold 1,000 pens on Monday and 234 on Tuesday. How many pens?",
     "answer": "1000 + 234 = 1234\n#### 1,234"},
    {"question": "Weng earns $12 an hour. How much for 50 minutes?", "answer": "12/60*50 = 10\n#### $10"},
]  # fmt: skip


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _load(tmp_path: Path, rows: list[dict], **kw: object):
    """``rows`` as train.jsonl and test.jsonl (the same rows: prompts differ by a prefix) in a folder."""
    _write_jsonl(tmp_path / "train.jsonl", rows)
    _write_jsonl(tmp_path / "test.jsonl", [{**r, "question": "held out: " + r["question"]} for r in rows])
    return load_data(DataConfig(source="local", path=str(tmp_path), **kw))


# -- answers and prompts -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "want"),
    [("so 72\n#### 72", "72"), ("#### 1,234", "1234"), ("x #### 5 #### -3", "-3"), ("#### $10", "10"),
     ("  42 ", "42"), ("#### 1,000,000.", "1000000")],
)  # fmt: skip
def test_extract_final_answer(raw: str, want: str) -> None:
    assert extract_final_answer(raw) == want


def test_format_prompt_asks_for_boxed_answer() -> None:
    msgs = format_prompt("What is 2 + 2?")
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "step by step" in msgs[0]["content"]
    assert msgs[1]["content"] == "What is 2 + 2?" + PROMPT_SUFFIX
    assert msgs[1]["content"].endswith("Please put your final answer within \\boxed{}.")
    assert [m["role"] for m in format_prompt("q", system=None)] == ["user"]


def test_items_fit_the_rollout_workflow_and_reward(tmp_path: Path) -> None:
    """The recipe's RLVR workflow builds the same prompt, and the GSM8K reward accepts our answers."""
    from nodes.rollout.reward import gsm8k_reward
    from nodes.rollout.workflows import ByteChatTokenizer, RLVRConfig, RLVRWorkflow

    data = _load(tmp_path, ROWS, answer_format="gsm8k")
    items = data.train
    wf = RLVRWorkflow(
        ByteChatTokenizer(),
        gsm8k_reward,
        RLVRConfig(prompt_suffix=PROMPT_SUFFIX, system_prompt=SYSTEM_PROMPT),
    )
    assert wf.prompt_messages(items[1]) == format_prompt(items[1]["question"])
    assert gsm8k_reward("1000 + 234 = 1234, so \\boxed{1,234}", items[1]) == 1.0
    assert gsm8k_reward("\\boxed{1233}", items[1]) == 0.0


# -- offline -------------------------------------------------------------------------------


def test_offline_generation_is_deterministic_and_splits_are_disjoint() -> None:
    pytest.importorskip("reasoning_gym")
    train, desc = load_gsm8k("train", source="offline", limit=50, seed=3)
    again, _ = load_gsm8k("train", source="offline", limit=50, seed=3)
    other, _ = load_gsm8k("train", source="offline", limit=50, seed=4)
    assert train == again
    assert train != other
    assert len(train) == 50 and len({t["id"] for t in train}) == 50
    assert all(t["question"] and t["answer"].lstrip("-").replace(".", "").isdigit() for t in train)
    assert "reasoning-gym gsm_symbolic" in desc and "50 problems" in desc
    full_train, _ = load_gsm8k("train", source="offline", seed=3)
    test, _ = load_gsm8k("test", source="offline", seed=3)
    assert full_train[:50] == train
    assert len(test) > 1000
    assert not {t["question"] for t in test} & {t["question"] for t in full_train}


# -- hub -----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_hub_that_never_answers_fails_fast(hanging_endpoint: str) -> None:
    with pytest.raises(DataUnavailableError, match="unreachable"):
        load_gsm8k("train", source="hub", hub_timeout_s=1.0)


@pytest.mark.timeout(30)
def test_auto_falls_back_to_offline_and_says_so(hanging_endpoint: str) -> None:
    pytest.importorskip("reasoning_gym")
    items, desc = load_gsm8k("train", limit=8, seed=1, hub_timeout_s=1.0)
    assert items == load_gsm8k("train", source="offline", limit=8, seed=1)[0]
    assert "generated offline by reasoning-gym gsm_symbolic" in desc
    assert "unreachable" in desc and hanging_endpoint in desc


@pytest.mark.timeout(30)
def test_auto_falls_back_when_connection_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("reasoning_gym")
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _, desc = load_gsm8k("test", limit=4, hub_timeout_s=2.0)
    assert "offline" in desc and "unreachable" in desc


def test_easy_source_is_deterministic_disjoint_and_answers_are_right() -> None:
    import re

    from nodes.driver.data import load_gsm8k

    train, desc = load_gsm8k("train", source="easy", seed=0)
    test, _ = load_gsm8k("test", source="easy", limit=64, seed=0)
    assert "single-digit" in desc and "offline" in desc and (len(train), len(test)) == (53, 64)
    assert load_gsm8k("train", source="easy", limit=10, seed=0)[0] == train[:10]
    assert load_gsm8k("test", source="easy", seed=1)[0] != test  # another order, another split
    assert not {t["question"] for t in train} & {t["question"] for t in test}  # held out for real
    for it in train + test:  # the answer follows from the question
        a, op, b = re.fullmatch(r"What is (\d) ([+-]) (\d)\?", it["question"]).groups()
        assert int(it["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 1

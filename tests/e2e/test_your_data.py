"""Your data in: files of every supported kind with your own field names, extra columns that reach the
reward, chat-format prompts, a held-out set that never overlaps training, and one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nodes.driver.data import DataConfig, DataError, load_data
from tests.e2e.test_recipe import SMALL, recipe, rows

ROWS = [
    {
        "q": f"How many apples are {i} and one more?",
        "a": f"{i} + 1 = {i + 1}\n#### {i + 1}",
        "unit": "apples",
        "weight": 0.25,
    }
    for i in range(12)
]
HELD = [
    {"q": f"How many pears are {i} and two more?", "a": f"#### {i + 2}", "unit": "pears", "weight": 0.5}
    for i in range(6)
]
FIELDS = {"prompt_field": "q", "answer_field": "a"}


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def csv(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    path.parent.mkdir(parents=True, exist_ok=True)
    pcsv.write_csv(pa.Table.from_pylist(rows), path)
    return path


def load(path: Path | str, **kw: object):
    return load_data(DataConfig(source="local", path=str(path), **{**FIELDS, **kw}))


# -- formats and fields --------------------------------------------------------------------


def test_jsonl_with_your_field_names_keeps_every_column(tmp_path: Path) -> None:
    data = load(jsonl(tmp_path / "train.jsonl", ROWS), eval_path=str(jsonl(tmp_path / "held.jsonl", HELD)))
    first = data.train[0]
    assert first["question"] == ROWS[0]["q"] and first["q"] == ROWS[0]["q"]
    assert first["answer"] == ROWS[0]["a"]  # as written: no cleaning unless asked
    assert (first["unit"], first["weight"], first["id"]) == ("apples", 0.25, "data-train-0")
    assert [it["unit"] for it in data.eval] == ["pears"] * 6
    assert "12 rows of" in data.train_about and "prompt 'q', answer 'a'" in data.train_about
    assert "held.jsonl" in data.eval_about
    cleaned = load(tmp_path / "train.jsonl", eval_path=str(tmp_path / "held.jsonl"), answer_format="gsm8k")
    assert [it["answer"] for it in cleaned.train[:3]] == ["1", "2", "3"]


def test_parquet_folder_csv_and_saved_dataset_read_the_same_rows(tmp_path: Path) -> None:
    want = load(
        jsonl(tmp_path / "j" / "train.jsonl", ROWS), eval_path=str(jsonl(tmp_path / "j" / "t.jsonl", HELD))
    )
    parquet(tmp_path / "pq" / "train-00000-of-00001.parquet", ROWS)  # the hub's layout: split by name
    parquet(tmp_path / "pq" / "test-00000-of-00001.parquet", HELD)
    from_parquet = load(tmp_path / "pq")
    csv(tmp_path / "c" / "train.csv", ROWS)
    csv(tmp_path / "c" / "test.csv", HELD)
    from_csv = load(tmp_path / "c" / "{split}.csv")
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(HELD)}
    ).save_to_disk(str(saved))
    from_disk = load(saved)
    for got in (from_parquet, from_csv, from_disk):
        assert [(it["question"], it["answer"], it["unit"]) for it in got.train] == [
            (it["question"], it["answer"], it["unit"]) for it in want.train
        ]
        assert [it["question"] for it in got.eval] == [it["question"] for it in want.eval]
    assert "test-00000-of-00001.parquet" in from_parquet.eval_about
    assert "(test split)" in from_disk.eval_about


def test_messages_field_is_sent_as_written(tmp_path: Path) -> None:
    from nodes.rollout.reward import gsm8k_reward
    from nodes.rollout.workflows import ByteChatTokenizer, RLVRConfig, RLVRWorkflow

    chats = [
        {
            "chat": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1?"}],
            "gold": str(i + 1),
        }
        for i in range(4)
    ]
    bare = [{"chat": [{"role": "user", "content": f"{i}+2?"}], "gold": str(i + 2)} for i in range(3)]
    data = load_data(
        DataConfig(
            source="local",
            path=str(jsonl(tmp_path / "train.jsonl", chats)),
            eval_path=str(jsonl(tmp_path / "test.jsonl", bare)),
            messages_field="chat",
            answer_field="gold",
        )
    )
    it = data.train[1]
    assert it["messages"] == chats[1]["chat"] and it["question"] == "1+1?" and it["answer"] == "2"
    wf = RLVRWorkflow(
        ByteChatTokenizer(), gsm8k_reward, RLVRConfig(system_prompt="Tutor.", prompt_suffix="!")
    )
    assert wf.prompt_messages(it) == chats[1]["chat"]  # its own system message, no suffix
    assert wf.prompt_messages(data.eval[0]) == [{"role": "system", "content": "Tutor."}, *bare[0]["chat"]]
    assert "messages 'chat'" in data.train_about


# -- the held-out set ------------------------------------------------------------------------


def test_evaluation_never_reads_training_rows(tmp_path: Path) -> None:
    f = jsonl(tmp_path / "one.jsonl", ROWS)
    with pytest.raises(DataError, match=r"no held-out data.*eval_path.*eval_from_train") as e:
        load(f)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="would read the rows the run trains on"):
        load(f, eval_path=str(f))
    data = load(f, eval_from_train=4, seed=1)
    assert len(data.eval) == 4 and len(data.train) == 8
    assert not {it["id"] for it in data.eval} & {it["id"] for it in data.train}
    assert {it["id"] for it in data.eval} | {it["id"] for it in data.train} == {
        f"data-train-{i}" for i in range(12)
    }
    assert "held out" in data.eval_about and "not trained on" in data.eval_about
    assert load(f, eval_from_train=4, seed=1).eval == data.eval  # the same rows from the same seed
    with pytest.raises(DataError, match="use one of them"):
        load(f, eval_from_train=4, eval_path=str(jsonl(tmp_path / "held.jsonl", HELD)))
    with pytest.raises(DataError, match="nothing to train on"):
        load(f, eval_from_train=12)
    # a held-out row whose prompt is also trained on is left out, and the line says so
    dup = jsonl(tmp_path / "dup.jsonl", [ROWS[0], *HELD])
    data = load(f, eval_path=str(dup))
    assert len(data.eval) == 6 and ROWS[0]["q"] not in {it["question"] for it in data.eval}
    assert "1 whose prompt is also a training prompt left out" in data.eval_about


# -- bad input: one line each --------------------------------------------------------------


def test_each_bad_input_is_one_line_naming_what_to_fix(tmp_path: Path) -> None:
    held = str(jsonl(tmp_path / "held.jsonl", HELD))
    cases = {
        "missing field": (jsonl(tmp_path / "m.jsonl", [{"question": "x", "a": "1", "n": 2}]),
                          r"m\.jsonl: row 1 has no field 'q' \(data.prompt_field\); its fields: 'question', 'a', 'n'"),
        "empty": (jsonl(tmp_path / "e.jsonl", []), r"e\.jsonl holds no rows"),
        "bad row": (tmp_path / "b.jsonl", r"b\.jsonl:3: unreadable row"),
        "mixed types": (tmp_path / "t.jsonl", r"t\.jsonl:2: unreadable row.*another type"),
        "no file": (tmp_path / "nope" / "x.jsonl", r"data.path=.*x\.jsonl: no such file or folder"),
        "suffix": (tmp_path / "x.txt", r"x\.txt: cannot read a \.txt file"),
        "csv row": (tmp_path / "r.csv", r"r\.csv:3: unreadable row: CSV parse error: Expected 2 columns, got 3"),
        "empty answer": (jsonl(tmp_path / "n.jsonl", [{"q": "x", "a": None}]), r"row 1 has an empty field 'a'"),
    }  # fmt: skip
    (tmp_path / "b.jsonl").write_text('{"q": "a", "a": "1"}\n\n{"q": "b", "a": "2"\n')
    (tmp_path / "t.jsonl").write_text('{"q": "a", "a": "1"}\n{"q": "b", "a": 2}\n')
    (tmp_path / "x.txt").write_text("q,a\n")
    (tmp_path / "r.csv").write_text("q,a\nx,1\ny,2,3\n")
    for name, (path, message) in cases.items():
        with pytest.raises(DataError) as e:
            load(path, eval_path=held)
        assert re.search(message, str(e.value)), (name, str(e.value))
        assert "\n" not in str(e.value), name


# -- through the recipe --------------------------------------------------------------------


@pytest.mark.slow
def test_the_recipe_trains_on_your_jsonl_and_evaluates_on_your_parquet(tmp_path: Path) -> None:
    """The reward (tests/e2e/custom_data.py) reads the answer and an extra column of each row: it
    scores ``weight`` when they arrived, so the metrics show the training rows' 0.25 and the
    held-out rows' 0.5."""
    out = tmp_path / "run"
    res = recipe(
        [
            *SMALL,
            "servers.n=1",
            "trainer.n_ranks=1",
            "run.steps=1",
            "run.eval_every=0",
            f"run.out_dir={out}",
            "data.source=local",
            f"data.path={jsonl(tmp_path / 'mine.jsonl', ROWS)}",
            f"data.eval_path={parquet(tmp_path / 'held.parquet', HELD)}",
            "data.prompt_field=q",
            "data.answer_field=a",
            "data.answer_format=gsm8k",
            "reward.fn=tests.e2e.custom_data:weight_if_fields_arrived",
        ]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        "data: 12 rows of" in res.stdout and "eval: 4 of 6 rows of" in res.stdout
    )  # SMALL: data.eval_size=4
    m = rows(out)
    assert m[0]["reward/mean"] == pytest.approx(0.25)
    assert m[0]["eval/accuracy"] == pytest.approx(0.5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "message"),
    [("missing field", "row 1 has no field 'q'"), ("overlap", "would read the rows the run trains on"),
     ("bad row", "bad.jsonl:2: unreadable row")],
)  # fmt: skip
def test_bad_data_stops_the_recipe_with_one_line_and_exit_2(tmp_path: Path, case: str, message: str) -> None:
    good = jsonl(tmp_path / "good.jsonl", ROWS)
    (tmp_path / "bad.jsonl").write_text('{"q": "a", "a": "1"}\n{"q": \n')
    path, extra = {
        "missing field": (jsonl(tmp_path / "other.jsonl", [{"question": "x", "answer": "1"}]), str(good)),
        "overlap": (good, str(good)),
        "bad row": (tmp_path / "bad.jsonl", str(good)),
    }[case]
    out = tmp_path / "run"
    res = recipe(
        [
            *SMALL,
            f"run.out_dir={out}",
            "data.source=local",
            f"data.path={path}",
            f"data.eval_path={extra}",
            "data.prompt_field=q",
            "data.answer_field=a",
        ],
        timeout=120,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr
    assert not out.exists()  # found before anything was written


@pytest.mark.timeout(30)
def test_a_hub_id_that_cannot_be_reached_is_one_line(hanging_endpoint: str) -> None:
    """``data.path`` that is no file here is read as a hub dataset id; a hub that never answers fails
    within the probe's timeout, naming the id and the endpoint."""
    with pytest.raises(DataError) as e:
        load("someone/their-data", eval_from_train=2, hub_timeout_s=1.0)
    assert "data.path=someone/their-data" in str(e.value) and hanging_endpoint in str(e.value)
    assert "\n" not in str(e.value)

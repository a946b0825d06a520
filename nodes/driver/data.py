"""The data a run trains on and evaluates: your files, a hub dataset, or a built-in source.

:func:`load_data` reads ``[data]`` (:class:`DataConfig`) and returns :class:`Data`: the training
items, the held-out items, and a line for each saying where they came from (the recipe prints them).
An item is a dict: every column of its row, plus

- ``id``: ``<source>-<split>-<row>``;
- ``question``: the prompt text (``prompt_field``; with ``messages_field``, the last user message);
- ``messages``: with ``messages_field``, the chat-format prompt as written (a list of
  ``{"role", "content"}``), which the workflows send as is;
- ``answer``: ``answer_field``'s value, as written unless ``answer_format = "gsm8k"`` (the number
  after ``####``, commas and ``$`` removed).

So a reward function, an agent or an environment reads any other column of the row from ``item``.

Your data (``source = "local"``, or ``"auto"`` with a path): ``path`` is a ``.jsonl``/``.json``/
``.parquet``/``.csv`` file (read with pyarrow), a folder of such files named by split
(``train*``/``test*``), a ``datasets`` ``save_to_disk`` folder, or a hub dataset id when the hub is
reachable (read with ``datasets``); ``{split}`` in the path is replaced by the split's name. The
held-out items come from ``eval_path``, else from ``path``'s ``eval_split``; data with no separate
held-out rows is an error unless ``eval_from_train = N`` holds N of its rows out of training. The
evaluation never reads a row the run trains on: held-out rows whose prompt is also a training
prompt are left out, and the line says how many.

Built-in sources: ``"easy"`` (single-digit sums and differences: 117 problems, 64 held out, for
models too small for GSM8K, such as the CPU default), ``"products"`` (three-digit by two-digit
products, for agents with a calculator tool), ``"hub"`` (GSM8K from the Hugging Face hub, probed
first with a short timeout so a machine without network fails in seconds), ``"offline"``
(reasoning-gym's GSM8K-style generator: one pool from the seed split by index, so the splits are
disjoint), ``"auto"`` (``path`` when given, else the hub, else offline, saying so).

Every problem with the data is a :class:`DataError` whose message is one line naming the file,
the row and the field: the recipe prints it and exits 2 before anything starts.

nodes/rollout/prompts.py serves the items to the rollout actors (epochs, shuffling, shards).
"""

from __future__ import annotations

import datetime
import decimal
import json
import os
import random
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog

from rlactors.base.tomlconf import above, at_least, check_ranges

__all__ = [
    "PROMPT_SUFFIX",
    "SYSTEM_PROMPT",
    "Data",
    "DataConfig",
    "DataError",
    "DataUnavailableError",
    "extract_final_answer",
    "format_prompt",
    "load_data",
    "load_eval_items",
    "load_gsm8k",
]

log = structlog.get_logger(__name__)

SYSTEM_PROMPT = "You are a careful math tutor. Reason step by step, then state the final answer."
PROMPT_SUFFIX = "\nPlease put your final answer within \\boxed{}."  # AReaL's GSM8K suffix
HUB_DATASET = ("openai/gsm8k", "main")
SPLIT_SIZES = {"train": 7473, "test": 1319}  # GSM8K's own sizes; the offline pool mirrors them
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
BUILT_IN = ("easy", "products", "hub", "offline")


class DataError(ValueError):
    """The data cannot be used as configured: a missing file or field, an empty file, a bad row, a
    held-out set that would overlap training. The message is one line that says what to change."""


class DataUnavailableError(DataError):
    """A data source cannot be reached here (no network, a missing package)."""


@dataclass
class DataConfig:
    """``[data]``: what the run trains on and what it evaluates (see the module docstring)."""

    # "local": your data at data.path; built in: "easy" (single-digit sums a 135M model learns on
    # CPU), "products" (for agents with a Python tool), "hub" (GSM8K from the hub), "offline"
    # (GSM8K-style problems from reasoning-gym), "auto" (data.path if set, else hub, else offline),
    # "env": the dataset of the environment the workflow runs (nodes/rollout/environments); "online":
    # episodes from external clients' sessions (nodes.rollout.sessions:OnlineWorkflow)
    source: Literal["auto", "hub", "local", "offline", "easy", "products", "env", "online"] = "easy"
    # your data: a .jsonl/.json/.parquet/.csv file, a folder of train*/test* files, a datasets
    # save_to_disk folder or a hub dataset id; "{split}" in it is replaced by the split's name
    path: str = ""
    split: str = "train"  # the split trained on, where data.path holds several
    prompt_field: str = "question"  # the column holding the prompt text
    # or the column holding a chat-format prompt (a list of {role, content}), sent as written
    messages_field: str = ""
    answer_field: str = "answer"  # the column holding the reference answer; "" = none (the reward needs none)
    # "raw": the answer as written; "gsm8k": the number after "####", commas and $ removed
    answer_format: Literal["raw", "gsm8k"] = "raw"
    eval_path: str = ""  # held-out data of its own (same forms as data.path); "" = data.path's eval_split
    eval_split: str = "test"  # the split evaluated on, where data.path or data.eval_path holds several
    # N > 0: hold N rows of the training data out for evaluation (never trained on), for data without
    # a held-out split; the run's first lines say so
    eval_from_train: int = field(default=0, metadata=at_least(0))
    train_limit: int = field(default=0, metadata=at_least(0))  # train on the first N items; 0 = all
    # held-out items evaluated (the first N), at version 0, every run.eval_every steps and at the end
    eval_size: int = field(default=64, metadata=at_least(1))
    seed: int = field(default=0, metadata=at_least(0))  # the built-in generators' and eval_from_train's seed
    hub_timeout_s: float = field(
        default=5.0, metadata=above(0)
    )  # how long the hub may take to answer a probe

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass
class Data:
    """What :func:`load_data` read: the items and where each set came from (one line each)."""

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    train_about: str
    eval_about: str


def extract_final_answer(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last ``####``, without commas or ``$``.

    ``"... #### 1,234"`` -> ``"1234"``; an answer without ``####`` is cleaned the same way.
    """
    text = answer.rsplit("####", 1)[-1]
    return text.strip().replace(",", "").replace("$", "").strip().rstrip(".")


def format_prompt(question: str, system: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages asking for step-by-step reasoning and the answer in ``\\boxed{}``."""
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": question + PROMPT_SUFFIX}]


def _check_split(split: str) -> None:
    if split not in SPLIT_SIZES:
        raise DataError(f"unknown GSM8K split {split!r}; use 'train' or 'test'")


def _item(prefix: str, split: str, i: int, question: Any, answer: Any) -> dict[str, str]:
    return {
        "id": f"{prefix}-{split}-{i}",
        "question": str(question),
        "answer": extract_final_answer(str(answer)),
    }


def _limited(items: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    return items if limit is None else items[: max(0, limit)]


# -- hub ---------------------------------------------------------------------------------


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _probe_hub(timeout_s: float, dataset: str = HUB_DATASET[0]) -> str | None:
    """None if the hub answers within ``timeout_s``, else why not.

    Runs in a daemon thread joined with a timeout: name resolution ignores socket timeouts
    and can stall far longer than the caller wants to wait.
    """
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/api/datasets/{dataset}"
    result: list[str | None] = []

    def probe() -> None:
        try:
            import httpx  # one HEAD to check a dataset URL, before a run starts

            r = httpx.head(url, timeout=timeout_s, follow_redirects=True)
            result.append(None if r.status_code < 500 else f"{url} answered HTTP {r.status_code}")
        except Exception as e:  # any failure means "not reachable"; the reason is reported
            result.append(f"{url}: {type(e).__name__}: {e}")

    t = threading.Thread(target=probe, name="hub-probe", daemon=True)
    t.start()
    t.join(timeout_s + 0.5)
    return result[0] if result else f"{url}: no answer within {timeout_s:g} s"


def _hub_dataset(name: str, config: str | None, split: str, timeout_s: float) -> Any:
    """``datasets.load_dataset(name, config, split=split)``, the hub probed first (unless offline)."""
    offline = _env_flag("HF_HUB_OFFLINE") or _env_flag("HF_DATASETS_OFFLINE")
    if not offline:
        reason = _probe_hub(timeout_s, name)
        if reason is not None:
            raise DataUnavailableError(f"the Hugging Face hub is unreachable ({reason})")
    datasets = _datasets()
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types (HTTP, file, parsing): each one means unavailable
        where = "the local datasets cache (offline mode)" if offline else "the hub"
        raise DataUnavailableError(
            f"could not load {name} ({split} split) from {where}: {_first_line(e)}"
        ) from e


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise DataUnavailableError(
            "reading this data needs the 'datasets' package (pip install datasets)"
        ) from e
    return datasets


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _load_hub(split: str, timeout_s: float) -> tuple[list[dict[str, str]], str]:
    ds = _hub_dataset(*HUB_DATASET, split, timeout_s)
    items = [_item("gsm8k", split, i, row["question"], row["answer"]) for i, row in enumerate(ds)]
    return items, f"GSM8K ({HUB_DATASET[0]}, {split} split) from the Hugging Face hub"


# -- your data ------------------------------------------------------------------------------


@dataclass
class _Rows:
    """Rows read from one place, how to name that place, and its identity (to tell two apart)."""

    rows: list[dict[str, Any]]
    where: str
    key: tuple[Any, ...]


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _line_of_row(file: Path, row: int) -> int:
    """The line number (from 1) of pyarrow's JSON row ``row`` (from 0; blank lines are not rows)."""
    seen = -1
    with file.open(errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                seen += 1
                if seen == row:
                    return n
    return 0


def _read_file(file: Path) -> list[dict[str, Any]]:
    """The rows of one data file, read with pyarrow (a ``.json`` array with the json module)."""
    suffix = file.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise DataError(
            f"{file}: cannot read a {suffix or 'suffix-less'} file; use {', '.join(FILE_SUFFIXES)}"
        )
    try:
        import pyarrow as pa
        import pyarrow.csv as pcsv
        import pyarrow.json as pjson
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataUnavailableError(f"reading {file} needs pyarrow (pip install pyarrow)") from e
    try:
        if suffix == ".json" and file.read_text(errors="replace").lstrip().startswith("["):
            rows = json.loads(file.read_text())
            if not all(isinstance(r, dict) for r in rows):
                raise DataError(f"{file}: not a JSON array of objects")
            return rows
        if file.stat().st_size == 0:
            return []
        if suffix == ".parquet":
            table = pq.read_table(file)
        elif suffix == ".csv":
            table = pcsv.read_csv(file)
        else:
            table = pjson.read_json(file)
    except json.JSONDecodeError as e:
        raise DataError(f"{file}:{e.lineno}: not valid JSON ({e.msg})") from None
    except pa.ArrowInvalid as e:
        msg = _first_line(e)
        if (m := re.search(r"in row (\d+)$", msg)) and suffix != ".parquet":
            line = _line_of_row(file, int(m.group(1)))
            msg = msg[: m.start()].rstrip()
            if "changed from" in msg:  # pyarrow reads each column as one type
                msg += ": a field holds values of another type than in the rows before it; make them agree"
            raise DataError(f"{file}:{line}: unreadable row: {msg}") from None
        if suffix == ".csv" and (m := re.search(r"Expected \d+ columns, got \d+: (.*)$", msg)):
            lines = file.read_text(errors="replace").splitlines()
            line = next((n for n, text in enumerate(lines, 1) if text == m.group(1)), 0)
            raise DataError(f"{file}:{line}: unreadable row: {msg}") from None
        raise DataError(f"{file}: unreadable: {msg}") from None
    except OSError as e:
        raise DataError(f"{file}: cannot read it: {e.strerror or e}") from None
    return table.to_pylist()


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _split_files(folder: Path, split: str) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix.lower() in FILE_SUFFIXES and p.name.startswith(split)
    )


def _read(path: str, split: str, whole: bool, key: str, timeout_s: float) -> _Rows | None:
    """The rows of ``split`` at ``path`` (the config's ``key`` names it in errors). A single file (or
    an unsplit saved dataset) is one split: it is read when ``whole``, else there is no such split
    there (None). A split that a split-aware source lacks is None too."""
    where = path.replace("{split}", split)
    p = Path(where).expanduser()
    if p.is_file():
        if not whole and "{split}" not in path:
            return None
        return _Rows(_read_file(p), str(p), ("file", str(p.resolve())))
    if p.is_dir() and _is_saved_dataset(p):
        try:
            ds = _datasets().load_from_disk(str(p))
        except Exception as e:  # datasets raises many types on a bad folder: each one is a DataError
            raise DataError(f"{key}={path}: cannot load the saved dataset: {_first_line(e)}") from None
        if hasattr(ds, "keys"):  # a DatasetDict
            if split not in ds:
                return None
            return _Rows(ds[split].to_list(), f"{p} ({split} split)", ("disk", str(p.resolve()), split))
        return _Rows(ds.to_list(), str(p), ("disk", str(p.resolve()))) if whole else None
    if p.is_dir():
        files = _split_files(p, split)
        if not files:
            return None
        rows = [r for f in files for r in _read_file(f)]
        return _Rows(rows, ", ".join(str(f) for f in files), ("files", *(str(f.resolve()) for f in files)))
    if "{split}" in path or p.is_absolute() or path.startswith((".", "~")) or not _HUB_ID.fullmatch(path):
        if not whole:
            return None
        raise DataError(f"{key}={path}: no such file or folder")
    try:
        ds = _hub_dataset(path, None, split, timeout_s)
    except DataUnavailableError as e:
        if "Unknown split" in str(e) and not whole:
            return None
        raise DataUnavailableError(
            f"{key}={path} is not a file or folder here, and as a hub dataset: {e}"
        ) from None
    return _Rows(ds.to_list(), f"{path} ({split} split) from the Hugging Face hub", ("hub", path, split))


def _plain(value: Any) -> Any:
    """``value`` with what msgpack cannot carry (dates, decimals) as text: items travel to actors."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, datetime.date | datetime.time | datetime.timedelta | decimal.Decimal):
        return str(value)
    return value


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise DataError(f"{where}: not a chat prompt (a non-empty list of {{role, content}} strings)")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _items(rows: _Rows, cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    """Rows as items (the module docstring says what an item holds)."""
    if not rows.rows:
        raise DataError(f"{rows.where} holds no rows")
    prompt = cfg.messages_field or cfg.prompt_field
    prompt_key = "data.messages_field" if cfg.messages_field else "data.prompt_field"
    needed = [(prompt, prompt_key)] + ([(cfg.answer_field, "data.answer_field")] if cfg.answer_field else [])
    replaced: set[str] = set()
    items = []
    for n, row in enumerate(rows.rows, 1):
        for name, key in needed:
            if row.get(name) is None:
                has = ", ".join(repr(k) for k, v in row.items() if v is not None) or "none"
                missing = "has no" if name not in row else "has an empty"
                raise DataError(f"{rows.where}: row {n} {missing} field {name!r} ({key}); its fields: {has}")
        item = _plain(row)
        if cfg.messages_field:
            msgs = _messages(row[cfg.messages_field], f"{rows.where}: row {n}: field {cfg.messages_field!r}")
            users = [m["content"] for m in msgs if m["role"] == "user"]
            item["messages"], question = msgs, users[-1] if users else msgs[-1]["content"]
        else:
            question = str(row[cfg.prompt_field])
        answer = row[cfg.answer_field] if cfg.answer_field else None
        if answer is not None:
            answer = extract_final_answer(str(answer)) if cfg.answer_format == "gsm8k" else _plain(answer)
        for k, own in (("question", prompt), ("answer", cfg.answer_field), ("messages", cfg.messages_field)):
            if k in row and k != own:
                replaced.add(k)
        item.update(id=f"data-{split}-{n - 1}", question=question, answer=answer)
        items.append(item)
    if replaced:  # the file's own column of that name is shadowed by the field the config chose
        log.warning("data.column_replaced", where=rows.where, columns=sorted(replaced))
    return items


def _fields_text(cfg: DataConfig) -> str:
    prompt = f"messages {cfg.messages_field!r}" if cfg.messages_field else f"prompt {cfg.prompt_field!r}"
    answer = f", answer {cfg.answer_field!r}" if cfg.answer_field else ", no answer field"
    return prompt + answer + (" (GSM8K format)" if cfg.answer_format == "gsm8k" else "")


def _load_yours(cfg: DataConfig) -> Data:
    if not cfg.path:
        raise DataError(
            "data.source = 'local' needs data.path: a file, a folder, a saved dataset or a hub id"
        )
    train = _read(cfg.path, cfg.split, True, "data.path", cfg.hub_timeout_s)
    if train is None:
        raise DataError(
            f"data.path={cfg.path}: no {cfg.split!r} split there (data.split); a folder needs "
            f"{cfg.split}*.jsonl/.json/.parquet/.csv files"
        )
    if cfg.eval_path:
        held = _read(cfg.eval_path, cfg.eval_split, True, "data.eval_path", cfg.hub_timeout_s)
        if held is None:
            raise DataError(
                f"data.eval_path={cfg.eval_path}: no {cfg.eval_split!r} split there (data.eval_split)"
            )
    else:
        held = _read(cfg.path, cfg.eval_split, False, "data.path", cfg.hub_timeout_s)
    if held is not None and held.key == train.key:
        raise DataError(
            f"the evaluation would read the rows the run trains on ({train.where}): set data.eval_path "
            "to held-out data, or data.eval_from_train = N to hold N training rows out"
        )
    train_items = _items(train, cfg, cfg.split)
    if cfg.eval_from_train:
        if held is not None:
            raise DataError(
                f"data.eval_from_train = {cfg.eval_from_train}, but there is held-out data ({held.where}): "
                "use one of them (data.eval_from_train = 0, or no eval split/eval_path)"
            )
        if cfg.eval_from_train >= len(train_items):
            raise DataError(
                f"data.eval_from_train = {cfg.eval_from_train} would leave nothing to train on: "
                f"{train.where} holds {len(train_items)} rows"
            )
        order = list(range(len(train_items)))
        random.Random(f"eval_from_train/{cfg.seed}").shuffle(order)
        out = set(order[: cfg.eval_from_train])
        eval_items = [train_items[i] for i in sorted(out)]
        train_items = [it for i, it in enumerate(train_items) if i not in out]
        eval_about = (
            f"{len(eval_items)} rows held out of {train.where} (data.eval_from_train = "
            f"{cfg.eval_from_train}, seed {cfg.seed}); they are not trained on"
        )
    elif held is None:
        raise DataError(
            f"no held-out data: data.path={cfg.path} has no {cfg.eval_split!r} split (data.eval_split); "
            "set data.eval_path to held-out data, or data.eval_from_train = N to hold N training rows out"
        )
    else:
        eval_items = _items(held, cfg, cfg.eval_split)
        eval_about = f"{len(eval_items)} rows of {held.where}"
    train_items = _limited(train_items, cfg.train_limit or None)
    seen = {(it["question"], json.dumps(it.get("messages"))) for it in train_items}
    kept = [it for it in eval_items if (it["question"], json.dumps(it.get("messages"))) not in seen]
    if dropped := len(eval_items) - len(kept):
        eval_about += f"; {dropped} whose prompt is also a training prompt left out"
    if not kept:
        raise DataError(
            f"no held-out items left: every prompt of {held.where if held else train.where} is also trained on"
        )
    kept = kept[: cfg.eval_size]
    fields = _fields_text(cfg)
    return Data(
        train_items,
        kept,
        f"{len(train_items)} rows of {train.where} ({fields})",
        f"{len(kept)} of {eval_about}",
    )


def load_eval_items(cfg: DataConfig, path: str, limit: int = 0) -> tuple[list[dict[str, Any]], str]:
    """Every row of the data at ``path`` (a file, or the ``eval_split`` of a folder, saved dataset or
    hub id), as items with ``cfg``'s field names, the first ``limit`` (0 = all); for evaluating a
    model on data of your choice (``recipes/gsm8k_eval.py --data``)."""
    rows = _read(path, cfg.eval_split, True, "--data", cfg.hub_timeout_s)
    if rows is None:
        raise DataError(f"--data {path}: no {cfg.eval_split!r} split there (data.eval_split)")
    items = _limited(_items(rows, cfg, cfg.eval_split), limit or None)
    return items, f"{len(items)} rows of {rows.where} ({_fields_text(cfg)})"


def load_data(cfg: DataConfig, workflow_args: Any = None) -> Data:
    """The training and held-out items ``cfg`` names (``source = "env"``: the datasets of the
    environment ``workflow_args`` names). Blocking (file or network I/O): call it before the event
    loop starts or through ``asyncio.to_thread``. Raises :class:`DataError` (one line)."""
    if cfg.source == "env":
        if not hasattr(workflow_args, "env_data"):
            raise DataError(
                "data.source = 'env' trains on an environment's dataset: set rollout.workflow = "
                "'nodes.rollout.environments:VerifiersWorkflow' and rollout.workflow_args.env"
            )
        try:
            return Data(*workflow_args.env_data(cfg))
        except ValueError as e:
            raise DataError(f"data.source = 'env': {e}") from None
    if cfg.source == "online":
        if not hasattr(workflow_args, "online_data"):
            raise DataError(
                "data.source = 'online' takes episodes from sessions: set rollout.workflow = "
                "'nodes.rollout.sessions:OnlineWorkflow'"
            )
        return Data(*workflow_args.online_data(cfg))
    if cfg.source == "local" or (cfg.source == "auto" and cfg.path):
        return _load_yours(cfg)
    train, about = load_gsm8k("train", cfg.source, None, cfg.train_limit or None, cfg.seed, cfg.hub_timeout_s)
    held, held_about = load_gsm8k("test", cfg.source, None, cfg.eval_size, cfg.seed, cfg.hub_timeout_s)
    return Data(train, held, about, held_about)


# -- offline generation -------------------------------------------------------------------


def _load_offline(split: str, seed: int, limit: int | None) -> tuple[list[dict[str, str]], str]:
    try:
        import reasoning_gym
    except ImportError as e:
        raise DataUnavailableError(
            "offline GSM8K-style data needs reasoning-gym (pip install reasoning-gym)"
        ) from e
    n_train, n_test = SPLIT_SIZES["train"], SPLIT_SIZES["test"]
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=n_train + n_test, seed=seed)
    if split == "train":
        n = n_train if limit is None else min(max(0, limit), n_train)
        rows = [(i, ds[i]) for i in range(n)]
    else:
        seen = {ds[i]["question"] for i in range(n_train)}  # held-out rows must not be training rows
        rows = [(i, ds[i]) for i in range(n_train, n_train + n_test)]
        rows = [(i - n_train, r) for i, r in rows if r["question"] not in seen]
    items = [_item("gsm_symbolic", split, i, r["question"], r["answer"]) for i, r in rows]
    return (
        items,
        f"GSM8K-style problems generated offline by reasoning-gym gsm_symbolic ({split} split, seed {seed})",
    )


# -- easy: single-digit sums and differences -----------------------------------------------


def easy_items() -> list[tuple[str, str]]:
    """Every ``What is a + b?`` (a, b in 1..9) and ``What is a - b?`` (9 >= a > b >= 1): 117
    problems ``(question, answer)``. With the tutor system prompt SmolLM2-135M-Instruct reasons
    at length and gets ~0.2-0.3 of them right; it can learn to do better within minutes on CPU."""
    plus = [(f"What is {a} + {b}?", str(a + b)) for a in range(1, 10) for b in range(1, 10)]
    minus = [(f"What is {a} - {b}?", str(a - b)) for a in range(2, 10) for b in range(1, a)]
    return plus + minus


EASY_TEST_SIZE = 64


def _load_easy(split: str, seed: int) -> tuple[list[dict[str, str]], str]:
    pool = easy_items()
    random.Random(seed).shuffle(pool)  # one order from the seed, split by index: disjoint splits
    rows = pool[:EASY_TEST_SIZE] if split == "test" else pool[EASY_TEST_SIZE:]
    items = [_item("easy", split, i, q, a) for i, (q, a) in enumerate(rows)]
    return items, f"single-digit sums and differences, generated offline ({split} split, seed {seed})"


# -- products: arithmetic a calculator gets right ------------------------------------------

PRODUCTS_TEST_SIZE = 64
PRODUCTS_TRAIN_SIZE = 512


def _load_products(split: str, seed: int) -> tuple[list[dict[str, str]], str]:
    """``What is a * b?`` with a three-digit and a two-digit factor: beyond SmolLM2-135M unaided,
    one line of Python with a tool (the agent config's task); test and train pairs disjoint."""
    rnd = random.Random(f"products/{seed}")
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < PRODUCTS_TEST_SIZE + PRODUCTS_TRAIN_SIZE:
        pairs[(rnd.randint(100, 999), rnd.randint(11, 99))] = None
    pool = list(pairs)
    rows = pool[:PRODUCTS_TEST_SIZE] if split == "test" else pool[PRODUCTS_TEST_SIZE:]
    items = [_item("products", split, i, f"What is {a} * {b}?", str(a * b)) for i, (a, b) in enumerate(rows)]
    return items, f"three-digit by two-digit products, generated offline ({split} split, seed {seed})"


# -- built-in sources -------------------------------------------------------------------------


def load_gsm8k(
    split: str,
    source: str = "auto",
    path: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    hub_timeout_s: float = 5.0,
) -> tuple[list[dict[str, str]], str]:
    """Items of ``split`` from a built-in source (``auto``, ``hub``, ``offline``, ``easy``,
    ``products``) and a sentence saying where they came from. ``path`` is not read here: your files
    go through :func:`load_data`.

    ``limit`` keeps the first ``limit`` items (the data set's own order); ``seed`` picks the
    offline pool. Blocking (file or network I/O).
    """
    _check_split(split)
    if source == "local" or path:
        raise DataError("load_gsm8k reads the built-in sources; read files with load_data(DataConfig(...))")
    fallback = ""
    if source == "hub":
        items, desc = _load_hub(split, hub_timeout_s)
    elif source == "offline":
        items, desc = _load_offline(split, seed, limit)
    elif source == "easy":
        items, desc = _load_easy(split, seed)
    elif source == "products":
        items, desc = _load_products(split, seed)
    elif source == "auto":
        try:
            items, desc = _load_hub(split, hub_timeout_s)
        except DataUnavailableError as e:
            log.warning("gsm8k_hub_unavailable_using_offline_data", split=split, reason=str(e))
            items, desc = _load_offline(split, seed, limit)
            fallback = f"; used because {e}"
    else:
        raise DataError(f"unknown data source {source!r}; use auto, hub, local, offline, easy or products")
    items = _limited(items, limit)
    if not items:
        raise DataUnavailableError(f"no GSM8K {split} items: {desc}")
    return items, f"{desc}: {len(items)} problems{fallback}"

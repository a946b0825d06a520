"""GSM8K prompt sources: real GSM8K (hub or local files) or GSM8K-style problems generated offline.

:func:`load_gsm8k` returns items ``{"id", "question", "answer"}`` (``answer`` is the final
number, e.g. ``"72"``) and a sentence saying where they came from, which the recipe prints.
Sources:

- ``"hub"``: ``datasets.load_dataset("openai/gsm8k", "main")``. The hub is probed first with a
  short, strictly bounded timeout, so a machine without network fails in seconds, never hangs.
  With ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` set only the local ``datasets`` cache is read.
- ``"local"``: a parquet / jsonl / json file, or a folder holding ``train*``/``test*`` files
  (the hub repo's layout and openai/grade-school-math's both work); ``{split}`` in the path
  is replaced by the split name.
- ``"offline"``: reasoning-gym's ``gsm_symbolic`` generator. One pool is generated from the
  seed and split by index (train first, then test, test minus any question also in train),
  so the splits are disjoint and the same seed gives the same items in the same order.
- ``"easy"``: single-digit sums and differences (117 problems: 64 held out, 53 to train on),
  for models too small for GSM8K (the CPU default: SmolLM2-135M starts at ~0.2 on them).
- ``"auto"``: local when a path is given, else hub, falling back to offline with a warning.

nodes/rollout/prompts.py serves the items to the rollout actors (epochs, shuffling, shards).
"""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path
from typing import Any

import structlog

__all__ = [
    "PROMPT_SUFFIX",
    "SYSTEM_PROMPT",
    "DataUnavailableError",
    "extract_final_answer",
    "format_prompt",
    "load_gsm8k",
]

log = structlog.get_logger(__name__)

SYSTEM_PROMPT = "You are a careful math tutor. Reason step by step, then state the final answer."
PROMPT_SUFFIX = "\nPlease put your final answer within \\boxed{}."  # AReaL's GSM8K suffix
HUB_DATASET = ("openai/gsm8k", "main")
SPLIT_SIZES = {"train": 7473, "test": 1319}  # GSM8K's own sizes; the offline pool mirrors them
_DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


class DataUnavailableError(RuntimeError):
    """A data source cannot be used here (no network, missing package, missing file)."""


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
        raise ValueError(f"unknown GSM8K split {split!r}; use 'train' or 'test'")


def _item(prefix: str, split: str, i: int, question: Any, answer: Any) -> dict[str, str]:
    return {
        "id": f"{prefix}-{split}-{i}",
        "question": str(question),
        "answer": extract_final_answer(str(answer)),
    }


def _limited(items: list[dict[str, str]], limit: int | None) -> list[dict[str, str]]:
    return items if limit is None else items[: max(0, limit)]


# -- hub ---------------------------------------------------------------------------------


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _probe_hub(timeout_s: float) -> str | None:
    """None if the hub answers within ``timeout_s``, else why not.

    Runs in a daemon thread joined with a timeout: name resolution ignores socket timeouts
    and can stall far longer than the caller wants to wait.
    """
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/api/datasets/{HUB_DATASET[0]}"
    result: list[str | None] = []

    def probe() -> None:
        try:
            import httpx

            r = httpx.head(url, timeout=timeout_s, follow_redirects=True)
            result.append(None if r.status_code < 500 else f"{url} answered HTTP {r.status_code}")
        except Exception as e:  # any failure means "not reachable"; the reason is reported
            result.append(f"{url}: {type(e).__name__}: {e}")

    t = threading.Thread(target=probe, name="gsm8k-hub-probe", daemon=True)
    t.start()
    t.join(timeout_s + 0.5)
    return result[0] if result else f"{url}: no answer within {timeout_s:g} s"


def _load_hub(split: str, timeout_s: float) -> tuple[list[dict[str, str]], str]:
    offline = _env_flag("HF_HUB_OFFLINE") or _env_flag("HF_DATASETS_OFFLINE")
    if not offline:
        reason = _probe_hub(timeout_s)
        if reason is not None:
            raise DataUnavailableError(f"the Hugging Face hub is unreachable ({reason})")
    try:
        import datasets
    except ImportError as e:
        raise DataUnavailableError("the 'datasets' package is not installed (pip install datasets)") from e
    try:
        ds = datasets.load_dataset(*HUB_DATASET, split=split)
    except Exception as e:
        where = "the local datasets cache (offline mode)" if offline else "the hub"
        raise DataUnavailableError(f"could not load {HUB_DATASET[0]} from {where}: {e}") from e
    items = [_item("gsm8k", split, i, row["question"], row["answer"]) for i, row in enumerate(ds)]
    return items, f"GSM8K ({HUB_DATASET[0]}, {split} split) from the Hugging Face hub"


# -- local files --------------------------------------------------------------------------


def _local_files(path: Path, split: str) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and p.suffix in _DATA_SUFFIXES and p.name.startswith(split)
        )  # fmt: skip
        if files:
            return files
        raise FileNotFoundError(f"no {split}*.parquet / {split}*.jsonl / {split}*.json file under {path}")
    raise FileNotFoundError(f"GSM8K data path {path} does not exist")


def _read_rows(file: Path) -> list[dict[str, Any]]:
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataUnavailableError(f"reading {file} needs pyarrow (pip install pyarrow)") from e
        return pq.read_table(file, columns=["question", "answer"]).to_pylist()
    text = file.read_text()
    if file.suffix == ".json" and text.lstrip().startswith("["):
        return list(json.loads(text))
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{n}: not a JSON object: {e}") from e
    return rows


def _load_local(split: str, path: str) -> tuple[list[dict[str, str]], str]:
    files = _local_files(Path(path.replace("{split}", split)).expanduser(), split)
    items: list[dict[str, str]] = []
    for file in files:
        for n, row in enumerate(_read_rows(file)):
            if not isinstance(row, dict) or "question" not in row or "answer" not in row:
                raise ValueError(f"{file}: row {n} lacks the GSM8K fields 'question' and 'answer'")
            items.append(_item("gsm8k", split, len(items), row["question"], row["answer"]))
    names = ", ".join(str(f) for f in files)
    return items, f"GSM8K {split} split from local file{'s' if len(files) > 1 else ''} {names}"


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
        seen = {ds[i]["question"] for i in range(n_train)}  # ~0.15 s for the whole pool
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


# -- entry point --------------------------------------------------------------------------


def load_gsm8k(
    split: str,
    source: str = "auto",
    path: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    hub_timeout_s: float = 5.0,
) -> tuple[list[dict[str, str]], str]:
    """GSM8K items of ``split`` and a sentence saying where they came from.

    ``limit`` keeps the first ``limit`` items (the data set's own order); ``seed`` picks the
    offline pool. Blocking (file or network I/O): call it before the event loop starts or
    through ``asyncio.to_thread``.
    """
    _check_split(split)
    fallback = ""
    if source == "local" or (source == "auto" and path):
        if not path:
            raise ValueError("source 'local' needs a path to a parquet/jsonl file or folder")
        items, desc = _load_local(split, path)
    elif source == "hub":
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
        raise ValueError(f"unknown GSM8K source {source!r}; use auto, hub, local, offline, easy or products")
    items = _limited(items, limit)
    if not items:
        raise DataUnavailableError(f"no GSM8K {split} items: {desc}")
    return items, f"{desc}: {len(items)} problems{fallback}"

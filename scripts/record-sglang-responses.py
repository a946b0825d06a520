"""Re-record tests/rollout/fixtures/sglang-0.5.23-responses.json from a real SGLang server on CPU.

    .venv/bin/python scripts/record-sglang-responses.py [SGLANG_PYTHON]

SGLANG_PYTHON defaults to what ``bash scripts/sglang-setup.sh`` prints. Records a sampled
generation with logprobs, a request aborted mid-generation, and one retracted across a weight
update (same checkpoint, new weight_version "7"), with the update's own answer.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nodes.inference.models import ensure_tiny_checkpoint  # noqa: E402
from tests.helpers.servers import start_sglang_server, stop_server, wait_until  # noqa: E402

OUT = ROOT / "tests" / "rollout" / "fixtures" / "sglang-0.5.23-responses.json"


async def used_tokens(c: httpx.AsyncClient, n: int) -> None:
    async def enough() -> bool:
        return (await c.get("/v1/loads")).json()["loads"][0]["num_used_tokens"] >= n

    await wait_until(enough, what=f"{n} tokens in use")


async def record(python: str) -> dict:
    ckpt = str(ensure_tiny_checkpoint(seed=0, tied=False))
    proc, url = start_sglang_server(python, ckpt)
    out: dict = {}
    long = {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3}
            body = {"input_ids": [5, 6, 7], "sampling_params": sp, "return_logprob": True, "rid": "rec-1"}
            out["generate_logprob"] = (await c.post("/generate", json=body)).json()
            body = {
                "input_ids": [9, 10, 11],
                "sampling_params": long,
                "return_logprob": True,
                "rid": "rec-abort",
            }
            task = asyncio.create_task(c.post("/generate", json=body))
            await used_tokens(c, 40)
            await c.post("/abort_request", json={"rid": "rec-abort"})
            out["generate_aborted"] = (await task).json()
            sp = {**long, "max_new_tokens": 600}
            body = {
                "input_ids": [12, 13, 14],
                "sampling_params": sp,
                "return_logprob": True,
                "rid": "rec-retract",
            }
            task = asyncio.create_task(c.post("/generate", json=body))
            await used_tokens(c, 60)
            await c.post("/pause_generation", json={"mode": "retract"})
            update = {"model_path": ckpt, "weight_version": "7", "flush_cache": True}
            out["update_weights_from_disk"] = (await c.post("/update_weights_from_disk", json=update)).json()
            await c.post("/continue_generation", json={})
            out["generate_across_update"] = (await task).json()
    finally:
        stop_server(proc)
    return out


def main() -> None:
    if len(sys.argv) > 1:
        python = sys.argv[1]
    else:
        setup = ["bash", str(ROOT / "scripts" / "sglang-setup.sh")]
        python = subprocess.run(setup, check=True, capture_output=True, text=True).stdout.strip()
    OUT.write_text(json.dumps(asyncio.run(record(python)), indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

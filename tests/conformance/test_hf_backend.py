"""The reference server's ``hf`` backend on the tiny checkpoint (CPU): outputs equal transformers',
logprobs equal a trainer's recomputation, resumed requests reuse cached KV, weights update live."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from nodes.rollout.chunks import versions_from_spans
from tests.helpers.servers import join_group, push, wait_load

PROMPTS = [list(range(100, 110)), list(range(200, 237)), list(range(300, 304)), list(range(400, 460))]


@pytest.fixture
async def hf(hf_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=hf_url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def ref_model(tiny_ckpt: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def hf_greedy(model: AutoModelForCausalLM, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


async def test_concurrent_greedy_matches_transformers(
    hf: httpx.AsyncClient, ref_model: AutoModelForCausalLM
) -> None:
    rs = await asyncio.gather(
        *[
            hf.post("/generate", json={"input_ids": p, "sampling_params": greedy(12 + 3 * i)})
            for i, p in enumerate(PROMPTS)
        ]
    )
    for i, (p, r) in enumerate(zip(PROMPTS, rs, strict=True)):
        assert r.json()["output_ids"] == hf_greedy(ref_model, p, 12 + 3 * i)


async def test_logprobs_match_trainer_recomputation(
    hf: httpx.AsyncClient, ref_model: AutoModelForCausalLM
) -> None:
    temperature = 0.7
    prompt = PROMPTS[1]
    r = await hf.post(
        "/generate",
        json={
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 16,
                "temperature": temperature,
                "top_p": 0.9,
                "ignore_eos": True,
            },
        },
    )
    body = r.json()
    out = body["output_ids"]
    got = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
    with torch.inference_mode():
        logits = ref_model(torch.tensor([prompt + out])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]
    assert got == pytest.approx(want, abs=1e-4)


async def test_sampling_seed_is_reproducible(hf: httpx.AsyncClient) -> None:
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 7},
    }
    a, b = [(await hf.post("/generate", json=body)).json()["output_ids"] for _ in range(2)]
    assert a == b


async def test_resume_reuses_cached_kv_and_continues_identically(
    hf: httpx.AsyncClient, ref_model: AutoModelForCausalLM
) -> None:
    prompt = list(range(600, 680))
    full = hf_greedy(ref_model, prompt, 30)
    task = asyncio.create_task(
        hf.post("/generate", json={"input_ids": prompt, "rid": "hf-resume", "sampling_params": greedy(4000)})
    )
    await wait_load(hf, running=1)
    await hf.post("/abort_request", json={"rid": "hf-resume"})
    partial = (await task).json()["output_ids"][:20]
    assert partial == hf_greedy(ref_model, prompt, len(partial))
    resumed = prompt + partial
    r = (
        await hf.post("/generate", json={"input_ids": resumed, "sampling_params": greedy(30 - len(partial))})
    ).json()
    assert r["meta_info"]["cached_tokens"] == len(resumed) - 1
    assert partial + r["output_ids"] == full


async def test_disk_update_and_bad_path(hf: httpx.AsyncClient, tiny_ckpt: Path, tiny_ckpt_alt: Path) -> None:
    async def out() -> list[int]:
        return (
            await hf.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": greedy(8)})
        ).json()["output_ids"]

    before = await out()
    r = await hf.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert await out() == before
    r = await hf.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_ckpt_alt), "weight_version": "alt"}
    )
    assert r.json()["success"] is True
    alt = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt_alt), dtype=torch.float32).eval()
    assert await out() == hf_greedy(alt, PROMPTS[0], 8) != before
    assert (await hf.post("/update_weights_from_disk", json={"model_path": str(tiny_ckpt)})).json()["success"]
    assert await out() == before


@pytest.mark.parametrize(
    "flattened, reorder",
    [
        (False, False),
        (True, False),  # the model's own order: received straight into the server's packed parameters
        (True, True),  # another order: through a staging buffer, then copied
    ],
)
async def test_distributed_update_into_live_model(
    hf: httpx.AsyncClient, tiny_ckpt: Path, tiny_ckpt_alt: Path, flattened: bool, reorder: bool
) -> None:
    alt = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt_alt), dtype=torch.float32).eval()
    named = {n: p.detach().clone() for n, p in alt.named_parameters()}
    if reorder:
        named = dict(reversed(named.items()))
    trainer, group = await join_group(hf)
    try:
        await push(hf, trainer, group, named, flattened, version=f"dist-{flattened}")
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
            got = torch.tensor(
                (await hf.post("/get_weights_by_name", json={"name": name, "truncate_size": 4})).json()
            )
            assert torch.equal(got, named[name][:4])
        r = (await hf.post("/generate", json={"input_ids": PROMPTS[2], "sampling_params": greedy(8)})).json()
        assert r["output_ids"] == hf_greedy(alt, PROMPTS[2], 8)
        assert r["meta_info"]["weight_version"] == f"dist-{flattened}"
    finally:
        await hf.post("/destroy_weights_update_group", json={"group_name": group})
        await hf.post("/update_weights_from_disk", json={"model_path": str(tiny_ckpt)})


def test_sampling_filters() -> None:
    from nodes.inference.backends.hf import _filter

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert _filter(probs, 2, 1.0, 0.0).tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert _filter(probs, -1, 0.7, 0.0).tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert _filter(probs, -1, 0.4, 0.0).tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])
    assert _filter(probs, -1, 1.0, 0.5).tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])


async def test_retract_across_a_real_weight_change(
    hf: httpx.AsyncClient, ref_model: AutoModelForCausalLM, tiny_ckpt: Path, tiny_ckpt_alt: Path
) -> None:
    """Retract, load other weights (cache flushed), continue: the tokens before the pause are the old
    model's, those after are the new model's continuation, and the per-token versions say so."""
    prompt, n = PROMPTS[3], 300  # long enough that the pause lands mid-way on a busy machine
    sp = greedy(n)
    assert (
        await hf.post("/update_weights_from_disk", json={"model_path": str(tiny_ckpt), "weight_version": "0"})
    ).json()["success"]
    task = asyncio.create_task(hf.post("/generate", json={"input_ids": prompt, "sampling_params": sp}))
    await wait_load(hf, running=1)
    await hf.post("/pause_generation", json={"mode": "retract"})
    try:
        r = await hf.post(
            "/update_weights_from_disk", json={"model_path": str(tiny_ckpt_alt), "weight_version": "1"}
        )
        assert r.json()["success"] is True
    finally:
        await hf.post("/continue_generation", json={})
    try:
        meta = (body := (await task).json())["meta_info"]
        out, versions = body["output_ids"], versions_from_spans(meta["weight_versions"], n)
        k = versions.count("0")
        assert 0 < k < n and versions == ["0"] * k + ["1"] * (n - k) and meta["weight_version"] == "1"
        alt = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt_alt), dtype=torch.float32).eval()
        assert out[:k] == hf_greedy(ref_model, prompt, k)
        assert out[k:] == hf_greedy(
            alt, prompt + out[:k], n - k
        )  # re-prefilled from scratch by the new weights
    finally:
        await hf.post("/update_weights_from_disk", json={"model_path": str(tiny_ckpt)})


def test_packed_parameters_take_buckets_of_consecutive_parameters(tiny_ckpt: Path) -> None:
    from nodes.inference.weight_sync import PackedParams

    model = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    before = model(ids).logits
    named = list(model.named_parameters())
    packed = PackedParams(model)
    assert torch.equal(model(ids).logits, before)  # same weights, new storage
    names, shapes = [n for n, _ in named[2:5]], [list(p.shape) for _, p in named[2:5]]
    live = packed.bucket(names, torch.float32, shapes)
    assert live is not None and live.numel() == sum(p.numel() for _, p in named[2:5])
    live.fill_(0.5)  # writing the slice writes the model's parameters
    assert all(bool((p == 0.5).all()) for _, p in named[2:5])
    assert not bool((named[1][1] == 0.5).all()) and not bool((named[5][1] == 0.5).all())
    assert packed.bucket(names[::-1], torch.float32, shapes[::-1]) is None  # not back to back
    assert packed.bucket([names[0], names[2]], torch.float32, [shapes[0], shapes[2]]) is None
    assert packed.bucket(names, torch.bfloat16, shapes) is None  # needs a cast
    assert packed.bucket(names, torch.float32, [[1]] * 3) is None  # wrong sizes
    assert packed.bucket(names[:1], torch.float32, [shapes[0][::-1]]) is None  # same size, another shape
    assert packed.bucket(["no.such"], torch.float32, [[1]]) is None
    assert packed.bucket(["no.such"], torch.float32, [[0]]) is None
    named[3][1].data = named[3][1].data.clone()  # the model's storage moved: no longer the buffer's
    assert packed.bucket(names, torch.float32, shapes) is None
    assert packed.bucket(names[:1], torch.float32, shapes[:1]) is not None


HEALTH_BOUND_S = 2.0  # /health answers within this while a heavy request runs (issue 30 item 3)


async def test_heavy_logprob_requests_are_bounded_and_health_keeps_answering(hf: httpx.AsyncClient) -> None:
    """The issue's request (n=64, every token's log-prob, their texts, 8 tokens: 25M entries,
    940 MB, 115 s, /health 30-52 s) is refused at once naming the flag. One at the default limit
    (64 x 2,048 x 8 = 2**20 entries, ~40 MB) is served while /health answers within 2 s
    throughout: the forward passes and the rendering run off the event loop."""
    sp = {"n": 64, "max_new_tokens": 8, "temperature": 0.7, "ignore_eos": True}
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": sp,
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    r = await hf.post("/generate", json={**body, "top_logprobs_num": 49_152}, timeout=10)
    assert (
        r.status_code == 400 and "25165824 log-prob entries" in r.text and "--max-logprob-entries" in r.text
    )
    heavy = asyncio.create_task(hf.post("/generate", json={**body, "top_logprobs_num": 2048}, timeout=120))
    polls, worst = 0, 0.0
    while not heavy.done():
        start = asyncio.get_running_loop().time()
        assert (await hf.get("/health", timeout=HEALTH_BOUND_S * 5)).status_code == 200
        worst = max(worst, asyncio.get_running_loop().time() - start)
        polls += 1
        await asyncio.wait({heavy}, timeout=0.05)  # poll pace; returns at once when it is done
    r = await heavy
    assert r.status_code == 200, r.text[:300]
    out = r.json()
    assert len(out) == 64 and all(len(o["meta_info"]["output_top_logprobs"]) == 8 for o in out)
    assert all(
        len(top) == 2048 and isinstance(top[0][2], str) for top in out[0]["meta_info"]["output_top_logprobs"]
    )
    assert polls >= 3 and worst < HEALTH_BOUND_S, (polls, worst)

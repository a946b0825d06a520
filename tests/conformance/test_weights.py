"""Weight updates: from disk (good and bad path), over a weight-update group (per tensor and
flattened bucket, inside a begin/end session), and weight_version reporting."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from tests.helpers.servers import join_group, push

PROMPT = list(range(500, 540))
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


async def outputs(client: httpx.AsyncClient) -> list[int]:
    r = await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


async def load_disk(
    client: httpx.AsyncClient, path: Path | str, version: str | None = None
) -> httpx.Response:
    body: dict = {"model_path": str(path)}
    if version is not None:
        body["weight_version"] = version
    return await client.post("/update_weights_from_disk", json=body)


async def test_update_from_disk_changes_outputs_and_restores(
    client: httpx.AsyncClient, tiny_ckpt: Path, tiny_ckpt_alt: Path
) -> None:
    before = await outputs(client)
    try:
        r = await load_disk(client, tiny_ckpt_alt, version="v-alt")
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert "num_paused_requests" in r.json()
        assert (await client.get("/model_info")).json()["weight_version"] == "v-alt"
        gen = (await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})).json()
        assert gen["meta_info"]["weight_version"] == "v-alt"
        assert gen["output_ids"] != before
    finally:  # the rest of the suite expects the original weights
        r = await load_disk(client, tiny_ckpt, version="v-orig")
    assert r.json()["success"] is True
    assert await outputs(client) == before


async def test_update_from_bad_path_fails_and_keeps_model(client: httpx.AsyncClient) -> None:
    before = await outputs(client)
    version = (await client.get("/model_info")).json()["weight_version"]
    r = await load_disk(client, "/nonexistent/checkpoint", version="never")
    assert r.status_code == 400
    assert r.json()["success"] is False and r.json()["message"]
    assert (await client.get("/model_info")).json()["weight_version"] == version
    assert await outputs(client) == before


async def test_update_from_distributed_per_tensor_and_bucket(
    client: httpx.AsyncClient, tiny_ckpt: Path
) -> None:
    """Two of the served model's own parameters (names and shapes from its checkpoint), sent by a
    trainer that forms the group as SGLang does; then the original weights are loaded back."""
    from safetensors import safe_open

    with safe_open(str(tiny_ckpt / "model.safetensors"), "pt") as f:
        shapes = {
            n: f.get_slice(n).get_shape()
            for n in ("model.norm.weight", "model.layers.0.input_layernorm.weight")
        }
    trainer, name = await join_group(client)
    try:
        g = torch.Generator().manual_seed(0)
        for flattened, version in ((False, "d1"), (True, "d2")):
            named = {n: torch.randn(*shape, generator=g) for n, shape in shapes.items()}
            await push(client, trainer, name, named, flattened, version)
            for pname, t in named.items():
                got = (
                    await client.post("/get_weights_by_name", json={"name": pname, "truncate_size": 100})
                ).json()
                assert torch.equal(torch.tensor(got, dtype=torch.float32), t), pname
            assert (await client.get("/model_info")).json()["weight_version"] == version
    finally:
        r = await client.post("/destroy_weights_update_group", json={"group_name": name})
        assert r.json()["success"] is True
        trainer.close()
        assert (await load_disk(client, tiny_ckpt, version="restored")).json()["success"] is True


async def test_update_from_distributed_unknown_group_fails(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/update_weights_from_distributed",
        json={
            "names": ["x"],
            "dtypes": ["float32"],
            "shapes": [[1]],
            "group_name": "no-such-group",
        },
    )
    assert r.status_code == 400 and r.json()["success"] is False


async def test_weight_update_session_rules(client: httpx.AsyncClient) -> None:
    assert (await client.post("/end_weight_update", json={})).json()["success"] is False
    assert (await client.post("/begin_weight_update", json={"selector": "all"})).json()["success"] is True
    try:
        assert (await client.post("/begin_weight_update", json={"selector": "all"})).json()[
            "success"
        ] is False
    finally:
        assert (await client.post("/end_weight_update", json={})).json()["success"] is True

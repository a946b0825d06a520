"""LoRA pushed as an adapter ([trainer.lora] push = "adapter"): the PEFT folder the trainer writes,
served by the reference server through SGLang's LoRA API (``--enable-lora``,
``/load_lora_adapter``, ``/unload_lora_adapter``, ``lora_path`` per ``/generate``), generates
exactly what the merged model generates; requests without it, in the same batch, get the base."""

from __future__ import annotations

import asyncio
import copy
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.config import LoraConfig
from nodes.trainer.lora import adapter_state, write_adapter
from protocols.http.sglang import lora_name
from tests.helpers.servers import serving, start_reference_server
from tests.trainer.test_lora import adapted

HERE = Path(__file__).parent
PROMPTS = [[1, 5, 9, 30, 4], [7, 7, 2], [100, 200, 300, 400, 500, 600]]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
SERVER = ["--backend", "hf", "--device", "cpu", "--dtype", "float32", "--num-threads", "1"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny model, its random adapter as the trainer writes it, and the same merged."""
    base = ensure_tiny_checkpoint()
    tmp = tmp_path_factory.mktemp("lora_adapter")
    model = adapted(str(base), LoraConfig(enabled=True, rank=4, alpha=16.0))
    adapter = tmp / "adapter-v1"
    nbytes = write_adapter(adapter, model, adapter_state(model), str(base))
    assert nbytes == (adapter / "adapter_model.safetensors").stat().st_size - _header(adapter)
    merged = tmp / "merged"
    copy.deepcopy(model).merge_and_unload().save_pretrained(str(merged))
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, merged / f.name)
    return {"base": base, "adapter": adapter, "merged": merged}


def _header(folder: Path) -> int:
    """The safetensors header's size (8 bytes of length, then the JSON header)."""
    raw = (folder / "adapter_model.safetensors").read_bytes()[:8]
    return 8 + int.from_bytes(raw, "little")


@pytest.fixture(scope="module")
def lora_server(folders) -> Iterator[str]:
    yield from serving(
        start_reference_server(["--model-path", str(folders["base"]), *SERVER, "--enable-lora"])
    )


@pytest.fixture(scope="module")
def merged_server(folders) -> Iterator[str]:
    yield from serving(start_reference_server(["--model-path", str(folders["merged"]), *SERVER]))


def generate(url: str, lora: str | list[str | None] | None = None, prompts=PROMPTS) -> list[dict]:
    body: dict = {"input_ids": prompts, "sampling_params": GREEDY, "return_logprob": True}
    if lora is not None:
        body["lora_path"] = lora
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_adapter_generates_what_the_merged_model_does(folders, lora_server, merged_server) -> None:
    name = lora_name("policy", 1)
    r = httpx.post(
        lora_server + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(folders["adapter"])}
    )
    assert r.status_code == 200 and r.json() == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {name: str(folders["adapter"])},
    }
    want = generate(merged_server)
    got = generate(lora_server, name)
    base = generate(lora_server)
    for w, g in zip(want, got, strict=True):
        assert g["output_ids"] == w["output_ids"]
        lp_g = [e[0] for e in g["meta_info"]["output_token_logprobs"]]
        lp_w = [e[0] for e in w["meta_info"]["output_token_logprobs"]]
        assert lp_g == pytest.approx(lp_w, abs=1e-4)
    assert [b["output_ids"] for b in base] != [w["output_ids"] for w in want]  # the adapter matters
    # one batch, rows with and without the adapter: each gets its own
    mixed = generate(lora_server, [name, None, name])
    assert [m["output_ids"] for m in mixed] == [
        want[0]["output_ids"],
        base[1]["output_ids"],
        want[2]["output_ids"],
    ]


def test_loading_and_unloading_answer_as_sglang(folders, lora_server) -> None:
    name, path = "twice", str(folders["adapter"])
    assert (
        httpx.post(
            lora_server + "/load_lora_adapter", json={"lora_name": name, "lora_path": path}
        ).status_code
        == 200
    )
    again = httpx.post(lora_server + "/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert again.status_code == 400 and "already exists" in again.json()["error_message"]
    gone = httpx.post(lora_server + "/unload_lora_adapter", json={"lora_name": name})
    assert gone.status_code == 200 and name not in gone.json()["loaded_adapters"]
    r = httpx.post(
        lora_server + "/generate", json={"input_ids": [1, 2], "sampling_params": GREEDY, "lora_path": name}
    )
    assert r.status_code == 400 and "never been loaded" in r.text
    missing = httpx.post(lora_server + "/unload_lora_adapter", json={"lora_name": name})
    assert missing.status_code == 400 and "does not exist" in missing.json()["error_message"]
    bad = httpx.post(lora_server + "/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "not a PEFT adapter folder" in bad.json()["error_message"]


def test_a_server_without_lora_refuses_adapters(folders, merged_server) -> None:
    r = httpx.post(
        merged_server + "/load_lora_adapter", json={"lora_name": "a", "lora_path": str(folders["adapter"])}
    )
    assert r.status_code == 400 and "--enable-lora" in r.json()["error_message"]
    g = httpx.post(merged_server + "/generate", json={"input_ids": [1, 2], "lora_path": "a"})
    assert g.status_code == 400 and "LoRA is not enabled" in g.text


def test_adapter_state_has_peft_names_and_matches_the_model() -> None:
    model = adapted(
        str(ensure_tiny_checkpoint()), LoraConfig(enabled=True, rank=2, target_modules=["q_proj"])
    )
    state = adapter_state(model)
    params = dict(model.named_parameters())
    assert state and all(".default." not in k for k in state)
    for k, t in state.items():
        own = k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        assert torch.equal(t, params[own])


def test_push_and_keep_come_from_the_config_and_are_checked() -> None:
    from recipes.gsm8k_config import load_config
    from rlactors.base.tomlconf import ConfigError

    cfg = load_config(None, ["trainer.lora.enabled=true", "trainer.lora.push=adapter", "trainer.lora.keep=3"])
    assert (cfg.trainer.lora.push, cfg.trainer.lora.keep) == ("adapter", 3)
    assert LoraConfig().push == "merged"  # full weights unless asked
    for bad, key in (("push=tensors", "push"), ("keep=1", "keep")):
        with pytest.raises(ConfigError, match=f"trainer.lora.{key}"):
            load_config(None, [f"trainer.lora.{bad}"])


def test_the_recipe_launches_servers_with_lora_and_clients_name_the_adapter() -> None:
    from recipes.gsm8k_config import load_config
    from recipes.gsm8k_plane import with_lora

    merged = load_config(None, ["trainer.lora.enabled=true"])
    assert with_lora(merged) is merged  # nothing changes for merged pushes
    cfg = with_lora(
        load_config(
            None,
            [
                "trainer.lora.enabled=true",
                "trainer.lora.push=adapter",
                "trainer.lora.rank=8",
                "trainer.lora.name=p",
            ],
        )
    )
    assert cfg.servers.reference.enable_lora and cfg.servers.reference.max_lora_rank == 8
    flags = cfg.servers.sglang.extra_args
    assert flags[:5] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"]
    assert cfg.rollout.client.lora == "p"


async def test_the_client_names_the_adapter_of_its_version_and_labels_tokens_with_it() -> None:
    from nodes.rollout.client import ClientConfig, GenRequest, SGLangClient
    from rlactors.base.aio import wait_for
    from tests.rollout.scripted import Answer, Script, Servers, reply

    aborted = asyncio.Event()

    def first(body: dict) -> Answer:
        client.pause()  # a push: the abort comes back while the client is paused
        aborted.set()
        return reply([5, 6], "abort", message="paused", versions=["9", "9"])

    script = Script(a=[first, lambda b: reply([7, 8], "length", versions=["9", "9"])])
    servers = await Servers(script).start("a")
    try:
        client = SGLangClient(servers.urls, ClientConfig(lora="policy"), version=1)
        task = asyncio.ensure_future(client.agenerate(GenRequest([1, 2], {"max_new_tokens": 4})))
        await wait_for(aborted.wait(), 30)
        client.set_version(2)  # the push loaded policy-v2 on every server
        client.resume()
        res = await task
        assert [b.get("lora_path") for _, b in script.posts] == ["policy-v1", "policy-v2"]
        # each post's tokens carry the version of the adapter it named, whatever the server's spans say
        assert res.output_versions == [1, 1, 2, 2]
        await client.aclose()
        base = SGLangClient(servers.urls, ClientConfig(lora="policy"), version=0)
        await base.agenerate(GenRequest([1], {"max_new_tokens": 2}))
        assert "lora_path" not in script.posts[-1][1]  # version 0 is the base model: no adapter named
        await base.aclose()
    finally:
        await servers.aclose()


def test_two_ranks_gather_the_adapter_as_its_full_tensors(tmp_path: Path) -> None:
    import json

    from tests.trainer.launch import run_ranks

    out = tmp_path / "gathered.json"
    run_ranks(
        HERE / "lora_adapter_worker.py", [str(out), str(ensure_tiny_checkpoint())], world=2, timeout=300
    )
    result = json.loads(out.read_text())
    assert result["rows_differ_by_rank"]  # sharded for real: each rank holds part of the rows
    assert result["names_in_order"] and result["equal"]

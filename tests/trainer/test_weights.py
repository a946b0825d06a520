"""Weight push from 2 FSDP ranks into a live reference server, with requests in flight.

After each push the server's every parameter equals the trainer's (exact, fp32), for the group
path (gloo, per-tensor and flattened buckets), by reference (``/update_weights_from_tensor``) and
the disk path, under each pause mode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nodes.inference.models import ensure_tiny_checkpoint
from tests.helpers.proxy import RecordingProxy
from tests.helpers.servers import reference_server
from tests.trainer.dist_worker import LONG, PUSH_CASES
from tests.trainer.launch import run_ranks

HERE = Path(__file__).parent


def small_vocab_model(dst: Path) -> Path:
    """A 2-layer Llama with a 1024-token vocabulary (cheap to read back over HTTP) + a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(dst))
    for f in ensure_tiny_checkpoint().iterdir():
        if f.is_file() and "token" in f.name:
            shutil.copy(f, dst / f.name)
    return dst


@pytest.mark.slow
def test_push_to_reference_server_under_each_pause_mode(tmp_path):
    model = small_vocab_model(tmp_path / "model")
    args = [
        "--backend",
        "hf",
        "--model-path",
        str(model),
        "--dtype",
        "float32",
        "--num-threads",
        "1",
        "--strict-weight-update-session",
        "--weight-version",
        "0",
    ]
    with reference_server(args) as url:
        run_ranks(HERE / "dist_worker.py", ["push", str(tmp_path), str(model), url], world=2, timeout=280)
    results = json.loads((tmp_path / "push.json").read_text())
    assert [(r["method"], r["mode"], r["flattened"]) for r in results] == PUSH_CASES
    for r in results:
        case = f"{r['method']}/{r['mode']}"
        assert r["equal"] and all(r["equal"].values()), (case, [n for n, ok in r["equal"].items() if not ok])
        assert r["server_version"] == str(r["version"]), case
        assert r["push_bytes"] > 0
        if r["mode"] == "abort":
            # in-flight requests came back early with what they had
            assert r["finish"] == ["abort", "abort"], case
            assert all(n < LONG["max_new_tokens"] for n in r["completion_tokens"]), case
        else:
            # retract / in_place: requests survived the push and finished under the new version
            assert r["finish"] == ["length", "length"], case
            assert r["completion_tokens"] == [LONG["max_new_tokens"]] * 2, case
            assert r["gen_versions"] == [str(r["version"])] * 2, case
    versions = [r["version"] for r in results]
    assert versions == sorted(set(versions))  # every push carried a new version
    # keep_paused: left paused, a request posted after the push waited for the caller's continue,
    # then ran under the pushed version
    keep = json.loads((tmp_path / "push_keep.json").read_text())
    assert keep["left_paused"] == 1.0 and keep["held"], keep
    assert keep["finish"] == "length" and keep["gen_version"] == str(keep["version"]), keep
    versions.append(keep["version"])
    # the refused push: both ranks raised, nothing was left paused, the other session was left
    # alone, the retry went through
    r0, r1 = (json.loads((tmp_path / f"push_failure{r}.json").read_text()) for r in (0, 1))
    assert "/begin_weight_update answered 400" in r0["refused"], r0
    assert r1["refused"] == "weight push failed on rank 0 (see its log)"
    assert r0["after"] == "length"
    assert r0["session_still_open"]  # the push did not end a session it had not opened
    assert r0["version_after_refusal"] == str(versions[-1])
    assert r0["version_after_retry"] == str(versions[-1] + 101)


@pytest.mark.slow
def test_a_server_that_refuses_its_part_fails_the_group_step_at_once_naming_it(tmp_path):
    """A server that refuses to join the weight-update group, or refuses a bucket (so it never
    receives the broadcast), fails that step of the trainer's at once with the server's answer,
    instead of leaving the trainer waiting for it for group_timeout_s (300 s here); then the same
    server takes a push."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = small_vocab_model(tmp_path / "model")
    wide = LlamaConfig.from_pretrained(model)  # 40 MB of weights: more than loopback sockets hold
    wide.hidden_size, wide.intermediate_size, wide.num_hidden_layers = 512, 1024, 4
    LlamaForCausalLM(wide).save_pretrained(str(model))
    args = ["--backend", "hf", "--model-path", str(model), "--dtype", "float32", "--num-threads", "1"]
    with reference_server(args) as url:
        refuses_join = RecordingProxy(url, refuse={"/init_weights_update_group": 500})
        refuses_update = RecordingProxy(url, refuse={"/update_weights_from_distributed": 400})
        try:
            urls = [refuses_join.url, refuses_update.url, url]
            run_ranks(
                HERE / "dist_worker.py", ["refused", str(tmp_path), str(model), *urls], world=2, timeout=240
            )
        finally:
            refuses_join.close()
            refuses_update.close()
    r0, r1 = (json.loads((tmp_path / f"refused{r}.json").read_text()) for r in (0, 1))
    assert r0["connect"].startswith(f"{refuses_join.url}/init_weights_update_group answered 500"), r0
    assert r0["push"].startswith(f"{refuses_update.url}/update_weights_from_distributed answered 400"), r0
    assert r1["push"] == "weight push failed on rank 0 (see its log)", r1
    # at once: the 300 s bound is what the trainer waited before
    assert r0["connect_s"] < 60 and r0["push_s"] < 60, r0
    assert r0["version_after"] == "2", r0

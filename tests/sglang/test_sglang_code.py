"""Our weight push against SGLang 0.5.23's own code, in real processes (gloo).

The other side of each test runs in SGLang's venv (``scripts/sglang-setup.sh``; CI installs it)
and calls SGLang's functions unmodified (tests/sglang/sglang_side.py):

- our FSDP trainer (2 ranks) forms the weight-update group with SGLang's
  ``init_custom_process_group`` and pushes a flattened bucket (received by SGLang's
  ``FlattenedTensorBucket``) and then tensor by tensor; what SGLang received equals the
  trainer's weights bit for bit, and every body we sent passes SGLang's request classes;
- SGLang's trainer-side helpers push into our reference server, which must join and receive
  the same way: its weights then equal what was sent, bit for bit.

These fail on a trainer or server that builds the group any other way (the store keys differ and
the rendezvous times out).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from nodes.common.procs import free_port
from nodes.inference.launcher import SGLANG_CPU_SHIM
from nodes.inference.models import ensure_tiny_checkpoint
from tests.helpers.servers import reference_server
from tests.trainer.launch import run_ranks

HERE = Path(__file__).parent
REPO = HERE.parents[1]
SGLANG_PYTHON = os.environ.get("RLACTORS_SGLANG_PYTHON") or str(
    Path.home() / ".cache/rlactors/sglang-0.5.23/bin/python"
)

# the skip every test of tests/sglang carries: SGLang's own venv (scripts/sglang-setup.sh) is needed
NEEDS_SGLANG = pytest.mark.skipif(
    not Path(SGLANG_PYTHON).exists(),
    reason=f"SGLang 0.5.23 not installed at {SGLANG_PYTHON}: run `bash scripts/sglang-setup.sh` "
    "(CI does) or set RLACTORS_SGLANG_PYTHON",
)

pytestmark = [
    pytest.mark.sglang,
    NEEDS_SGLANG,
]


def sglang_env() -> dict[str, str]:
    return {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(SGLANG_CPU_SHIM)}


@pytest.fixture
def sglang_receiver(tmp_path: Path) -> Iterator[str]:
    """SGLang's weight-update receiving code behind HTTP, in SGLang's own interpreter."""
    port = free_port()
    proc = subprocess.Popen(
        [SGLANG_PYTHON, str(HERE / "sglang_side.py"), "serve", str(port), str(tmp_path)],
        env=sglang_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in proc.stdout:  # SGLang's imports take 10-60 s
            lines.append(line)
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError("SGLang side exited:\n" + "".join(lines[-40:]))
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    tied = "lm_head.weight" in want and "lm_head.weight" not in got
    names = set(want) - ({"lm_head.weight"} if tied else set())
    assert set(got) == names, (what, sorted(set(got) ^ names))
    for n in names:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, (what, n)
        assert torch.equal(got[n].view(torch.uint8), want[n].contiguous().view(torch.uint8)), (what, n)


def test_trainer_pushes_into_sglang_receive_code(tmp_path: Path, sglang_receiver: str) -> None:
    model = ensure_tiny_checkpoint()
    run_ranks(HERE / "trainer_worker.py", [str(tmp_path), str(model), sglang_receiver], world=2, timeout=240)
    for kind in ("flat", "per-tensor", "tensor"):
        got = load_file(str(tmp_path / f"received-{kind}.safetensors"))
        want = load_file(str(tmp_path / f"trainer-{kind}.safetensors"))
        assert_bit_equal(got, want, kind)
    sent = json.loads((tmp_path / "requests.json").read_text())
    paths = [r["path"] for r in sent]
    assert paths[0] == "/init_weights_update_group"
    assert "/update_weights_from_distributed" in paths and paths.count("/begin_weight_update") == 3
    assert "/update_weights_from_tensor" in paths  # opened by SGLang's own unpickler
    flat = [r["body"] for r in sent if r["path"] == "/update_weights_from_distributed"]
    assert {b.get("load_format") for b in flat} == {"flattened_bucket", None}


def pushes(pusher: subprocess.Popen[str], how: str, tensors: Path, output: list[str]) -> bool:
    """Ask ``sglang_side.py pushes`` for one more push; whether it said ``pushed`` (False if it
    exited first). What it printed is appended to ``output``."""
    assert pusher.stdin is not None and pusher.stdout is not None
    pusher.stdin.write(f"{how} {tensors}\n")
    pusher.stdin.flush()
    for line in pusher.stdout:
        output.append(line)
        if line.strip() == "pushed":
            return True
    return False


def test_sglang_trainer_side_pushes_into_reference_server(tmp_path: Path) -> None:
    model = ensure_tiny_checkpoint()
    # two dtypes in one bucket, as SGLang's FlattenedTensorBucket allows; the server is fp32
    torch.manual_seed(7)
    sent = {
        "model.layers.0.mlp.down_proj.weight": None,
        "model.norm.weight": None,
    }
    args = ["--backend", "hf", "--model-path", str(model), "--dtype", "float32", "--num-threads", "1"]
    with reference_server(args) as url:
        with httpx.Client(timeout=60) as c:
            for name, dtype in zip(sent, (torch.float32, torch.bfloat16), strict=True):
                shape = torch.tensor(
                    c.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}).json()
                ).shape
                sent[name] = torch.randn(shape).to(dtype)
            save_file(sent, str(tmp_path / "push.safetensors"))
            # one process of SGLang's for both pushes (its imports cost seconds), told what to push
            # on its stdin; its stdout read up to each "pushed", never to its end: torch's
            # shared-memory manager, started by the by-reference push, inherits it and lives while
            # this server keeps the mapping open
            pusher = subprocess.Popen(
                [SGLANG_PYTHON, str(HERE / "sglang_side.py"), "pushes", url, str(free_port())],
                env=sglang_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            output: list[str] = []
            try:
                assert pushes(pusher, "push", tmp_path / "push.safetensors", output), "".join(output)[-3000:]
                for name, t in sent.items():
                    got = torch.tensor(
                        c.post(
                            url + "/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}
                        ).json()
                    )
                    assert torch.equal(got, t.float()), name
                assert c.get(url + "/model_info").json()["weight_version"] == "per-tensor"
                # by reference: SGLang's MultiprocessingSerializer, as verl and SGLang's Engine send it
                for name in sent:
                    sent[name] = torch.randn(sent[name].shape).to(sent[name].dtype)
                save_file(sent, str(tmp_path / "push-tensor.safetensors"))
                pushed = pushes(pusher, "push-tensor", tmp_path / "push-tensor.safetensors", output)
                assert pushed, "".join(output)[-3000:]
                assert pusher.stdin is not None
                pusher.stdin.close()  # its loop ends
                assert pusher.wait(timeout=240) == 0, "".join(output)[-3000:]
            finally:
                if pusher.poll() is None:
                    pusher.kill()
                    pusher.wait()
                assert pusher.stdout is not None
                pusher.stdout.close()
            for name, t in sent.items():
                got = torch.tensor(
                    c.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}).json()
                )
                assert torch.equal(got, t.float()), name
            assert c.get(url + "/model_info").json()["weight_version"] == "by-reference"

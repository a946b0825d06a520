"""Tensors handed over by reference (nodes/common/tensor_ipc.py), SGLang's ``/update_weights_from_tensor``.

On CPU a tensor travels as the name of a shared-memory file: another process sees the sender's
memory, not a copy. The receiver builds tensors and nothing else: a payload naming any other
global is refused before anything runs. The reference server takes such payloads only inside a
weight-update session, as SGLang 0.5.23 does. (CUDA IPC handles: bench/gpu_push.py and
scripts/gpu-check.sh on a GPU; SGLang's own serializer and unpickler: tests/sglang.)
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from nodes.common.tensor_ipc import PayloadError, deserialize_named_tensors, serialize_named_tensors
from nodes.inference.models import ensure_tiny_checkpoint
from tests.helpers.servers import reference_server

REPO = Path(__file__).resolve().parents[2]
READ = """
import sys
from nodes.common.tensor_ipc import deserialize_named_tensors
named = deserialize_named_tensors(sys.stdin.readline().strip())
print([(n, t.dtype, t.tolist()) for n, t in named], flush=True)
sys.stdin.readline()  # the sender has written again
print([(n, t.tolist()) for n, t in named], flush=True)
"""


def test_another_process_sees_the_senders_memory() -> None:
    buf = torch.arange(10, dtype=torch.float32)
    named = [("a", buf[:6].view(2, 3)), ("b", buf[6:].to(torch.bfloat16))]
    payload = serialize_named_tensors(named)
    reader = subprocess.Popen(
        [sys.executable, "-c", READ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        reader.stdin.write(payload + "\n")
        reader.stdin.flush()
        first = reader.stdout.readline()
        assert first.strip() == str(
            [
                ("a", torch.float32, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]),
                ("b", torch.bfloat16, [6.0, 7.0, 8.0, 9.0]),
            ]
        )
        named[0][1][0, 0] = 42.0  # by reference: the reader's tensor changes with ours
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.stdout.readline().startswith("[('a', [[42.0, 1.0, 2.0]")
    finally:
        reader.kill()
        reader.wait(timeout=30)


class _Runs:
    def __reduce__(self):  # what a hostile payload would carry
        return (os.system, ("touch /tmp/rlactors-tensor-ipc-pwned",))


def _pickled(obj: object) -> str:
    buf = io.BytesIO()
    pickle.Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def test_a_payload_may_only_build_tensors() -> None:
    marker = Path("/tmp/rlactors-tensor-ipc-pwned")
    marker.unlink(missing_ok=True)
    with pytest.raises(PayloadError, match=r"refused posix\.system|refused os\.system"):
        deserialize_named_tensors(_pickled([("w", _Runs())]))
    assert not marker.exists()
    with pytest.raises(PayloadError, match="not base64"):
        deserialize_named_tensors("not base64!")
    with pytest.raises(PayloadError, match="does not unpickle"):
        deserialize_named_tensors(base64.b64encode(b"\x80\x05garbage").decode())
    with pytest.raises(PayloadError, match=r"list of \(name, tensor\) pairs"):
        deserialize_named_tensors(_pickled({"w": 1}))
    with pytest.raises(PayloadError, match=r"list of \(name, tensor\) pairs"):
        deserialize_named_tensors(_pickled([("w", 1)]))


def test_the_server_takes_tensors_by_reference_inside_a_session() -> None:
    path = ensure_tiny_checkpoint(seed=0, tied=False)
    args = [
        "--backend",
        "hf",
        "--model-path",
        str(path),
        "--dtype",
        "float32",
        "--num-threads",
        "1",
        "--strict-weight-update-session",
    ]
    ones = torch.full((64,), 0.25)
    body = {
        "serialized_named_tensors": [serialize_named_tensors([("model.norm.weight", ones)])],
        "weight_version": "7",
    }
    with reference_server(args) as url, httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 400
        assert "must run between begin_weight_update() and end_weight_update()" in r.json()["message"]
        assert c.post("/begin_weight_update", json={}).json()["success"]
        r = c.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 200 and r.json()["success"], r.text
        hostile = {"serialized_named_tensors": [_pickled([("model.norm.weight", _Runs())])]}
        r = c.post("/update_weights_from_tensor", json=hostile)
        assert r.status_code == 400 and "refused" in r.json()["message"], r.text
        assert c.post("/end_weight_update", json={}).json()["success"]
        got = c.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 64}).json()
        assert got == [0.25] * 64
        assert c.get("/get_weight_version").json()["weight_version"] == "7"
        r = c.post("/update_weights_from_tensor", json={**body, "load_format": "flattened_bucket"})
        assert r.status_code == 400 and "load_format" in r.text

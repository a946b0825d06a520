"""SGLang's side of the weight-update tests, run by SGLang's own interpreter (its venv).

Not a test module: ``tests/sglang/test_sglang_code.py`` starts it with the python of the venv that
``scripts/sglang-setup.sh`` made, so every call below is SGLang 0.5.23's own code:

- ``serve PORT OUT_DIR``: an HTTP endpoint with SGLang's weight routes whose handlers call SGLang's
  ``WeightUpdater`` methods (``init_weights_update_group``, ``receive_weights_from_distributed``,
  ``destroy_weights_update_group``; these run ``init_custom_process_group`` and
  ``FlattenedTensorBucket``). Every body is validated with SGLang's request class
  (``sglang.srt.managers.io_struct``), and a key the class does not have is refused, so a field
  SGLang would ignore shows as an error. ``POST /dump`` saves what was received.
  ``/update_weights_from_tensor`` payloads are opened with SGLang's ``MultiprocessingSerializer``
  (its ``SafeUnpickler``), as SGLang's scheduler opens them.
- ``push URL PORT TENSORS``: the trainer's side as AReaL and slime write it with SGLang's
  helpers: rank 0 of ``init_custom_process_group``, one flattened bucket
  (``FlattenedTensorBucket``) and then the same tensors one broadcast each, into a server.
- ``push-tensor URL TENSORS``: the same tensors by reference, serialized by SGLang's
  ``MultiprocessingSerializer`` as verl and SGLang's own ``Engine`` send them (CPU tensors: torch's
  ``file_system`` sharing, since a file descriptor cannot cross an HTTP call).
- ``pushes URL PORT``: both in one process (SGLang's imports once): reads ``push TENSORS`` or
  ``push-tensor TENSORS`` lines from stdin, answers each with a line ``pushed``, until stdin ends.

Stdlib HTTP only: nothing is installed into SGLang's venv for this.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import types
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pydantic
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from sglang.srt.managers import io_struct as io
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
from sglang.srt.utils.common import MultiprocessingSerializer, init_custom_process_group
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

ROUTES = {
    "/init_weights_update_group": io.InitWeightsUpdateGroupReqInput,
    "/update_weights_from_distributed": io.UpdateWeightsFromDistributedReqInput,
    "/update_weights_from_tensor": io.UpdateWeightsFromTensorReqInput,
    "/destroy_weights_update_group": io.DestroyWeightsUpdateGroupReqInput,
    "/begin_weight_update": io.BeginWeightUpdateReqInput,
    "/end_weight_update": io.EndWeightUpdateReqInput,
    "/pause_generation": io.PauseGenerationReqInput,
    "/continue_generation": io.ContinueGenerationReqInput,
}


def fields_of(cls: type) -> set[str]:
    names = getattr(cls, "__struct_fields__", None)
    return set(names) if names is not None else set(cls.__dataclass_fields__)


def validate(path: str, body: dict) -> object:
    """SGLang's class for the route, built from ``body`` (pydantic, as FastAPI parses it)."""
    cls = ROUTES[path]
    unknown = set(body) - fields_of(cls)
    if unknown:
        raise ValueError(f"{path}: SGLang's {cls.__name__} has no field(s) {sorted(unknown)}")
    return pydantic.TypeAdapter(cls).validate_python(body)


class Server:
    """SGLang's weight-update methods on a stand-in runner (CPU, tp_rank 0)."""

    def __init__(self, out_dir: str) -> None:
        # SGLang's servers run inside a default group; init_weights_update_group asserts one
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/default-pg", rank=0, world_size=1)
        self.runner = types.SimpleNamespace(_model_update_group={}, tp_rank=0, device="cpu")
        self.runner._receive_bucketed_weights_from_distributed = functools.partial(
            WeightUpdater._receive_bucketed_weights_from_distributed, self.runner
        )
        self.received: dict[str, torch.Tensor] = {}
        self.log: list[dict] = []
        self.out_dir = out_dir
        self.lock = threading.Lock()

    def handle(self, path: str, body: dict) -> tuple[int, dict]:
        if path == "/server_info":
            return 200, {"tp_size": 1}
        if path == "/dump":
            save_file(
                {k: v.contiguous() for k, v in self.received.items()}, f"{self.out_dir}/received.safetensors"
            )
            with open(f"{self.out_dir}/requests.json", "w") as f:
                json.dump(self.log, f)
            return 200, {"success": True, "n": len(self.received)}
        req = validate(path, body)
        self.log.append({"path": path, "body": body})
        if path == "/init_weights_update_group":
            ok, msg = WeightUpdater.init_weights_update_group(
                self.runner,
                req.master_address,
                req.master_port,
                req.rank_offset,
                req.world_size,
                req.group_name,
                req.backend,
            )
            return 200, {"success": ok, "message": msg}
        if path == "/update_weights_from_distributed":
            with self.lock:  # one receive at a time, as SGLang's scheduler runs them
                named = WeightUpdater.receive_weights_from_distributed(
                    self.runner,
                    names=req.names,
                    dtypes=req.dtypes,
                    shapes=req.shapes,
                    group_name=req.group_name,
                    load_format=req.load_format,
                )
                for name, t in named:
                    self.received[name] = t.clone()
            return 200, {"success": True, "message": f"received {len(named)} tensors"}
        if path == "/update_weights_from_tensor":
            with self.lock:
                named = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
                for name, t in named:
                    self.received[name] = t.clone()
            return 200, {"success": True, "message": f"received {len(named)} tensors"}
        if path == "/destroy_weights_update_group":
            ok, msg = WeightUpdater.destroy_weights_update_group(self.runner, req.group_name)
            return 200, {"success": ok, "message": msg}
        return 200, {"success": True, "message": "ok"}


def serve(port: int, out_dir: str) -> None:
    server = Server(out_dir)

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, data: dict) -> None:
            raw = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            self._answer(*server.handle("/server_info" if path == "/get_server_info" else path, {}))

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            try:
                self._answer(*server.handle(self.path, body))
            except Exception as e:  # a body SGLang would refuse: say which
                self._answer(400, {"success": False, "message": f"{type(e).__name__}: {e}"})

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    httpd.serve_forever()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        data = json.loads(r.read() or b"{}")
    if data.get("success") is False:
        raise RuntimeError(f"{url}: {data}")
    return data


def push(url: str, port: int, tensors_path: str) -> None:
    named = list(load_file(tensors_path).items())
    group = "sglang-trainer-side"
    init = threading.Thread(
        target=post,
        args=(
            url + "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": group,
                "backend": "gloo",
            },
        ),
    )
    init.start()
    pg = init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=group
    )
    init.join()
    meta = {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "group_name": group,
        "flush_cache": False,
    }
    for flat in (True, False):
        post(url + "/begin_weight_update", {"selector": "all"})
        body = {**meta, "weight_version": "flat" if flat else "per-tensor"}
        if flat:
            body["load_format"] = "flattened_bucket"
        answer = threading.Thread(target=post, args=(url + "/update_weights_from_distributed", body))
        answer.start()
        if flat:
            dist.broadcast(FlattenedTensorBucket(named_tensors=named).get_flattened_tensor(), src=0, group=pg)
        else:
            for _, t in named:
                dist.broadcast(t, src=0, group=pg)
        answer.join()
        post(url + "/end_weight_update", {})
    post(url + "/destroy_weights_update_group", {"group_name": group})
    print("pushed", flush=True)


def push_tensor(url: str, tensors_path: str) -> None:
    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_system")
    named = list(load_file(tensors_path).items())  # alive until the server has answered
    post(url + "/begin_weight_update", {"selector": "all"})
    payload = MultiprocessingSerializer.serialize(named, output_str=True)
    post(
        url + "/update_weights_from_tensor",
        {"serialized_named_tensors": [payload], "flush_cache": False, "weight_version": "by-reference"},
    )
    post(url + "/end_weight_update", {})
    print("pushed", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    mode, *args = sys.argv[1:]
    if mode == "serve":
        serve(int(args[0]), args[1])
    elif mode == "push-tensor":
        push_tensor(args[0], args[1])
    elif mode == "pushes":
        for line in sys.stdin:
            how, path = line.split()
            if how == "push":
                push(args[0], int(args[1]), path)
            else:
                push_tensor(args[0], path)
    else:
        push(args[0], int(args[1]), args[2])

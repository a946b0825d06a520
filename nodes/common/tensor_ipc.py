"""Tensors handed to another process on the same host by reference: SGLang's
``/update_weights_from_tensor`` payload.

The sender pickles ``[(name, tensor), ...]`` with torch's ``ForkingPickler`` and base64-encodes it
for JSON, as SGLang's ``MultiprocessingSerializer`` does. A CUDA tensor travels as a CUDA IPC
handle: the receiver maps the sender's memory and copies out of it on the GPU, and nothing passes
through host memory, as a gloo group's broadcast does (bench/gpu_push.py measures both).
A CPU tensor travels as the name of a shared-memory file (torch's ``file_system`` strategy; a
file descriptor could not cross an HTTP call). The sender must keep its tensors alive until the
receiver has answered.

The receiver unpickles with an allow-list: torch's tensor and storage rebuild functions, torch's
dtypes and a few torch types, nothing else (SGLang's ``SafeUnpickler`` keeps a similar list), so a
payload can build tensors but cannot call anything else. Our sender names a CUDA handle's GPU by
UUID, as SGLang's patched senders do, and the receiver looks it up among its own GPUs
(``CUDA_VISIBLE_DEVICES`` may number them differently). A handle from torch's plain reduction names
an index in the sender's numbering, which means nothing here: it is opened on the receiver's own GPU,
the one a colocated trainer shares.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from nodes.common.weight_group import gpu_uuid

__all__ = ["PayloadError", "deserialize_named_tensors", "serialize_named_tensors"]

_REBUILD_CUDA = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),  # device by UUID
}
_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch.nn.parameter", "Parameter"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("collections", "OrderedDict"),
}
_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device (unchanged for years; SGLang relies on it too)
_STRATEGY = threading.Lock()
_manager_started = False


class PayloadError(ValueError):
    """A payload that is not base64, not a pickle, names a global outside the allow-list, or does
    not hold ``(name, tensor)`` pairs."""


def serialize_named_tensors(named: Sequence[tuple[str, Any]]) -> str:
    """``named`` as one base64 payload. Serialize once per receiving rank: CUDA IPC counts each.

    A CUDA tensor's GPU is named by its UUID, as SGLang's patched senders name it, so that a
    receiver with another ``CUDA_VISIBLE_DEVICES`` opens it on the right GPU."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing as tmp  # registers torch's reductions with ForkingPickler

    if any(t.device.type == "cpu" for _, t in named):
        _start_shm_manager()
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor
    with _STRATEGY:  # the strategy is process-wide: one switch at a time
        strategy = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")  # CPU storages by file name; CUDA ones unaffected
        try:
            pickler.dump([(str(n), t) for n, t in named])
        finally:
            tmp.set_sharing_strategy(strategy)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _start_shm_manager() -> None:
    """Start torch's ``torch_shm_manager`` (it tracks ``file_system`` shared memory) with its stderr
    on /dev/null. torch starts it on first use, and it inherits stderr: it lives on until every
    process that mapped our memory has let go, the receiving server included, and would hold a
    pipe that whoever reads this process's output waits on (a node agent, a test's launcher)."""
    global _manager_started
    with _STRATEGY:
        if _manager_started:
            return
        import torch
        import torch.multiprocessing as tmp

        saved, strategy = os.dup(2), tmp.get_sharing_strategy()
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
            tmp.set_sharing_strategy("file_system")
            torch.empty(1).share_memory_()  # starts the manager (once per process)
        finally:
            tmp.set_sharing_strategy(strategy)
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)
        _manager_started = True


def _reduce_tensor(t: Any) -> tuple[Any, tuple[Any, ...]]:
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(t)
    if fn is reductions.rebuild_cuda_tensor:
        args = (*args[:_DEVICE_ARG], gpu_uuid(f"cuda:{args[_DEVICE_ARG]}"), *args[_DEVICE_ARG + 1 :])
    return fn, args


def deserialize_named_tensors(payload: str | bytes, device: Any = None) -> list[tuple[str, Any]]:
    """The ``(name, tensor)`` pairs of a payload; CUDA tensors are opened on ``device`` (default:
    the current one). Raises :class:`PayloadError` for anything else."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PayloadError(f"the payload is not base64: {e}") from None
    try:
        named = _Unpickler(io.BytesIO(raw), device).load()
    except PayloadError:
        raise
    except Exception as e:  # unpickling untrusted bytes raises any type; all are the payload's fault
        raise PayloadError(f"the payload does not unpickle: {type(e).__name__}: {e}") from None
    import torch

    if not isinstance(named, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in named
    ):
        raise PayloadError("the payload must be a list of (name, tensor) pairs")
    return named


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, device: Any) -> None:
        super().__init__(file)
        self.device = device

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _REBUILD_CUDA:
            return self._rebuild_cuda_tensor
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise PayloadError(f"refused {module}.{name}: a tensor payload may only rebuild tensors")

    def _rebuild_cuda_tensor(self, *args: Any) -> Any:
        from torch.multiprocessing import reductions

        rebuilt = list(args)
        rebuilt[_DEVICE_ARG] = _local_gpu(rebuilt[_DEVICE_ARG], self.device)
        return reductions.rebuild_cuda_tensor(*rebuilt)


def _local_gpu(named: int | str, device: Any) -> int:
    """This process's index of the GPU a handle was opened on: by UUID when the sender gave one,
    else ``device`` (the receiver's own GPU)."""
    import torch

    if isinstance(named, str):
        for i in range(torch.cuda.device_count()):
            if gpu_uuid(f"cuda:{i}") == named:
                return i
        raise PayloadError(f"GPU {named} is not visible to this process")
    if device is not None and torch.device(device).index is not None:
        return int(torch.device(device).index)
    return torch.cuda.current_device()

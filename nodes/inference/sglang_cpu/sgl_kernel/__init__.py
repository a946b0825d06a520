"""The two CPU ops SGLang 0.5.23's CPU engine imports from sgl-kernel at load time, in pure torch.

PyPI has only CUDA builds of sgl-kernel (they fail without libcuda) and no source
distribution, so ``scripts/sglang-server.sh`` puts this folder first on ``PYTHONPATH`` of the
real, unmodified SGLang server on CPU. Any other op imports (SGLang imports some at module
load) and raises ``NotImplementedError`` when called: only paths we do not use here
(speculative decoding and the like) call one.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+rlactors-cpu-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV locations into its row of ``req_to_token``.

    Request ``i`` takes the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc``
    (requests in order) into columns ``start_offset[i]:end_offset[i]`` of row
    ``req_pool_indices[i]``.
    """
    del pool_len  # the row length; req_to_token carries it
    rows, starts, ends = req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    off = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy KV row ``src_loc[j]`` to row ``tgt_loc[j]`` in every layer buffer.

    ``data_ptrs[b]`` is the address of buffer ``b`` and ``strides[b]`` its row size in bytes. All
    source rows are read before any target row is written, so overlapping moves are safe.
    """
    if src_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    rows = int(max(src.max().item(), tgt.max().item())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src]  # advanced indexing reads every source row first


def __getattr__(name: str) -> Any:
    """Any other op imports (SGLang imports some at module load) but raises when called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU implementation in rlactors' shim (nodes/inference/sglang_cpu); "
            "only the two ops SGLang's CPU engine needs for plain generation are provided"
        )

    unavailable.__name__ = name
    return unavailable

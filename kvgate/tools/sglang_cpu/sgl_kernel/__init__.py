"""A pure-torch stand-in for the two ``sgl_kernel`` ops SGLang 0.5.23's CPU engine imports.

Why it exists: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports two CPU ops from ``sgl_kernel`` when its modules
load, whatever the model:

- ``sglang/srt/mem_cache/allocation.py`` line 46: ``from sgl_kernel import assign_req_to_token_pool_cpu``
  (called by ``assign_req_to_token_pool_func``, line 746: write each request's new KV slots into its row of
  the req_to_token table);
- ``sglang/kernels/ops/kvcache/cache_move.py`` line 10: ``from sgl_kernel import copy_all_layer_kv_cache_cpu``
  (called by ``copy_all_layer_kv_cache_func``, line 191: move KV rows between slots in every layer's buffer).

The PyPI ``sglang-kernel`` wheel is CUDA only (its import fails on ``libcuda.so.1``) and the CPU build of
sgl-kernel is not published on PyPI. On a CPU without AMX every layer of a dense Llama on the
``torch_native`` attention backend takes ``forward_native``, so these two ops are the only ones called
(measured: greedy outputs identical uncached, cached and inside a batch). Any other
name imports (so SGLang's optional imports succeed) but raises NotImplementedError when called, so a code path
that needs a real kernel fails loudly instead of computing something else.

kvgate's launcher (kvgate.tools.sglang_engine) puts the folder holding this package first on the engine's PYTHONPATH.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+kvgate.cpu.standin"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request i: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` gets the next
    ``end[i] - start[i]`` entries of ``out_cache_loc`` (KV slot indices, in request order). ``pool_len`` is the
    table's row length (kept for the kernel's signature). Returns nothing; writes in place."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += max(n, 0)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every KV buffer (its base address in ``data_ptrs``, its row size in bytes in ``strides``), copy row
    ``src_loc[j]`` to row ``tgt_loc[j]``. Returns nothing; writes in place (rows of one buffer never overlap)."""
    pairs = [(t, s) for t, s in zip(tgt_loc.tolist(), src_loc.tolist()) if t != s]
    if not pairs:
        return
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for t, s in pairs:
            ctypes.memmove(base + t * stride, base + s * stride, stride)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_in_standin(*args, **kwargs):
        raise NotImplementedError(f"kvgate's CPU stand-in for sgl_kernel has no op {name!r}: this SGLang code "
                                  "path needs the real sgl-kernel CPU build")

    _not_in_standin.__name__ = name
    return _not_in_standin

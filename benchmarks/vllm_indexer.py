"""vLLM 0.33's decode lightning indexer on the GPU machine: DeepGEMM's scores and vLLM's top-k.

The pair vLLM's ``sparse_attn_indexer`` runs for a decode step on Hopper (its source,
``model_executor/layers/sparse_attn_indexer.py`` and ``indexer_topk.py``):

1. ``deep_gemm.fp8_fp4_paged_mqa_logits((q, None), kv_cache, weights, context_lens,
   block_table, schedule, max_model_len // ratio)``: q ``[B, next_n, H, 128]`` FP8
   (its scale folded into ``weights`` ``[B * next_n, H]`` fp32), the index cache as
   ``[pages, 64, 1, 132]``, ``context_lens`` ``[B, next_n]`` int32 (each row's valid
   entries), the schedule from ``get_paged_mqa_logits_metadata(context_lens, 64, sms)``
   (built by vLLM's metadata builder once per step, outside the op: not timed here),
   fp32 logits ``[B * next_n, max_entries]`` whose columns past a row's length are not
   written;
2. ``torch.ops._C.cooperative_topk`` up to 64 rows, ``persistent_topk`` above (vLLM's
   "auto" choice on SM90 for top-k 512/1024/2048), with vLLM's 1 MiB workspace and its
   host bound ``max_seq_len`` (the step's longest context in tokens), into the top-k
   buffer vLLM clears to -1 before.

Nothing of vLLM is in this repository: ``python3 -m benchmarks.support.fetch_vllm_indexer``
stages the files from the wheel into ``.vllm_indexer`` (or ``DSV4_VLLM_INDEXER``).
Loading needs no vLLM install: the vendored ``deep_gemm`` package is imported from the
folder (its ``_C`` loads its own extension), the top-k library with
``torch.ops.load_library``.  Where the folder, the GPU or a load is missing,
:func:`load` returns None with the reason and the benchmark says so.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ENV = "DSV4_VLLM_INDEXER"
RELEASE = "0.33.0"
LABEL = "vLLM 0.33 (DeepGEMM + top-k)"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FOLDER = ROOT / ".vllm_indexer"
TOPK_LIBRARY = "topk/_C_stable_libtorch.abi3.so"
FETCH = "python3 -m benchmarks.support.fetch_vllm_indexer --out .vllm_indexer"
COOPERATIVE_MAX_ROWS = 64  # vLLM's AUTO_COOPERATIVE_MAX_ROWS
TOPK_WORKSPACE_BYTES = 1 << 20  # vLLM's RADIX_TOPK_WORKSPACE_SIZE

_STATE: dict[str, tuple[Any, str]] = {}


def folder() -> Path:
    return Path(os.environ.get(ENV) or DEFAULT_FOLDER)


def _load(base: Path) -> Any:
    if not torch.cuda.is_available():
        raise ImportError("no CUDA device")
    library = base / TOPK_LIBRARY
    if not (base / "deep_gemm" / "_C.py").is_file() or not library.is_file():
        raise ImportError(
            f"vLLM {RELEASE}'s DeepGEMM (deep_gemm/) or top-k ({TOPK_LIBRARY}) is not at {base} "
            f"(stage them with `{FETCH}` and carry the folder, or set {ENV})"
        )
    if str(base) not in sys.path:
        sys.path.insert(0, str(base))
    deep_gemm = importlib.import_module("deep_gemm")
    if not str(getattr(deep_gemm, "__file__", "")).startswith(str(base)):
        raise ImportError(f"another deep_gemm is imported ({deep_gemm.__file__})")
    torch.ops.load_library(str(library))
    for op in ("cooperative_topk", "persistent_topk"):
        if not hasattr(torch.ops._C, op):
            raise ImportError(f"{library} loaded but registered no torch.ops._C.{op}")
    for fn in ("fp8_fp4_paged_mqa_logits", "get_paged_mqa_logits_metadata"):
        if not callable(getattr(deep_gemm, fn, None)):
            raise ImportError(f"the staged deep_gemm has no {fn}")
    return deep_gemm


def load(base: Path | None = None) -> tuple[Any, str]:
    """(the staged ``deep_gemm`` module, "") or (None, why not), once per process."""
    base = folder() if base is None else base
    key = str(base)
    if key not in _STATE:
        try:
            _STATE[key] = (_load(base), "")
        except Exception as exc:  # ImportError, OSError from dlopen, ...
            _STATE[key] = (None, f"{type(exc).__name__}: {exc}")
    return _STATE[key]


def runner(
    deep_gemm: Any,
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_entries: int,
    topk: int,
    max_seq_len: int,
    out: torch.Tensor,
) -> Callable[[], None]:
    """vLLM's decode indexer step (module docstring) as one callable: ``q`` ``[B, next_n,
    H, 128]``, ``context_lens`` ``[B, next_n]``, ``cache`` ``[pages, entries, 132]``,
    ``out`` ``[B * next_n, topk]`` int32 (cleared to -1 first, as vLLM does)."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    entries = int(cache.shape[1])
    schedule = deep_gemm.get_paged_mqa_logits_metadata(context_lens, entries, sms)
    cache4d = cache.unsqueeze(-2)
    workspace = torch.empty(TOPK_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    rows = int(q.shape[0] * q.shape[1])
    topk_op = (
        torch.ops._C.cooperative_topk
        if rows <= COOPERATIVE_MAX_ROWS
        else torch.ops._C.persistent_topk
    )

    def run() -> None:
        out.fill_(-1)
        logits = deep_gemm.fp8_fp4_paged_mqa_logits(
            (q, None), cache4d, weights, context_lens, block_table, schedule, max_entries
        )
        topk_op(logits, context_lens, out, workspace, topk, max_seq_len)

    return run

"""SASS fingerprints of every kernel dsv4_kernels launches, compiled offline for sm_90.

``python -m benchmarks.support.sass_fingerprint --out FILE [--compare OLD]``

For a refactor of kernel code that must not change what the GPU runs (renamed or
regrouped parameters, constants moved, helpers merged), with no GPU at hand: run it
before the change (``--out before.json``) and after (``--compare before.json``); it
exits 1 and lists the kernels whose machine code differs.  A set of public calls on
CPU tensors (:data:`CALLS`: sparse MLA per token and grouped, the Gluon and Triton
kernels, the ASM tile variant, the decode's split kernels and combine at 1-2 tokens
per request, the K-cache insert and gather) goes through the real wrappers, with
every launch replaced by an offline compile for an H100/H200 (``GPUTarget("cuda",
90, 32)``, :mod:`.compile_sm90`); each compiled kernel is named by its SASS's hash
(instruction lines only) and instruction count, with the calls that made it.
Needs Triton's NVIDIA backend (the PyPI wheel) and no ``TRITON_INTERPRET``; it
patches Triton's launch for the whole process, so it runs as its own process.
Kernels compile without line information (``TRITON_DISABLE_LINE_INFO=1``): the
``.loc`` lines alone can change ptxas's register allocation and scheduling, so a helper
moved to another file or line would otherwise read as a change of machine code while
the kernel's IR is the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .compile_sm90 import _cuobjdump, compile_offline

COMPILED: list[tuple[str, str, Any]] = []
_LABEL = [""]


def _patch_launches() -> None:
    """Every ``kernel[grid](...)`` of every Triton/Gluon kernel compiles instead of running,
    and every dsv4_kernels wrapper takes CPU tensors for a GPU's."""
    from triton.runtime.jit import JITFunction

    def getitem(self: Any, grid: Any) -> Callable[..., None]:
        def compile_only(*args: Any, **kwargs: Any) -> None:
            COMPILED.append((_LABEL[0], self.__name__, compile_offline(self, args, kwargs)))

        return compile_only

    JITFunction.__getitem__ = getitem  # type: ignore[method-assign]
    import dsv4_kernels  # noqa: F401  (imports every kernel module)

    for name, module in list(sys.modules.items()):
        if name.startswith("dsv4_kernels") and hasattr(module, "use_triton"):
            module.use_triton = lambda device: True


def _calls() -> None:
    import dsv4_kernels as dk
    from dsv4_kernels import sparse_mla as sm
    from dsv4_kernels._sparse_mla_tiles import TILES
    from dsv4_kernels.geometry import page_stride_bytes
    from dsv4_kernels.testing import decode as td
    from dsv4_kernels.testing.common import generator
    from dsv4_kernels.testing.k_cache import random_keys

    cpu = torch.device("cpu")
    g = generator(1)
    scratch = dk.make_decode_scratch(dk.decode_scratch_sizes(8, 64, 1200, cpu), cpu)
    i32 = dict(dtype=torch.int32)
    for wgmma in (True, False):
        sm._hopper_runs_wgmma = lambda device, w=wgmma: w  # type: ignore[assignment]
        for layer in ("swa", "c4a", "c128a"):
            pools = td.make_pools(layer, swa_pages=16, comp_pages=64, generator=g, device=cpu)
            for heads in (8, 16, 32):
                for per_req in (1, 2):
                    case = td.make_decode_case(
                        layer, 2, per_req, heads, context=1000, generator=g, device=cpu,
                        pools=pools, topk=64,
                    )  # fmt: skip
                    r, kw = case.rows, case.kwargs(case.rows)
                    for splits in (1, 3):  # the per-token kernel; split kernels + combine
                        _LABEL[0] = (
                            f"decode wgmma={wgmma} {layer} h={heads} mtp={per_req} s={splits}"
                        )
                        dk.sparse_mla_decode(
                            case.q, pools.swa.cache, r.swa_indices, r.swa_lens, 0.04,
                            scratch=scratch, num_splits=splits, **kw,
                        )  # fmt: skip
                    if layer == "c4a" or per_req > 1 or heads > 16:
                        continue
                    T = case.q.shape[0]
                    grouped: dict[str, Any] = dict(
                        leads=(torch.arange(T) // 2 * 2).to(torch.int32), group_size=2,
                        swa_starts=torch.zeros(T, **i32),  # type: ignore[arg-type]
                    )  # fmt: skip
                    if "comp_indices" in kw:
                        grouped["comp_starts"] = torch.zeros(T, **i32)  # type: ignore[arg-type]
                    _LABEL[0] = f"grouped wgmma={wgmma} {layer} h={heads}"
                    dk.sparse_mla_paged(case.q, pools.swa.cache, r.swa_indices, r.swa_lens, 0.04,
                                        **kw, **grouped)  # fmt: skip
    sm._hopper_runs_wgmma = lambda device: False  # type: ignore[assignment]
    asm = {c: {**t, "ASM": 1} for c, t in TILES.items()}  # the Triton kernel's int32 words
    for layer in ("swa", "c4a"):
        pools = td.make_pools(layer, swa_pages=16, comp_pages=64, generator=g, device=cpu)
        for heads in (8, 32):
            case = td.make_decode_case(layer, 2, 1, heads, context=1000, generator=g, device=cpu,
                                       pools=pools, topk=64)  # fmt: skip
            r = case.rows
            _LABEL[0] = f"asm {layer} h={heads}"
            dk.sparse_mla_paged(case.q, pools.swa.cache, r.swa_indices, r.swa_lens, 0.04,
                                tiles=asm, **case.kwargs(r))  # fmt: skip
    for bs in (64, 2):
        cache = torch.zeros(8, page_stride_bytes(bs), dtype=torch.uint8)
        _LABEL[0] = f"k-cache insert block_size={bs}"
        dk.quantize_and_insert_k_cache(random_keys(4, generator=g, device=cpu), cache,
                                       torch.arange(4), bs)  # fmt: skip
        out = torch.empty(1, 16, 512, dtype=torch.bfloat16)
        _LABEL[0] = f"k-cache gather block_size={bs}"
        dk.dequantize_and_gather_k_cache(out, cache, torch.tensor([4]), None,
                                         torch.arange(8).view(1, 8), bs, 1)  # fmt: skip


def fingerprints() -> dict[str, list[str]]:
    """``{"kernel:sass-hash:instructions": [calls that compiled it]}``."""
    _patch_launches()
    _calls()
    found: dict[str, set[str]] = {}
    for label, name, kernel in COMPILED:
        sass = _cuobjdump(kernel.asm["cubin"], "-sass")
        lines = [ln for ln in sass.splitlines() if "/*" in ln and "Function" not in ln]
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
        found.setdefault(f"{name}:{digest}:{len(lines)}", set()).add(label)
    return {k: sorted(v) for k, v in sorted(found.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.support.sass_fingerprint", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, help="write the fingerprints (JSON) here")
    p.add_argument("--compare", type=Path, help="fingerprints written before a change")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("run without TRITON_INTERPRET: the interpreter replaces Triton's compiler")
    # the code, not its line table (see the module docstring)
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    found = fingerprints()
    kernels = {k.split(":")[0] for k in found}
    print(f"{len(COMPILED)} compiles, {len(found)} distinct kernels ({', '.join(sorted(kernels))})")
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    if args.compare:
        lines = differences(json.loads(args.compare.read_text()), found)
        print("\n".join(lines) if lines else "identical machine code")
        return 1 if lines else 0
    return 0


def differences(old: dict[str, list[str]], new: dict[str, list[str]]) -> list[str]:
    """One line per kernel whose machine code is only in ``old`` or only in ``new``, then
    ``MACHINE CODE DIFFERS``; empty when both hold the same kernels."""
    lines = [f"only before: {k} ({old[k][0]}, ...)" for k in sorted(set(old) - set(new))]
    lines += [f"only after:  {k} ({new[k][0]}, ...)" for k in sorted(set(new) - set(old))]
    return [*lines, "MACHINE CODE DIFFERS"] if lines else []


if __name__ == "__main__":
    raise SystemExit(main())

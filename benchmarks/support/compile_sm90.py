"""Compile the sparse MLA kernels for sm_90 on a machine without a GPU: registers, spills, size.

``python -m benchmarks.support.compile_sm90 [--case NAME] [--variants a,b] [--group G]
[--sass DIR]``

Runs each named variant of :data:`benchmarks.support.sparse_mla_variants.VARIANTS` (or
``default``, the shipped tiles of :data:`dsv4_kernels.sparse_mla.TILES`: the
default) through the public ``sparse_mla_paged`` call on CPU tensors of the case's
compile-time shape, with the launch replaced by an offline compile for an H100/H200
(``GPUTarget("cuda", 90, 32)``), and prints one JSON line per compiled kernel:
registers per thread, stack (spill) bytes, shared memory, SASS instructions, and
the local-memory stores and loads in the SASS.  ``--sass DIR`` also writes each
variant's SASS there.  Needs a Triton with its NVIDIA backend (the PyPI wheel: its
``ptxas`` and ``cuobjdump`` are bundled) and no ``TRITON_INTERPRET``; nothing runs
on a GPU, so this says what the compiler made, never how fast it is.  The CPU
suite runs it (``tests/kernels/test_codegen_sparse_mla.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch


@functools.cache
def _compiler() -> tuple[Any, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    return target, make_backend(target)


class _Offline:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kw)`` compiles, never runs."""

    def __init__(self, fn: Any, sink: list[Any]) -> None:
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid: Any) -> Any:
        def compile_only(*args: Any, **kwargs: Any) -> None:
            self.sink.append((self.fn.__name__, compile_offline(self.fn, args, kwargs)))

        return compile_only


def compile_offline(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The kernel ``fn[grid](*args, **kwargs)`` would launch, compiled for sm_90 (no GPU)."""
    from triton.compiler import ASTSource
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target, backend = _compiler()
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    source = GluonASTSource if fn.is_gluon() else ASTSource
    return tcompile(
        source(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    from triton.backends.nvidia import __file__ as nv

    tool = Path(nv).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), *flags, f.name], capture_output=True, text=True).stdout


def compile_variant(
    case: str, tiles: dict[str, int] | None, group: int = 0, blocks: bool = False
) -> list[tuple[str, Any]]:
    """The kernels one ``sparse_mla_paged`` call of ``case`` launches with ``tiles``
    (on grouped rows of ``group`` tokens when it is 2 or more: SWA-only and C128A;
    ``tiles`` None: the shipped ones; ``blocks``: C128A's rows as ``BlockRows``)."""
    from dsv4_kernels import _gluon_sparse_mla as g
    from dsv4_kernels import _triton_sparse_mla as k
    from dsv4_kernels import sparse_mla as sm

    from ..inputs_sparse_mla import MATRIX, make_inputs
    from .sparse_mla_variants import head_class, tiny_shape

    shape = next(s for s in MATRIX if s.name.startswith(case))
    compiled: list[tuple[str, Any]] = []
    saved = (sm._hopper_runs_wgmma, sm.use_triton, g._sparse_mla_wgmma_kernel, k._sparse_mla_kernel)
    try:
        # the CPU tensors stand for an H100/H200's: the call's own checks still choose
        sm._hopper_runs_wgmma = lambda device: True  # type: ignore[assignment]
        sm.use_triton = lambda device: True  # type: ignore[assignment]
        g._sparse_mla_wgmma_kernel = _Offline(saved[2], compiled)  # type: ignore[assignment]
        k._sparse_mla_kernel = _Offline(saved[3], compiled)  # type: ignore[assignment]
        table = None if tiles is None else {head_class(shape.heads): tiles}
        inp = make_inputs(tiny_shape(shape), torch.device("cpu"), 1, tiles=table)
        T, H, _ = inp.q.shape
        out = torch.empty((T, H, 512), dtype=torch.bfloat16)
        lse = torch.empty((T, H), dtype=torch.float32)
        if group > 1:
            inp.run_paged(out, lse, inp.build_grouped(group, blocks))
        else:
            inp.run_paged(out, lse, inp.build_blocks() if blocks else None)
    finally:
        sm._hopper_runs_wgmma, sm.use_triton = saved[0], saved[1]  # type: ignore[assignment]
        g._sparse_mla_wgmma_kernel, k._sparse_mla_kernel = saved[2], saved[3]  # type: ignore
    return compiled


def describe(kernel: Any) -> dict[str, Any]:
    cubin = kernel.asm["cubin"]
    usage = _cuobjdump(cubin, "-res-usage")
    sass = _cuobjdump(cubin, "-sass")
    field = {m[0]: int(m[1]) for m in re.findall(r"(REG|STACK):(\d+)", usage)}
    return dict(
        registers=field.get("REG"),
        stack_bytes=field.get("STACK"),
        shared_bytes=kernel.metadata.shared,
        sass_instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),
        local_stores=len(re.findall(r"\bSTL\b", sass)),
        local_loads=len(re.findall(r"\bLDL\b", sass)),
        sass=sass,
    )


def main(argv: list[str] | None = None) -> int:
    from .sparse_mla_variants import VARIANTS

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.support.compile_sm90", description=__doc__.split("\n")[0]
    )
    p.add_argument("--case", default="c4a-flash-tp8-1x16384")
    p.add_argument(
        "--variants",
        default="default",
        help="names in benchmarks.support.sparse_mla_variants.VARIANTS, or default (shipped tiles)",
    )
    p.add_argument("--group", type=int, default=0, help="grouped rows of this many tokens")
    p.add_argument("--sass", type=Path, help="write each variant's SASS into this folder")
    p.add_argument(
        "--blocks", action="store_true", help="C128A rows as BlockRows (read through the table)"
    )
    args = p.parse_args(argv)
    known: dict[str, dict[str, int] | None] = {
        name: tiles for cls in VARIANTS.values() for name, tiles in cls
    }
    known["default"] = None
    names = [n for n in args.variants.split(",") if n]
    if unknown := [n for n in names if n not in known]:
        p.error(f"--variants: unknown {unknown}; known: {sorted(known)}")
    for name in names:
        for kernel_name, kernel in compile_variant(args.case, known[name], args.group, args.blocks):
            info = describe(kernel)
            sass = info.pop("sass")
            if args.sass:
                args.sass.mkdir(parents=True, exist_ok=True)
                (args.sass / f"{args.case}-{name}.sass").write_text(sass)
            row = dict(case=args.case, variant=name, group=args.group, kernel=kernel_name,
                       blocks=args.blocks)  # fmt: skip
            print(json.dumps({**row, **info}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

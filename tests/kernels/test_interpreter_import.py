"""The CPU path through Triton's interpreter: its runtime needs, and the documented example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import dsv4_kernels

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "packages" / "dsv4-kernels" / "pyproject.toml"
DOCS = (ROOT / "docs" / "kernels.md", ROOT / "packages" / "dsv4-kernels" / "README.md")
EXPECTED = "[8, 9, 10, 3, 4] [0, 1, 2, 3, 4, 5, 6, 7]\nmatches the torch reference: True\n"


def test_numpy_is_a_runtime_dependency():
    """``TRITON_INTERPRET=1`` imports numpy (triton/runtime/interpreter.py): not only for tests."""
    # The [project] dependencies list (tomllib is Python 3.11+; the package supports 3.10).
    match = re.search(r"^dependencies = \[(.*?)^\]", PYPROJECT.read_text(), re.S | re.M)
    assert match is not None, "no dependencies list in pyproject.toml"
    deps = re.findall(r'^\s*"([^"]+)"', match.group(1), re.M)
    names = [re.split(r"[<>=!~ ;\[]", dep, maxsplit=1)[0] for dep in deps]
    assert {"torch", "triton", "numpy"} <= set(names), deps


def test_the_interpreter_imports_numpy():
    """Why numpy is a dependency: without it ``import dsv4_kernels`` fails under the interpreter."""
    code = "import sys; sys.modules['numpy'] = None; import dsv4_kernels"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": _pythonpath()}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0 and "numpy" in proc.stderr, proc.stderr[-2000:]


def _pythonpath() -> str:
    src = str(Path(dsv4_kernels.__file__).resolve().parent.parent)
    return os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])


def _example(path: Path) -> str:
    """The ``TRITON_INTERPRET=1 python -c '...'`` block of a document: the Python code."""
    blocks = re.findall(
        r"```sh\nTRITON_INTERPRET=1 python -c '\n(.*?)\n'\n```", path.read_text(), re.S
    )
    assert len(blocks) == 1, f"{path}: expected one CPU example, found {len(blocks)}"
    return blocks[0]


def test_the_documented_cpu_example_runs_and_prints_what_the_docs_say():
    code = {path.name: _example(path) for path in DOCS}
    assert len(set(code.values())) == 1, "docs/kernels.md and the package README differ"
    for path in DOCS:
        assert "```text\n" + EXPECTED + "```" in path.read_text(), path
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": _pythonpath()}
    proc = subprocess.run(
        [sys.executable, "-c", next(iter(code.values()))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == EXPECTED

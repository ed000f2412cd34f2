"""The shipped catalogue: each node type's presets carry the kernels, graphs and roles."""

from __future__ import annotations

import pytest

from dsv4_presets import resolve_serve
from dsv4_presets.presets import serve_preset_names


@pytest.mark.parametrize(
    ("name", "hopper", "sets"),
    [
        ("b200-tp8-ep", "h200-tp8-ep", []),
        ("b200-dp8-ep", "h200-dp8-ep", []),
        ("b300-tp8-ep", "h200-tp8-ep", ["enable-prefix-caching=true"]),
        ("gb200-tp4-ep", "h200-tp8-ep", ["enable-prefix-caching=true", "tensor-parallel-size=4"]),
    ],
)
def test_blackwell_presets_run_the_recipes_kernels(name, hopper, sets):
    blackwell = resolve_serve(name)
    h200 = resolve_serve(hopper, sets=sets)
    assert blackwell.hardware["arch"] == "blackwell" and h200.hardware["arch"] == "hopper"
    extra = {k: v for k, v in blackwell.args.items() if h200.args.get(k) != v}
    assert extra == {
        "moe-backend": "deep_gemm_mega_moe",
        "attention-config": {"indexer_kv_dtype": "mxfp4"},
    }
    argv = blackwell.to_argv()
    assert argv[argv.index("--attention-config") + 1] == '{"indexer_kv_dtype": "mxfp4"}'


@pytest.mark.parametrize(
    "name",
    [n for n in serve_preset_names() if "-dp" in n or n.startswith("dp")],
)
def test_data_parallel_presets_use_the_recipes_cuda_graphs(name):
    config = resolve_serve(name, sets=["data-parallel-address=10.0.0.1"])
    assert config.args["data-parallel-size"] > 1
    assert config.args["compilation-config"] == {
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "custom_ops": ["all"],
    }


def test_every_node_type_has_a_latency_and_a_throughput_preset():
    names = set(serve_preset_names())
    for gpu, tp, dp in (
        ("h200", "tp8", "dp8"),
        ("b200", "tp8", "dp8"),
        ("b300", "tp8", "dp8"),
        ("gb200", "tp4", "dp4"),
        ("mi355x", "tp8", "dp8"),
    ):
        latency, throughput = f"{gpu}-{tp}-ep", f"{gpu}-{dp}-ep"
        assert {latency, throughput} <= names
        assert "latency" in resolve_serve(latency).description
        assert "throughput" in resolve_serve(throughput).description


def test_long_context_preset_fits_the_deepest_reasoning_mode():
    config = resolve_serve("h200-dp8-ep-long")
    assert config.args["max-model-len"] >= 393_216
    assert config.purpose == "production"


def test_prefill_decode_split_renders_every_role_and_the_router(capsys):
    from dsv4_presets.cli import main

    for name, connector in (("h200-pd-nixl", "NixlConnector"), ("h200-pd-mooncake", "Mooncake")):
        config = resolve_serve(name)
        assert config.same_host and config.node_names == ["prefill", "decode", "router"]
        prefill, decode = config.for_node("prefill"), config.for_node("decode")
        assert prefill.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert decode.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
        assert connector in prefill.args["kv-transfer-config"]["kv_connector"]
        assert main(["render", name]) == 0
        out = capsys.readouterr().out
        assert "vllm-router --pd-disaggregation --prefill http://127.0.0.1:8100" in out
        assert out.count("vllm serve ") == 2

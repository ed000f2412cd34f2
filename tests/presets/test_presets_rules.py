"""Every rule with a passing and a failing case, checked without vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_presets import Finding, resolve_bench, resolve_serve, validate
from dsv4_presets.presets import bench_preset_names, serve_preset_names
from dsv4_presets.rules import SERVE_RULES

ADDR = "data-parallel-address=10.0.0.1"


def rules_hit(findings: list[Finding], level: str | None = None) -> set[str]:
    return {f.rule for f in findings if level is None or f.level == level}


def serve(name: str = "h200-tp8-ep", *sets: str, **kw):
    return resolve_serve(name, sets=list(sets), **kw)


@pytest.mark.parametrize("name", serve_preset_names())
def test_every_shipped_serve_preset_passes(name):
    findings = validate(serve(name, ADDR), with_vllm=False)
    assert findings == []


@pytest.mark.parametrize("name", bench_preset_names())
def test_every_shipped_bench_preset_passes(name):
    assert validate(resolve_bench(name), with_vllm=False) == []


# (rule, overrides that break it, text the message must contain to say what to change)
FAILING = [
    ("kv-cache-fp8", ["kv-cache-dtype=auto"], "set kv-cache-dtype: fp8"),
    ("kv-cache-fp8", ["kv-cache-dtype=fp8_e5m2"], "set kv-cache-dtype: fp8"),
    ("kv-cache-fp8", ["kv-cache-dtype=null"], "set kv-cache-dtype: fp8"),
    ("block-size-256", ["block-size=128"], "set block-size: 256"),
    ("block-size-256", ["block-size=null"], "set block-size: 256"),
    ("kernel-platform", ["moe-backend=flashinfer_trtllm"], "remove moe-backend"),
    ("kernel-platform", ["moe-backend=deep_gemm_mega_moe"], "SM100"),
    ("kernel-platform", ["attention-config.indexer_kv_dtype=mxfp4"], "use a Blackwell preset"),
    ("kernel-platform", ["moe-backend=aiter"], "ROCm only"),
    (
        "kernel-platform",
        ["attention-backend=FLASHINFER_MLA_SPARSE_DSV4"],
        "remove attention-backend",
    ),
    (
        "mega-moe-expert-parallel",
        ["moe-backend=deep_gemm_mega_moe", "enable-expert-parallel=false"],
        "set enable-expert-parallel: true",
    ),
    (
        "indexer-cache",
        ["attention-config.use_fp4_indexer_cache=true"],
        "indexer_kv_dtype: mxfp4 instead",
    ),
    ("indexer-cache", ["attention-config.indexer_kv_dtype=bf16"], "takes only auto, fp8, mxfp4"),
    ("speculative-method", ["speculative-config.method=eagle3"], "use method: dspark"),
    # The 0731 checkpoint ships a DSpark drafter: MTP would half-load it.
    ("speculative-method", ["speculative-config.method=mtp"], "use method: dspark"),
    ("speculative-method", ["speculative-config.method=deepseek_mtp"], "not an MTP head"),
    ("max-model-len", ["max-model-len=2M"], "at most 1048576"),
    ("tp-fp8-alignment", ["tensor-parallel-size=3"], "use one of 1, 2, 4, 8, 16, 32, 64"),
    ("tp-fp8-alignment", ["tensor-parallel-size=6"], "64 attention heads"),
    ("auto-tool-choice-parser", ["tool-call-parser=null"], "set tool-call-parser: deepseek_v4"),
    ("checkpoint-parsers", ["reasoning-parser=deepseek_r1"], "set reasoning-parser: deepseek_v4"),
    ("checkpoint-parsers", ["tokenizer-mode=hf"], "set tokenizer-mode: deepseek_v4"),
    ("gpus-per-node", ["data-parallel-size=2"], "lower tensor-parallel-size"),
    ("unknown-option", ["kv-cache-dtyp=fp8"], "did you mean 'kv-cache-dtype'?"),
    ("unknown-option", ["enable-expert-paralel=true"], "did you mean 'enable-expert-parallel'?"),
    ("bad-value", ["tensor-parallel-size=eight"], "expected an integer"),
    ("bad-value", ["enable-expert-parallel=yes-please"], "expected true or false"),
    ("bad-value", ["dtype=fp4"], "is not one of"),
    ("bad-value", ["speculative-config=7"], "expected a mapping"),
    ("bad-value", ["max-num-batched-tokens=lots"], "16384 or 16k"),
    # Parsed by vLLM's parser, refused by its config classes at start-up (issue 31).
    ("bad-value", ["tensor-parallel-size=-1"], "tensor-parallel-size: expected an integer >= 1"),
    ("bad-value", ["tensor-parallel-size=0"], "tensor-parallel-size: expected an integer >= 1"),
    ("bad-value", ["pipeline-parallel-size=-2"], "expected an integer >= 1, got -2"),
    ("bad-value", ["max-num-batched-tokens=-5"], "expected an integer >= 1, got -5"),
    ("bad-value", ["max-num-batched-tokens='-5'"], "expected an integer >= 1, got '-5'"),
    ("bad-value", ["max-num-seqs=0"], "max-num-seqs: expected an integer >= 1"),
    ("bad-value", ["max-model-len=0"], "or -1 (auto"),
    ("bad-value", ["max-model-len=-2"], "or -1 (auto"),
    # vLLM's --max-model-len takes "auto" (any case) and "-1", nothing else that is not a number.
    ("bad-value", ["max-model-len=autox"], "16384 or 16k, or auto (-1), got 'autox'"),
    ("bad-value", ["max-model-len=auto1"], "16384 or 16k, or auto (-1), got 'auto1'"),
    ("bad-value", ["max-model-len=max"], "16384 or 16k, or auto (-1), got 'max'"),
    ("bad-value", ["max-num-batched-tokens=auto"], "16384 or 16k, got 'auto'"),
    ("bad-value", ["block-size=0"], "block-size: expected an integer >= 1"),
    ("bad-value", ["data-parallel-size-local=-1"], "expected an integer >= 0, got -1"),
    ("unknown-env", ["env.VLLM_USE_DEEPGEM=1"], "not one vLLM"),
]


@pytest.mark.parametrize(("rule", "sets", "fix"), FAILING)
def test_rule_fails_with_a_message_that_says_what_to_change(rule, sets, fix):
    findings = validate(serve("h200-tp8-ep", *sets), with_vllm=False)
    hits = [f for f in findings if f.rule == rule]
    assert hits, findings
    assert all(f.level == "error" for f in hits)
    assert any(fix in f.message for f in hits), [f.message for f in hits]


# Overrides that look related to a rule but are fine.
PASSING = [
    ("kv-cache-fp8", ["kv-cache-dtype=fp8_ds_mla"]),
    ("block-size-256", ["block-size=256"]),
    ("speculative-method", ["speculative-config.method=dspark"]),
    (
        "speculative-method",
        ["speculative-config.method=dspark", "speculative-config.num_speculative_tokens=3"],
    ),
    ("max-model-len", ["max-model-len=393216"]),
    ("max-model-len", ["max-model-len=1M"]),
    ("speculative-method", ["speculative-config.method=ngram"]),
    ("speculative-method", ["speculative-config.method=eagle3", "speculative-config.model=/d"]),
    ("tp-fp8-alignment", ["tensor-parallel-size=4"]),
    ("tp-fp8-alignment", ["tensor-parallel-size=2", "data-parallel-size=4"]),
    ("auto-tool-choice-parser", ["tool-call-parser=null", "enable-auto-tool-choice=false"]),
    ("checkpoint-parsers", ["tokenizer-mode=auto"]),
    ("bad-value", ["max-num-batched-tokens=16k"]),
    ("bad-value", ["max-model-len=-1"]),  # vLLM's "auto"
    ("bad-value", ["max-model-len=auto"]),
    ("bad-value", ["max-model-len=AUTO"]),
    ("max-model-len", ["max-model-len=auto"]),  # the longest that fits: no context to compare
    ("bad-value", ["data-parallel-size-local=0"]),  # vLLM's external-DP sentinel
    ("bad-value", ["max-num-seqs=1"]),
    ("bad-value", ["gpu-memory-utilization=0.9"]),
    ("unknown-env", ["env.VLLM_LOGGING_LEVEL=INFO"]),
]


@pytest.mark.parametrize(("rule", "sets"), PASSING)
def test_rule_passes(rule, sets):
    findings = validate(serve("h200-tp8-ep", *sets), with_vllm=False)
    assert rule not in rules_hit(findings)
    assert not [f for f in findings if f.level == "error"], findings


def test_blackwell_options_pass_on_b200():
    config = serve("b200-tp8-ep", "attention-backend=FLASHINFER_MLA_SPARSE_DSV4")
    assert "kernel-platform" not in rules_hit(validate(config, with_vllm=False))


def test_mtp_is_accepted_only_for_a_checkpoint_that_declares_an_mtp_head(tmp_path: Path):
    path = tmp_path / "mtp-ckpt.yaml"
    path.write_text(
        "dsv4:\n  extends: [h200-tp8-ep, feature/mtp]\n"
        "  checkpoint: {name: ckpt-with-mtp, num_attention_heads: 64, head_dim: 512,"
        " fp8_weight_block: 128, drafter: mtp}\n"
    )
    assert validate(resolve_serve(str(path)), with_vllm=False) == []
    dspark = validate(
        resolve_serve(str(path), sets=["speculative-config.method=dspark"]), with_vllm=False
    )
    assert [f.rule for f in dspark] == ["speculative-method"]
    assert "ships an MTP head, not a DSpark drafter" in dspark[0].message


def test_dspark_preset_drafts_with_the_recipe_settings():
    config = serve("h200-tp8-ep-dspark")
    assert config.checkpoint["drafter"] == "dspark"
    assert config.args["speculative-config"] == {
        "method": "dspark",
        "num_speculative_tokens": 7,
        "draft_sample_method": "probabilistic",
    }
    many = validate(serve("h200-tp8-ep-dspark", "speculative-config.num_speculative_tokens=12"))
    assert [(f.level, f.rule) for f in many] == [("warning", "speculative-method")]


def test_rocm_presets_name_nvidia_kernels_as_such():
    config = serve("mi355x-tp8-ep", "moe-backend=deep_gemm_mega_moe")
    hits = [f for f in validate(config, with_vllm=False) if f.rule == "kernel-platform"]
    assert len(hits) == 1 and "is an NVIDIA kernel" in hits[0].message
    assert "runs ROCm" in hits[0].message and "Hopper" not in hits[0].message
    # The NVIDIA-only rule is not run there, and the report says so.
    from dsv4_presets import check

    report = check(serve("mi355x-tp8-ep"), with_vllm=False)
    assert report.findings == []
    assert any("mega-moe-expert-parallel is NVIDIA-specific" in n for n in report.notes)
    fp4 = validate(serve("mi355x-tp8-ep", "attention-config.indexer_kv_dtype=mxfp4"))
    assert [f.rule for f in fp4] == ["indexer-cache"] and "V4.1 only" in fp4[0].message


def test_same_host_split_rules():
    assert validate(serve("h200-pd-nixl"), with_vllm=False) == []
    assert validate(serve("h200-pd-mooncake"), with_vllm=False) == []
    too_big = validate(serve("h200-pd-nixl", "tensor-parallel-size=8"), with_vllm=False)
    assert "gpus-per-node" in rules_hit(too_big)
    assert any("prefill 8 + decode 8 = 16 GPUs" in f.message for f in too_big)
    assert "same-host-split" in rules_hit(too_big)  # 4 visible GPUs for an 8-GPU role
    shared = validate(serve("h200-pd-nixl", "port=9000"), with_vllm=False)
    assert any("roles share a API port" in f.message for f in shared)
    same_role = validate(
        serve("h200-pd-mooncake", "kv-transfer-config.kv_role=kv_producer"), with_vllm=False
    )
    assert any("one kv_producer" in f.message for f in same_role)
    overlap = validate(serve("h200-pd-nixl", "env.CUDA_VISIBLE_DEVICES=0,1,2,3"), with_vllm=False)
    assert any("GPU 0 is given to both prefill and decode" in f.message for f in overlap)


def test_benchmark_prefix_caching_is_a_warning():
    on = validate(serve("h200-tp8-ep", "enable-prefix-caching=true"), with_vllm=False)
    assert [(f.level, f.rule) for f in on] == [("warning", "benchmark-prefix-caching")]
    assert "set enable-prefix-caching: false" in on[0].message
    default = validate(serve("h200-tp8-ep", "enable-prefix-caching=null"), with_vllm=False)
    assert rules_hit(default) == {"benchmark-prefix-caching"}
    # Production presets keep prefix caching on without a warning.
    prod = validate(serve("dp16-ep-2node", ADDR), with_vllm=False)
    assert prod == []


def test_required_setting():
    findings = validate(serve("dp16-ep-2node"), with_vllm=False)
    assert rules_hit(findings) == {"required-setting"}
    assert "--set data-parallel-address=" in findings[0].message
    assert len(findings) == 1  # reported once, not once per node


def test_dp_topology_rules():
    # Start rank not a multiple of the local size (on the worker node only).
    found = validate(serve("dp16-ep-2node", ADDR, node="worker"), with_vllm=False)
    assert found == []
    bad = resolve_serve("dp16-ep-2node", sets=[ADDR, "data-parallel-size-local=6"])
    hits = [f for f in validate(bad, with_vllm=False) if f.rule == "dp-topology"]
    assert any("not a multiple of data-parallel-size-local" in f.message for f in hits)
    assert any(f.message.startswith("node worker: ") for f in hits)
    headless_head = serve("h200-dp8-ep", "headless=true")
    assert "needs data-parallel-start-rank" in " ".join(
        f.message for f in validate(headless_head, with_vllm=False)
    )
    no_addr = serve("h200-dp8-ep", "data-parallel-size=16", "data-parallel-size-local=8")
    msgs = [f.message for f in validate(no_addr, with_vllm=False) if f.rule == "dp-topology"]
    assert any("data-parallel-address is not set" in m for m in msgs)
    ray_headless = serve("dp16-ep-ray", ADDR, "headless=true")
    assert "dp-topology" in rules_hit(validate(ray_headless, with_vllm=False))
    # vLLM's Ray backend finds the head's address itself: the preset needs none.
    assert validate(serve("dp16-ep-ray"), with_vllm=False) == []
    assert "data-parallel-address" not in serve("dp16-ep-ray").args


def test_unknown_keys_in_user_files_are_errors_not_dropped(tmp_path: Path):
    path = tmp_path / "typo.yaml"
    path.write_text("dsv4: {extends: h200-tp8-ep}\nenable-prefix-cache: false\n")
    config = resolve_serve(str(path))
    assert "--no-enable-prefix-cache" in config.to_argv()  # kept, so vLLM would see it
    findings = validate(config, with_vllm=False)
    assert [f.rule for f in findings if f.level == "error"] == ["unknown-option"]
    assert "did you mean 'enable-prefix-caching'?" in findings[0].message


def test_bench_rules():
    ok = resolve_bench("random-1024-64")
    assert validate(ok, with_vllm=False) == []
    no_temp = resolve_bench("random-1024-64", sets=["temperature=null", "ignore-eos=null"])
    assert rules_hit(validate(no_temp, with_vllm=False), "warning") == {
        "bench-temperature",
        "bench-ignore-eos",
    }
    typo = resolve_bench("random-1024-64", sets=["random-input-length=1024"])
    found = validate(typo, with_vllm=False)
    assert [f.rule for f in found] == ["unknown-option"]
    assert "did you mean 'random-input-len'?" in found[0].message
    bad = resolve_bench("random-1024-64", sets=["request-rate=fast"])
    assert rules_hit(validate(bad, with_vllm=False)) == {"bad-value"}


def test_every_rule_is_listed_and_has_a_failing_case():
    listed = {name.strip() for rule in SERVE_RULES for name in rule.name.split("/")}
    covered = {rule for rule, _, _ in FAILING} | {
        "benchmark-prefix-caching",
        "required-setting",
        "dp-topology",
        "same-host-split",
    }
    assert listed <= covered, listed - covered


def test_with_vllm_true_without_vllm_is_an_error(monkeypatch):
    import importlib

    v = importlib.import_module("dsv4_presets.validate")

    monkeypatch.setattr(v, "vllm_available", lambda: False)
    with pytest.raises(RuntimeError, match="with_vllm=True"):
        validate(serve(), with_vllm=True)
    assert validate(serve(), with_vllm=None) == []


def test_finding_level_is_checked():
    with pytest.raises(ValueError, match="level"):
        Finding("fatal", "x", "y")


@pytest.mark.parametrize("name", serve_preset_names())
def test_every_preset_names_its_minimum_vllm(name):
    from dsv4_presets.validate import version_tuple

    config = serve(name, ADDR)
    assert version_tuple(config.min_vllm or "") == (0, 32, 0)


def test_min_vllm_is_checked_against_the_installed_version():
    from dsv4_presets.validate import check_min_vllm, version_tuple

    config = serve("h200-tp8-ep-dspark")
    assert check_min_vllm(config, "0.32.0") == []
    assert check_min_vllm(config, "0.32.2.dev5+gabc") == []
    assert check_min_vllm(config, "1.0.0") == []
    old = check_min_vllm(config, "0.31.9")
    assert [f.rule for f in old] == ["vllm-version"]
    assert "needs vLLM >= 0.32.0" in old[0].message and "0.31.9" in old[0].message
    assert version_tuple("v0.32") == (0, 32, 0) and version_tuple("dev") is None


def _fake_vllm(monkeypatch, version):
    import importlib

    v = importlib.import_module("dsv4_presets.validate")
    fake = type(
        "FakeCheck",
        (),
        {
            "check_serve": staticmethod(lambda config: ([], [])),
            "vllm_version": staticmethod(lambda: version),
        },
    )
    monkeypatch.setattr(v, "vllm_available", lambda: True)
    monkeypatch.setitem(__import__("sys").modules, "dsv4_presets.vllm_check", fake)
    import dsv4_presets

    monkeypatch.setattr(dsv4_presets, "vllm_check", fake, raising=False)
    return v


@pytest.mark.parametrize("version", ["0.20.1", "0.31.9", "0.35.0", "1.0.0"])
def test_validate_refuses_a_vllm_release_it_does_not_know(monkeypatch, version):
    from dsv4_presets.vllm_releases import supported

    v = _fake_vllm(monkeypatch, version)
    report = v.check(serve("h200-tp8-ep"), with_vllm=True)
    assert [f.rule for f in report.errors] == ["vllm-release"]
    assert f"vLLM {version} is not a release" in report.errors[0].message
    assert f"(supported: {supported()})" in report.errors[0].message
    assert supported() == "0.32, 0.33, 0.34"
    assert report.vllm_version is None  # its checks did not run


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.2rc1+cu130", "0.34.0"])
def test_validate_on_a_supported_release_names_it(monkeypatch, version):
    v = _fake_vllm(monkeypatch, version)
    report = v.check(serve("h200-tp8-ep"), with_vllm=True)
    assert report.errors == []
    assert report.vllm_version == version and report.vllm_release == version[:4]


def test_int_minimums_name_integer_options_of_every_supported_release():
    """Each bounded option exists, as an integer option, in every shipped option table
    from the release that bounds it on."""
    from dsv4_presets.schema import (
        INT_MINIMUMS,
        INT_MINIMUMS_SINCE,
        INT_SPECIAL_VALUES,
        INT_TYPES,
        int_minimums,
        shipped_table,
    )
    from dsv4_presets.vllm_releases import RELEASES

    for command, minimums in INT_MINIMUMS.items():
        for release in RELEASES:
            table = shipped_table(command, release)
            bounded = int_minimums(command, release)
            assert set(minimums) <= set(bounded)
            for name in bounded:
                spec = table.get(name)
                assert spec is not None, (command, release, name)
                assert spec.type in INT_TYPES, (command, release, name)
        for name, specials in INT_SPECIAL_VALUES[command].items():
            assert all(value < minimums[name] for value in specials), name
        # a later bound is later: the oldest supported release does not have it
        oldest = min(RELEASES)
        for name, (first, _) in INT_MINIMUMS_SINCE[command].items():
            assert first > oldest and name not in int_minimums(command, oldest), name


def test_a_bound_applies_from_the_release_that_declares_it():
    """vLLM 0.34 bounds ``--seed`` at 0; 0.32 and 0.33 take any integer seed."""
    from dsv4_presets.schema import check_minimum

    assert check_minimum("serve", "seed", -7, (0, 33)) is None
    assert check_minimum("serve", "seed", -7, (0, 34)) == "expected an integer >= 0, got -7"
    assert check_minimum("serve", "seed", 7, (0, 34)) is None
    assert check_minimum("serve", "max-num-inflight-kv-loads", 0, (0, 34)) is not None
    # the rules check a preset against the option table of the release it is checked for
    from dsv4_presets.rules import check_options
    from dsv4_presets.schema import shipped_table

    for release in ("0.32", "0.33", "0.34"):
        found = check_options({"seed": -7}, shipped_table("serve", release), "vllm serve")
        assert [f.message for f in found] == (
            ["seed: expected an integer >= 0, got -7"] if release == "0.34" else []
        ), release


def test_check_minimum_reads_values_as_vllm_does():
    from dsv4_presets.schema import check_minimum

    assert check_minimum("serve", "tensor-parallel-size", 8) is None
    assert check_minimum("serve", "tensor_parallel_size", " -1 ") is not None
    assert check_minimum("serve", "max-num-batched-tokens", "16k") is None
    assert check_minimum("serve", "max-num-batched-tokens", "1_024") is None
    assert check_minimum("serve", "max-num-batched-tokens", "-1_024") is not None
    assert check_minimum("serve", "max-model-len", -1) is None
    assert check_minimum("serve", "max-model-len", "-1") is None
    assert check_minimum("serve", "max-model-len", "auto") is None
    assert check_minimum("serve", "max-model-len", " AUTO ") is None
    # A wrong type is check_value's finding, not this one's; unbounded options pass.
    assert check_minimum("serve", "tensor-parallel-size", "eight") is None
    assert check_minimum("serve", "seed", -7) is None
    assert check_minimum("bench", "num-warmups", 0) is None
    assert check_minimum("bench", "num-warmups", -1) == "expected an integer >= 0, got -1"

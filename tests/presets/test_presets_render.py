"""Resolving and rendering presets: the seed's golden command, layering, overrides, formats."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_presets import PresetError, resolve_bench, resolve_serve
from dsv4_presets.merge import bool_spellings
from dsv4_presets.presets import (
    layer_names,
    list_presets,
    parse_set,
    preset_kind,
    serve_preset_names,
)
from dsv4_presets.schema import INT_TYPES, check_value, shipped_table

# The seed PR's `vllm serve` command, verbatim.
SEED_SERVE = r"""
vllm serve deepseek-ai/DeepSeek-V4-Flash-0731 \
  --trust-remote-code \
  --kv-cache-dtype fp8 \
  --block-size 256 \
  --enable-expert-parallel \
  --tensor-parallel-size 8 \
  --tokenizer-mode deepseek_v4 \
  --tool-call-parser deepseek_v4 \
  --enable-auto-tool-choice \
  --reasoning-parser deepseek_v4 \
  --no-enable-prefix-caching \
  --max-num-batched-tokens 16384
"""

# The seed PR's `vllm bench serve` command, with $seed = 0 and our result file.
SEED_BENCH = r"""
vllm bench serve \
    --backend vllm \
    --base-url http://localhost:8000 \
    --model deepseek-ai/DeepSeek-V4-Flash-0731 \
    --dataset-name random \
    --random-input-len 1024 \
    --random-output-len 64 \
    --num-prompts 128 \
    --num-warmups 8 \
    --request-rate inf \
    --ignore-eos \
    --temperature 0 \
    --seed 0 \
    --save-result
"""


def shell_words(text: str) -> list[str]:
    """Split a shell command the way a shell does (backslash-newline joins lines)."""
    return shlex.split(text.replace("\\\n", " "))


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_golden_seed_command():
    config = resolve_serve("h200-tp8-ep")
    assert ["vllm", "serve", *config.to_argv()] == shell_words(SEED_SERVE)
    assert config.model == "deepseek-ai/DeepSeek-V4-Flash-0731"
    assert config.env == {}


def test_golden_seed_command_through_cli(capsys):
    from dsv4_presets.cli import main

    assert main(["render", "h200-tp8-ep"]) == 0
    out = capsys.readouterr().out
    assert shell_words(out) == shell_words(SEED_SERVE)


def test_golden_seed_bench():
    bench = resolve_bench("random-1024-64")
    argv = bench.to_argv(
        base_url="http://localhost:8000",
        model="deepseek-ai/DeepSeek-V4-Flash-0731",
        result_dir="out",
        result_filename="a1.json",
    )
    expected = [*shell_words(SEED_BENCH)[3:], "--result-dir", "out", "--result-filename", "a1.json"]
    assert argv == expected
    assert bench.num_prompts == 128
    assert bench.num_warmups == 8
    assert (bench.input_len, bench.output_len, bench.seed) == (1024, 64, 0)
    assert bench.dataset_name == "random"
    assert bench.request_rate == float("inf")
    assert bench.get("ignore_eos") is True


def test_bench_to_argv_tokenizer_and_argument_errors():
    bench = resolve_bench("random-1024-64")
    argv = bench.to_argv(
        base_url="http://h:1", model="m", result_dir="d", result_filename="f.json", tokenizer="/t"
    )
    assert argv[argv.index("--tokenizer") + 1] == "/t"
    assert argv.count("--save-result") == 1
    with pytest.raises(ValueError, match="result_filename"):
        bench.to_argv(base_url="http://h:1", model="m", result_dir="d", result_filename="x/f.json")
    with pytest.raises(ValueError, match="base_url"):
        bench.to_argv(base_url="", model="m", result_dir="d", result_filename="f.json")


def test_layers_apply_in_order_and_later_wins(tmp_path):
    # A user file extending the seed preset: its own keys override the layers'.
    path = write(
        tmp_path,
        "mine.yaml",
        """
        dsv4:
          extends: h200-tp8-ep
          description: mine
        max-num-batched-tokens: 8192
        gpu-memory-utilization: 0.85
        """,
    )
    config = resolve_serve(str(path))
    assert config.name == "mine"
    assert config.description == "mine"
    assert config.args["max-num-batched-tokens"] == 8192
    assert config.args["gpu-memory-utilization"] == 0.85
    assert config.args["kv-cache-dtype"] == "fp8"  # from the base layer
    assert config.sources[-1] == str(path)
    assert config.sources[:5] == (
        "layer base",
        "layer checkpoint/v4-flash",
        "layer strategy/tp8-ep",
        "layer hardware/h200",
        "layer feature/benchmark",
    )
    argv = config.to_argv()
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "8192"
    # Options no layer orders come last, in the order they were set.
    assert argv[-2:] == ["--gpu-memory-utilization", "0.85"]


def test_layer_order_matters(tmp_path):
    # production after benchmark turns prefix caching on; the other way round, off.
    a = write(tmp_path, "a.yaml", "dsv4: {extends: [h200-tp8-ep, feature/production]}\n")
    b = write(tmp_path, "b.yaml", "dsv4: {extends: [feature/production, h200-tp8-ep]}\n")
    assert resolve_serve(str(a)).args["enable-prefix-caching"] is True
    assert resolve_serve(str(b)).args["enable-prefix-caching"] is False
    assert resolve_serve(str(a)).purpose == "production"


def test_relative_extends_and_null_removes(tmp_path):
    write(tmp_path, "parent.yaml", "dsv4: {extends: h200-tp8-ep}\nseed: 7\n")
    child = write(
        tmp_path,
        "child.yaml",
        """
        dsv4: {extends: parent.yaml}
        max-num-batched-tokens: null
        speculative-config: {method: mtp, num_speculative_tokens: 2}
        """,
    )
    config = resolve_serve(str(child))
    assert config.args["seed"] == 7
    assert "max-num-batched-tokens" not in config.args
    assert "--max-num-batched-tokens" not in config.to_argv()


def test_mappings_merge_key_by_key(tmp_path):
    path = write(
        tmp_path,
        "spec.yaml",
        """
        dsv4: {extends: h200-tp8-ep-dspark}
        speculative-config: {num_speculative_tokens: 3}
        """,
    )
    config = resolve_serve(str(path))
    want = {"method": "dspark", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}
    assert config.args["speculative-config"] == want
    argv = config.to_argv()
    import json

    assert json.loads(argv[argv.index("--speculative-config") + 1]) == want


def test_set_overrides():
    config = resolve_serve(
        "h200-tp8-ep",
        sets=[
            "tensor-parallel-size=4",
            "enable_prefix_caching=true",
            "speculative-config.method=mtp",
            "speculative-config.num_speculative_tokens=2",
            "env.VLLM_LOGGING_LEVEL=DEBUG",
            "max-num-batched-tokens=null",
            "port=9000",
        ],
    )
    assert config.args["tensor-parallel-size"] == 4
    assert config.args["enable-prefix-caching"] is True
    assert config.args["speculative-config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert config.env == {"VLLM_LOGGING_LEVEL": "DEBUG"}
    assert "max-num-batched-tokens" not in config.args
    argv = config.to_argv()
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
    assert argv[argv.index("--port") + 1] == "9000"


def test_model_override_and_set_model():
    assert resolve_serve("h200-tp8-ep", model="/models/dsv4").model == "/models/dsv4"
    assert resolve_serve("h200-tp8-ep", sets=["model=/m2"]).model == "/m2"
    assert resolve_serve("h200-tp8-ep", model="/m3").to_argv()[0] == "/m3"


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("a=1", (["a"], 1)),
        ("a_b=true", (["a-b"], True)),
        ("--x=inf", (["x"], "inf")),
        ("s.k=2", (["s", "k"], 2)),
        ("env.VLLM_X=1", (["env", "VLLM_X"], 1)),
        ("k=", (["k"], "")),
        ('k={"a": 1}', (["k"], {"a": 1})),
    ],
)
def test_parse_set(item, expected):
    assert parse_set(item) == expected


@pytest.mark.parametrize("item", ["novalue", "=3", "a..b=1", ".a=1"])
def test_parse_set_rejects(item):
    with pytest.raises(PresetError, match="--set"):
        parse_set(item)


def test_config_yaml_round_trips_to_the_same_arguments():
    from dsv4_presets.schema import render_option, shipped_table

    table = shipped_table("serve")
    for name in serve_preset_names():
        config = resolve_serve(name, sets=["data-parallel-address=10.0.0.1"])
        data = yaml.safe_load(config.to_config_yaml())
        assert data["model"] == config.model
        # Re-render the YAML the way vLLM's --config reader does: same argv.
        argv = [data.pop("model")]
        for key, value in data.items():
            argv += render_option(key, value, table.get(key))
        assert argv == config.to_argv(), name


def test_env_file_format():
    config = resolve_serve("h200-tp8-ep", sets=["env.VLLM_LOGGING_LEVEL=DEBUG", "env.FLAG=true"])
    text = config.to_env_file()
    assignments = dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert assignments["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert assignments["FLAG"] == "1"
    assert assignments["DSV4_MODEL"] == config.model
    assert shlex.split(shlex.split(assignments["DSV4_VLLM_ARGS"])[0]) == config.to_argv()[1:]


def test_multi_node_presets_render_every_node():
    head = resolve_serve("dp16-ep-2node", sets=["data-parallel-address=10.1.2.3"])
    assert head.node == "head" and head.node_names == ["head", "worker"]
    worker = head.for_node("worker")
    assert "--headless" not in head.to_argv()
    wargv = worker.to_argv()
    assert "--headless" in wargv
    assert wargv[wargv.index("--data-parallel-start-rank") + 1] == "8"
    for argv in (head.to_argv(), wargv):
        assert argv[argv.index("--data-parallel-address") + 1] == "10.1.2.3"
        assert argv[argv.index("--data-parallel-size") + 1] == "16"
        assert argv[argv.index("--data-parallel-size-local") + 1] == "8"
    # --set applies on every node and wins over the node's own values.
    moved = resolve_serve(
        "dp16-ep-2node",
        node="worker",
        sets=["data-parallel-address=h", "data-parallel-rpc-port=20000"],
    )
    assert moved.args["data-parallel-rpc-port"] == 20000 and moved.args["headless"] is True


def test_ray_preset_setup_lines():
    head = resolve_serve("dp16-ep-ray")
    assert head.setup_lines() == ["ray start --head --port=6379"]
    worker = head.for_node("worker")
    assert worker.node_spec is not None and worker.node_spec.serve is False
    assert worker.setup_lines() == ['ray start --address="$RAY_HEAD_IP:6379" --block']
    assert head.args["data-parallel-backend"] == "ray"
    assert "data-parallel-address" not in head.args and head.required == {}


def test_render_cli_multi_node(capsys):
    from dsv4_presets.cli import main

    assert main(["render", "dp16-ep-2node", "--set", "data-parallel-address=10.0.0.1"]) == 0
    out = capsys.readouterr().out
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 2 and blocks[0].startswith("# node head")
    worker_cmd = shell_words(blocks[1].split("\n", 1)[1])
    assert worker_cmd[0] == "VLLM_ENGINE_READY_TIMEOUT_S=1800"  # the production layer's
    assert worker_cmd[1:] == [
        "vllm",
        "serve",
        *resolve_serve(
            "dp16-ep-2node", node="worker", sets=["data-parallel-address=10.0.0.1"]
        ).to_argv(),
    ]
    # One node's config file needs --node.
    argv = ["render", "dp16-ep-2node", "--set", "data-parallel-address=a", "--format", "config"]
    assert main(argv) == 2
    assert "pass --node" in capsys.readouterr().err


def test_render_refuses_errors_unless_forced(capsys):
    from dsv4_presets.cli import main

    assert main(["render", "h200-tp8-ep", "--set", "block-size=128"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[block-size-256]" in captured.err
    assert main(["render", "h200-tp8-ep", "--set", "block-size=128", "--force"]) == 0
    assert "--block-size 128" in capsys.readouterr().out


def test_unknown_preset_and_bad_files(tmp_path):
    with pytest.raises(PresetError, match="unknown preset 'h100-tp8'"):
        resolve_serve("h100-tp8")
    with pytest.raises(PresetError, match="no such file"):
        resolve_serve(str(tmp_path / "missing.yaml"))
    bad = write(tmp_path, "list.yaml", "- a\n- b\n")
    with pytest.raises(PresetError, match="expected a mapping"):
        resolve_serve(str(bad))
    meta = write(tmp_path, "meta.yaml", "dsv4: {extend: h200-tp8-ep}\n")
    with pytest.raises(PresetError, match=r"unknown key 'dsv4.extend'"):
        resolve_serve(str(meta))
    parent = write(tmp_path, "p.yaml", "dsv4: {extends: nowhere}\n")
    with pytest.raises(PresetError, match="unknown preset or layer 'nowhere'"):
        resolve_serve(str(parent))
    nomodel = write(tmp_path, "nomodel.yaml", "block-size: 256\n")
    with pytest.raises(PresetError, match="names no model"):
        resolve_serve(str(nomodel))
    assert resolve_serve(str(nomodel), model="/m").model == "/m"


def test_extends_cycle_is_reported(tmp_path):
    write(tmp_path, "a.yaml", "dsv4: {extends: b.yaml}\n")
    b = write(tmp_path, "b.yaml", "dsv4: {extends: a.yaml}\n")
    with pytest.raises(PresetError, match="cycle"):
        resolve_serve(str(b))


def test_node_errors():
    with pytest.raises(PresetError, match="single-node"):
        resolve_serve("h200-tp8-ep", node="head")
    with pytest.raises(PresetError, match="has no node 'tail'"):
        resolve_serve("dp16-ep-2node", node="tail")


def test_bench_preset_errors(tmp_path):
    managed = write(tmp_path, "b1.yaml", "dsv4: {extends: random-1024-64}\nbase-url: http://x\n")
    with pytest.raises(PresetError, match="'base-url', which dsv4 bench sets itself"):
        resolve_bench(str(managed))
    nonum = write(tmp_path, "b2.yaml", "dataset-name: random\n")
    with pytest.raises(PresetError, match="must set num-prompts"):
        resolve_bench(str(nonum))
    with pytest.raises(PresetError, match="positive integer"):
        resolve_bench("random-1024-64", sets=["num-prompts=0"])
    assert resolve_bench("random-1024-64", sets=["num-prompts=16"]).num_prompts == 16


def test_listing_and_kinds(tmp_path):
    infos = {i.name: i for i in list_presets()}
    for name in ("h200-tp8-ep", "b200-tp8-ep", "h200-dp8-ep", "dp16-ep-2node", "dp16-ep-ray"):
        assert infos[name].kind == "serve" and infos[name].description
    assert infos["random-1024-64"].kind == "bench"
    assert {"base", "checkpoint/v4-flash", "hardware/h200", "hardware/b200"} <= set(layer_names())
    mine = write(tmp_path, "mine.yaml", "dsv4: {extends: random-1024-64}\nnum-prompts: 4\n")
    assert preset_kind(str(mine)) == "bench"
    assert preset_kind("h200-tp8-ep") == "serve"


def test_presets_cli_lists_one_line_each(capsys):
    from dsv4_presets.cli import main

    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(list_presets())
    assert any(line.startswith("h200-tp8-ep ") and "serve" in line for line in lines)


def test_dp8_preset():
    config = resolve_serve("h200-dp8-ep")
    assert config.args["data-parallel-size"] == 8
    assert config.args["tensor-parallel-size"] == 1
    assert config.args["enable-expert-parallel"] is True


# --------------------------------------------------------------------------- #
# Property: random options survive render -> config file -> load -> render
# --------------------------------------------------------------------------- #


_TABLE = shipped_table("serve")
_NAMES = sorted(
    name
    for name, spec in _TABLE.options.items()
    if spec.kind in ("bool", "flag", "value", "list")
    and spec.type in (*INT_TYPES, "float", "str", "json")
    and name not in ("model", "config")
)


@st.composite
def _random_options(draw):
    out = {}
    # one spelling per setting: 0.33's enable-x and disable-x in one file contradict
    # (the later wins, test_a_later_layer_s_other_spelling_replaces_the_setting)
    names = st.lists(st.sampled_from(_NAMES), min_size=1, max_size=8, unique_by=bool_spellings)
    for name in draw(names):
        spec = _TABLE.options[name]
        if spec.kind in ("bool", "flag"):
            out[name] = draw(st.booleans())
        elif spec.choices:
            out[name] = draw(st.sampled_from(spec.choices))
        elif spec.type in INT_TYPES:
            out[name] = draw(st.integers(min_value=0, max_value=10**6))
        elif spec.type == "float":
            out[name] = draw(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
        elif spec.type == "json":
            out[name] = draw(st.dictionaries(st.sampled_from("abc"), st.integers(0, 9), max_size=2))
        else:
            # a value starting with "--" is refused offline on purpose (vLLM's parser
            # would read it as an option): the property covers the values we accept
            text = st.text(alphabet="abcxyz019_./-", min_size=1, max_size=8)
            out[name] = draw(text.filter(lambda t: not t.startswith("--")))
        if spec.kind == "list" and spec.type != "json":
            out[name] = [out[name]]
    return out


@settings(max_examples=60, deadline=None)
@given(options=_random_options())
def test_random_options_round_trip_through_a_config_file(options, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rt")
    lines = ["dsv4: {extends: h200-tp8-ep}"]
    for name, value in options.items():
        assert check_value(_TABLE.options[name], value) is None, (name, value)
        # Written by a YAML writer: JSON's "1e-15" would read back as a string in YAML 1.1.
        lines.append(yaml.safe_dump({name: value}, default_flow_style=False).rstrip())
    first = resolve_serve(str(write(tmp, "user.yaml", "\n".join(lines) + "\n")))
    # Its rendered config file, loaded back as a preset, renders the same command.
    second = resolve_serve(str(write(tmp, "rendered.yaml", first.to_config_yaml())))
    assert second.to_argv() == first.to_argv()
    assert yaml.safe_load(first.to_config_yaml())["model"] == first.model
    for name, value in options.items():
        assert first.args[name] == value


@pytest.mark.parametrize("user", [False, True])
def test_a_later_layer_s_other_spelling_replaces_the_setting(tmp_path, user):
    # The preset writes enable-prefix-caching: false; a user's 0.33 spelling
    # disable-prefix-caching: <user> is the same setting and must replace it, in its
    # place, not render a second, contradicting flag (found by the round-trip property).
    if "disable-prefix-caching" not in _TABLE.options:
        pytest.fail("the shipped serve table should be 0.33's, which has --disable-prefix-caching")
    preset = resolve_serve("h200-tp8-ep")
    assert preset.args["enable-prefix-caching"] is False
    text = f"dsv4: {{extends: h200-tp8-ep}}\ndisable-prefix-caching: {str(user).lower()}\n"
    mine = write(tmp_path, "mine.yaml", text)
    config = resolve_serve(str(mine))
    assert "enable-prefix-caching" not in config.args
    assert config.args["disable-prefix-caching"] is user
    argv = config.to_argv()
    caching = [a for a in argv if "prefix-caching" in a]
    assert caching == (["--enable-prefix-caching"] if not user else ["--disable-prefix-caching"])
    # in the preset's place, and the rendered config file reads back to the same command
    assert argv.index(caching[0]) == preset.to_argv().index("--no-enable-prefix-caching")
    again = resolve_serve(str(write(tmp_path, "again.yaml", config.to_config_yaml())))
    assert again.to_argv() == argv
    # --set with the other spelling, and null removing both spellings
    flipped = resolve_serve(str(mine), sets=["enable-prefix-caching=false"])
    assert [a for a in flipped.to_argv() if "prefix-caching" in a] == ["--no-enable-prefix-caching"]
    removed = resolve_serve(str(mine), sets=["enable-prefix-caching=null"])
    assert not [k for k in removed.args if "prefix-caching" in k]

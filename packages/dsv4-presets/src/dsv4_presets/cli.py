"""The ``dsv4`` command: list, render, validate, serve and benchmark launch presets.

Exit status: 0 success, 1 the preset has errors or the benchmark failed, 2 bad
command-line usage or an unreadable preset.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

from dsv4_presets import __version__
from dsv4_presets.findings import Report
from dsv4_presets.presets import (
    BenchConfig,
    PresetError,
    ServeConfig,
    list_presets,
    not_a_bench_preset,
    preset_kind,
    resolve_bench,
    resolve_serve,
    serve_preset_names,
)
from dsv4_presets.schema import render_option, shipped_table
from dsv4_presets.validate import check
from dsv4_presets.vllm_exec import VLLM_INSTALL_HINT, vllm_available, vllm_command
from dsv4_presets.vllm_releases import supported

FORMATS = ("argv", "config", "env", "docker", "k8s")
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_BENCH_MODEL = "deepseek-ai/DeepSeek-V4-Flash-0731"
# `dsv4 bench --dry-run` without --model: the model a real run would ask the server for.
DRY_RUN_MODEL = "<served-model>"


def _err(text: str) -> None:
    print(text, file=sys.stderr)


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an option (repeatable): tensor-parallel-size=4, "
        "speculative-config.num_speculative_tokens=2, env.VLLM_LOGGING_LEVEL=DEBUG, key=null",
    )


def _add_preset_args(parser: argparse.ArgumentParser, *, node: bool = True) -> None:
    parser.add_argument("preset", help="a shipped preset name (see `dsv4 presets`) or a YAML file")
    _add_set(parser)
    if node:
        parser.add_argument(
            "--node", default=None, help="the node of a multi-node preset (default: all/first)"
        )


def _resolve(args: argparse.Namespace) -> ServeConfig | BenchConfig:
    kind = preset_kind(args.preset)
    if kind == "bench":
        if getattr(args, "node", None):
            raise PresetError(f"--node does not apply to bench preset {args.preset!r}")
        return resolve_bench(args.preset, sets=args.sets)
    return resolve_serve(
        args.preset,
        model=getattr(args, "model", None),
        sets=args.sets,
        node=getattr(args, "node", None),
    )


def _print_report(name: str, report: Report, *, verbose: bool) -> None:
    for finding in report.findings:
        _err(str(finding))
    if verbose:
        for note in report.notes:
            _err(f"note: {note}")


# --------------------------------------------------------------------------- #
# dsv4 presets
# --------------------------------------------------------------------------- #


def cmd_presets(args: argparse.Namespace) -> int:
    """List the shipped presets, one line each."""
    infos = list_presets()
    width = max(len(i.name) for i in infos)
    for info in infos:
        print(f"{info.name:<{width}}  {info.kind:<5}  {info.description}")
        if args.verbose and info.layers:
            print(f"{'':<{width}}         layers: {' + '.join(info.layers)}")
    return 0


# --------------------------------------------------------------------------- #
# dsv4 render
# --------------------------------------------------------------------------- #


def shell_command(config: ServeConfig, program: str = "vllm") -> str:
    """The ``vllm serve`` command as a multi-line shell command, one option per line."""
    table = shipped_table("serve")
    lines = [f"{program} serve {shlex.quote(config.model)}"]
    for key, value in config.ordered_args():
        words = render_option(key, value, table.get(key))
        if words:
            lines.append("  " + shlex.join(words))
    prefix = [f"{k}={shlex.quote(v)}" for k, v in config.env_strings().items()]
    return " \\\n".join(prefix + lines)


def bench_shell_command(config: BenchConfig, argv: list[str], program: str = "vllm") -> str:
    """The ``vllm bench serve`` command, one option per line."""
    lines = [f"{program} bench serve"]
    current: list[str] = []
    for word in argv:
        if word.startswith("--") and current:
            lines.append("  " + shlex.join(current))
            current = []
        current.append(word)
    if current:
        lines.append("  " + shlex.join(current))
    return " \\\n".join(lines)


def _render_serve(config: ServeConfig, fmt: str, node: str | None, image: str | None) -> str:
    if fmt == "docker":
        from dsv4_presets.deploy import render_docker

        return render_docker(config, image=image, only_this_node=node is not None)
    if fmt == "k8s":
        from dsv4_presets.deploy import render_k8s

        if node is not None:
            raise PresetError("--format k8s renders every node of the preset: drop --node")
        return render_k8s(config, image=image)
    targets = [config] if (node or not config.nodes) else config.all_nodes()
    if fmt != "argv" and len(targets) > 1:
        raise PresetError(
            f"preset {config.name!r} has nodes {', '.join(config.node_names)}: "
            f"--format {fmt} renders one node, pass --node"
        )
    blocks = []
    for target in targets:
        if fmt == "config":
            return target.to_config_yaml()
        if fmt == "env":
            return target.to_env_file()
        lines = []
        spec = target.node_spec
        if spec is not None and len(targets) > 1:
            lines.append(f"# node {spec.name}: {spec.description}".rstrip(": "))
        lines += target.setup_lines()
        if spec is None or spec.serve:
            lines.append(shell_command(target))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def cmd_render(args: argparse.Namespace) -> int:
    """Print a preset as a command, a ``vllm serve --config`` file or an environment file."""
    config = _resolve(args)
    if args.format == "k8s" and isinstance(config, ServeConfig):
        from dsv4_presets.deploy import with_leader_address

        config = with_leader_address(config)
    report = check(config, with_vllm=False)
    for finding in report.findings:
        _err(str(finding))
    if report.errors and not args.force:
        _err(f"{args.preset}: not rendered because of the errors above (--force renders anyway)")
        return 1
    if isinstance(config, BenchConfig):
        if args.format in ("env", "docker", "k8s"):
            raise PresetError(f"--format {args.format} applies to serve presets")
        if args.format == "config":
            import yaml

            print(f"# dsv4 bench preset {config.name}: vllm bench serve --config this-file.yaml")
            sys.stdout.write(yaml.safe_dump(config.to_config(), sort_keys=False))
            return 0
        argv = config.to_argv(
            base_url=args.base_url or DEFAULT_BASE_URL,
            model=args.model or DEFAULT_BENCH_MODEL,
            result_dir=args.result_dir,
            result_filename=args.result_filename or f"{config.name}.json",
        )
        print(bench_shell_command(config, argv))
        return 0
    sys.stdout.write(_render_serve(config, args.format, args.node, args.image))
    return 0


# --------------------------------------------------------------------------- #
# dsv4 validate
# --------------------------------------------------------------------------- #


def cmd_validate(args: argparse.Namespace) -> int:
    """Apply the DSV4 rules and, when vLLM is installed, vLLM's own parser and checks."""
    if args.rules:
        from dsv4_presets.rules import BENCH_RULES, SERVE_RULES

        for title, rules in (("serve presets", SERVE_RULES), ("bench presets", BENCH_RULES)):
            print(f"{title}:")
            for rule in rules:
                print(f"  {rule.name:<28} {rule.summary}")
        return 0
    if args.preset is None:
        raise PresetError("dsv4 validate needs a PRESET (or --rules)")
    with_vllm = {"auto": None, "yes": True, "no": False}[args.vllm]
    if with_vllm and not vllm_available():
        raise PresetError(
            f"--vllm yes needs vLLM in this Python ({sys.executable}): {VLLM_INSTALL_HINT}, "
            "or pass --vllm no to check without vLLM"
        )
    config = _resolve(args)
    if with_vllm is not False and vllm_available():
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    report = check(config, with_vllm=with_vllm)
    _print_report(args.preset, report, verbose=True)
    errors, warnings = len(report.errors), len(report.warnings)
    if report.vllm_version:
        how = (
            f"with vLLM {report.vllm_version}'s parser and registries "
            f"(release {report.vllm_release}; supported: {supported()})"
        )
    else:
        table = shipped_table("bench" if isinstance(config, BenchConfig) else "serve")
        how = (
            "without vLLM: the DSV4 rules, and option names and types against the shipped "
            f"vLLM {table.vllm_version} option table (release {report.vllm_release})"
        )
    verdict = "OK" if report.ok and not (args.strict and warnings) else "FAILED"
    print(f"{config.name}: {verdict} - {errors} error(s), {warnings} warning(s), checked {how}")
    return 0 if verdict == "OK" else 1


# --------------------------------------------------------------------------- #
# dsv4 serve
# --------------------------------------------------------------------------- #


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate a serve preset, then replace this process with ``vllm serve``."""
    # vLLM's environment is the caller's, taken before validation quietens vLLM's
    # logging for its own checks (the server must keep its INFO lines).
    env = dict(os.environ)
    config = _resolve(args)
    if isinstance(config, BenchConfig):
        raise PresetError(f"{args.preset!r} is a bench preset: use `dsv4 bench`")
    if config.nodes and args.node is None:
        where = "roles on this node" if config.same_host else "nodes"
        raise PresetError(
            f"preset {config.name!r} runs several {where} ({', '.join(config.node_names)}): "
            "pass --node NAME for each"
        )
    spec = config.node_spec
    if spec is not None and not spec.serve:
        setup = "; ".join(config.setup_lines())
        raise PresetError(
            f"node {spec.name!r} of {config.name!r} runs no vllm serve of its own: run {setup!r}"
        )
    if not args.skip_validation:
        if vllm_available():
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        report = check(config)
        _print_report(args.preset, report, verbose=False)
        if report.errors:
            _err(f"{config.name}: not serving because of the errors above")
            return 1
    if not args.dry_run and not os.environ.get("DSV4_VLLM") and not vllm_available():
        raise PresetError(
            f"dsv4 serve needs vLLM in this Python ({sys.executable}): {VLLM_INSTALL_HINT} "
            "(or set DSV4_VLLM to the command of another vLLM; --dry-run prints the command)"
        )
    for line in config.setup_lines():
        _err(f"run first on this node: {line}")
    argv = [*vllm_command(), "serve", *config.to_argv()]
    # A role's own variables (CUDA_VISIBLE_DEVICES of a prefill/decode role) are
    # what makes it that role: they win; for the rest, your environment wins.
    role_env = spec.env if spec is not None else {}
    for key, value in config.env_strings().items():
        if key in env and env[key] != value:
            if key in role_env:
                _err(
                    f"note: node {spec.name if spec else ''} sets {key}={value} "
                    f"(your environment's {env[key]} is not used)"
                )
                env[key] = value
                continue
            _err(f"note: {key}={env[key]} from your environment overrides the preset's {value}")
        env.setdefault(key, value)
    if args.dry_run:
        print(shlex.join(argv))  # once, on stdout: the command and nothing else
        return 0
    _err("+ " + shlex.join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)
    return 0  # pragma: no cover - exec does not return


# --------------------------------------------------------------------------- #
# dsv4 bench
# --------------------------------------------------------------------------- #


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``vllm bench serve`` with a bench preset and check the saved result."""
    from dsv4_presets.bench import (
        BenchResultError,
        read_bench_result,
        run_bench,
        served_model,
        summary_lines,
    )

    if preset_kind(args.preset) == "serve":
        shipped = args.preset in serve_preset_names()
        raise PresetError(not_a_bench_preset(args.preset, file=not shipped))
    config = resolve_bench(args.preset, sets=args.sets)
    report = check(config, with_vllm=False)
    _print_report(args.preset, report, verbose=False)
    if report.errors:
        _err(f"{config.name}: not running because of the errors above")
        return 1
    base_url = args.base_url.rstrip("/")
    filename = args.result_filename or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if args.dry_run:
        # Contacts nothing: without --model, a real run asks the server which model
        # it serves; the dry run shows a placeholder there instead.
        model = args.model or DRY_RUN_MODEL
        if not args.model:
            _err(
                f"note: --model not given: a real run asks {base_url}/v1/models for the "
                f"served model; {DRY_RUN_MODEL} stands for it here"
            )
    else:
        try:
            model = args.model or served_model(base_url)
        except BenchResultError as exc:
            _err(f"dsv4 bench: {exc}")
            return 1
    argv = config.to_argv(
        base_url=base_url,
        model=model,
        result_dir=args.result_dir,
        result_filename=filename,
        tokenizer=args.tokenizer,
    )
    command = shlex.join([*vllm_command(), "bench", "serve", *argv])
    if args.dry_run:
        print(command)
        return 0
    _err("+ " + command)
    rc, path = run_bench(
        config,
        base_url=base_url,
        model=model,
        result_dir=args.result_dir,
        result_filename=filename,
        tokenizer=args.tokenizer,
    )
    if rc != 0:
        _err(f"dsv4 bench: vllm bench serve exited with status {rc}")
        return rc if rc > 0 else 1
    try:
        result = read_bench_result(path, expected_prompts=config.num_prompts)
    except BenchResultError as exc:
        _err(f"dsv4 bench: FAILED - {exc}")
        return 1
    print(
        f"{config.name}: OK - {result['completed']} of {config.num_prompts} requests, "
        f"result in {path}"
    )
    for line in summary_lines(result):
        print(line)
    return 0


# --------------------------------------------------------------------------- #
# Parser
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
    """The ``dsv4`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="dsv4",
        description="Launch presets for serving DeepSeek-V4 on vLLM: list, render, validate, "
        "serve and benchmark them.",
    )
    parser.add_argument("--version", action="version", version=f"dsv4 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("presets", help="list the shipped presets, one line each")
    p.add_argument("-v", "--verbose", action="store_true", help="also show each preset's layers")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("render", help="print a preset as a command, config.yaml or env file")
    _add_preset_args(p)
    p.add_argument("--model", help="serve this model (hub id or local folder) instead")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="argv",
        help="argv: the shell command (default); config: YAML for "
        "`vllm serve --config`; env: an environment file; docker: `docker run` lines with "
        "vLLM's image; k8s: a LeaderWorkerSet manifest",
    )
    p.add_argument(
        "--image", help="docker/k8s: the container image (default: vLLM's, at the preset's version)"
    )
    p.add_argument("--force", action="store_true", help="render even when the preset has errors")
    p.add_argument("--base-url", help=f"bench presets: the server (default {DEFAULT_BASE_URL})")
    p.add_argument("--result-dir", default="results", help="bench presets: result folder")
    p.add_argument("--result-filename", help="bench presets: result file name")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("validate", help="check a preset with the DSV4 rules and vLLM's parser")
    p.add_argument("preset", nargs="?", help="a shipped preset name or a YAML file")
    _add_set(p)
    p.add_argument("--model", help="check with this model instead")
    p.add_argument(
        "--vllm",
        choices=("auto", "yes", "no"),
        default="auto",
        help="use vLLM's parser: auto (if installed, default), yes (required), no",
    )
    p.add_argument("--strict", action="store_true", help="fail on warnings too")
    p.add_argument("--rules", action="store_true", help="list the rules and exit")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("serve", help="validate, then exec `vllm serve` with the preset")
    _add_preset_args(p)
    p.add_argument("--model", help="serve this model (hub id or local folder) instead")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument(
        "--skip-validation", action="store_true", help="exec vLLM even if the rules find errors"
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="run `vllm bench serve` with a bench preset and check it")
    _add_preset_args(p, node=False)
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the served model name (default: ask the server)")
    p.add_argument("--tokenizer", help="tokenizer for the prompts (default: the model's)")
    p.add_argument("--result-dir", default="results", help="where to save the result JSON")
    p.add_argument(
        "--result-filename", help="result file name (default: PRESET-YYYYmmdd-HHMMSS.json)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command instead of running it (contacts no server)",
    )
    p.set_defaults(func=cmd_bench)

    _register_compare(sub)
    return parser


def _register_compare(sub: Any) -> None:
    """Add ``dsv4 compare`` when its module is present (it is built separately)."""
    try:
        from dsv4_presets.compare.cli import register
    except ModuleNotFoundError as exc:
        if exc.name in ("dsv4_presets.compare", "dsv4_presets.compare.cli"):
            return
        raise
    register(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dsv4`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        return int(args.func(args))
    except PresetError as exc:
        _err(f"dsv4: error: {exc}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

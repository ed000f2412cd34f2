"""Checks that run vLLM's own code on a preset (imported lazily: needs vLLM, no GPU, no model).

What runs, in order, for a serve preset:

1. vLLM's real ``vllm serve`` argument parser (``FlexibleArgumentParser`` +
   ``make_arg_parser``) on exactly the argv ``dsv4 serve`` would exec; a parse
   error is reported with the line vLLM itself prints (``vllm serve: error: ...``).
2. ``validate_parsed_serve_args`` - vLLM's pre-launch cross-flag checks.
3. The registries: tokenizer modes, tool-call parsers, reasoning parsers,
   attention backends (and, for the preset's GPU, whether the backend supports
   its compute capability), and vLLM's environment variables.
4. ``EngineArgs.from_cli_args`` and the model-independent config objects
   (``CacheConfig``, ``ParallelConfig``), which validate values and
   cross-field constraints in their constructors.

What cannot run without the checkpoint's ``config.json`` (the model id does
not resolve offline) is listed in :data:`SKIPPED`.

Every vLLM symbol is found through the installed release's entry in
:data:`dsv4_presets.vllm_releases.RELEASES` (:func:`facts`); a release not in
that table raises :class:`~dsv4_presets.vllm_releases.UnsupportedVllmRelease`,
naming the supported ones.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import sys
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from dsv4_presets.findings import Finding
from dsv4_presets.presets import BenchConfig, ServeConfig
from dsv4_presets.schema import SNAPSHOT_FILES, OptionTable
from dsv4_presets.schema_snapshot import snapshot_from_parser
from dsv4_presets.vllm_releases import ReleaseFacts, facts_for

SKIPPED = (
    "ModelConfig and everything derived from the checkpoint's config.json (max-model-len, "
    "quantization, architecture and tokenizer loading): the model is not downloaded",
    "SpeculativeConfig construction (needs the target model's config); the method is checked "
    "against the checkpoint facts by the dsv4 rule instead",
    "EngineArgs.create_engine_config's data-parallel launch-mode checks and platform checks "
    "(they run after the model config and on the GPU machine); the dsv4 topology rules cover "
    "the common cases",
)


def vllm_version() -> str:
    """The installed vLLM's version string."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def facts() -> ReleaseFacts:
    """The installed vLLM's release facts (raises ``UnsupportedVllmRelease`` for others)."""
    return facts_for(vllm_version())


def release_line() -> str:
    """What the checks ran against, for reports: ``vLLM 0.33.0 (release 0.33)``."""
    return f"vLLM {vllm_version()} (release {facts().name})"


@lru_cache(maxsize=1)
def _serve_root() -> argparse.ArgumentParser:
    """A ``vllm`` parser with the real ``serve`` subcommand (built once per process)."""
    release = facts()
    make_arg_parser = release.load("make_arg_parser")
    FlexibleArgumentParser = release.load("FlexibleArgumentParser")

    root = FlexibleArgumentParser(prog="vllm")
    sub = root.add_subparsers(dest="subparser")
    serve = sub.add_parser("serve", prog="vllm serve", usage="vllm serve [model_tag] [options]")
    make_arg_parser(serve)
    return root


def serve_parser() -> argparse.ArgumentParser:
    """vLLM's ``serve`` subcommand parser."""
    root = _serve_root()
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser: argparse.ArgumentParser = action.choices["serve"]
            return parser
    raise RuntimeError("vLLM's root parser has no serve subcommand")


@lru_cache(maxsize=1)
def bench_parser() -> argparse.ArgumentParser:
    """vLLM's ``bench serve`` parser."""
    release = facts()
    add_cli_args = release.load("bench_add_cli_args")
    FlexibleArgumentParser = release.load("FlexibleArgumentParser")

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser


def live_table(command: str) -> OptionTable:
    """The option table of the installed vLLM (what the shipped snapshot should equal)."""
    if command == "serve":
        import vllm.envs

        env_vars = tuple(sorted(vllm.envs.environment_variables))
        return snapshot_from_parser(
            serve_parser(), command="serve", vllm_version=vllm_version(), env_vars=env_vars
        )
    if command == "bench":
        return snapshot_from_parser(bench_parser(), command="bench", vllm_version=vllm_version())
    raise ValueError(f"command must be 'serve' or 'bench', got {command!r}")


def _last_error_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if ": error:" in line:
            return line.strip()
    return lines[-1].strip() if lines else "vLLM's parser exited without a message"


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[Any, str | None]:
    """Parse ``argv`` with a vLLM parser; returns ``(namespace, None)`` or ``(None, message)``.

    The message is the error line vLLM prints before exiting (argparse exits
    with status 2), or the text of the exception vLLM's parser raises.
    """
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv), None
    except SystemExit:
        return None, _last_error_line(err.getvalue())
    except Exception as exc:  # vLLM's pre-processing can raise anything on odd input
        return None, f"vLLM's parser failed: {type(exc).__name__}: {exc}"


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    # pydantic errors carry a URL line per error; keep the informative lines.
    lines = [line for line in text.splitlines() if "errors.pydantic.dev" not in line]
    return f"{type(exc).__name__}: " + " ".join(line.strip() for line in lines if line.strip())


def _capability(hardware: dict[str, Any]) -> tuple[int, int] | None:
    text = hardware.get("compute_capability")
    if text is None:
        return None
    major, _, minor = str(text).partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return None


def check_serve(config: ServeConfig) -> tuple[list[Finding], list[str]]:
    """Run vLLM's own checks on a serve preset; returns ``(findings, notes)``."""
    findings: list[Finding] = []
    notes: list[str] = list(SKIPPED)
    argv = ["serve", *config.to_argv()]
    ns, message = parse(_serve_root(), argv)
    if ns is None:
        findings.append(Finding("error", "vllm-parser", str(message)))
        return findings, notes

    validate_parsed_serve_args = facts().load("validate_parsed_serve_args")

    try:
        validate_parsed_serve_args(ns)
    except Exception as exc:
        findings.append(Finding("error", "vllm-serve-checks", _short(exc)))

    findings += _check_registries(ns, config, notes)

    AsyncEngineArgs = facts().load("AsyncEngineArgs")

    try:
        with _no_offline_model_resolution():
            engine_args = AsyncEngineArgs.from_cli_args(ns)
    except Exception as exc:
        findings.append(Finding("error", "vllm-engine-args", _short(exc)))
        return findings, notes
    findings += _check_configs(engine_args, notes)
    return findings, notes


@contextlib.contextmanager
def _no_offline_model_resolution() -> Iterator[None]:
    """Keep EngineArgs from resolving the model id to a local snapshot.

    With ``HF_HUB_OFFLINE=1`` vLLM's ``EngineArgs.__post_init__`` replaces a
    hub model id by its cached snapshot folder and fails when the model is not
    downloaded.  The checks here never read the model, so the id stays a
    string while they run (nothing is fetched either way: online mode only
    resolves the id later, in ``ModelConfig``, which is not built here).
    """
    try:
        import huggingface_hub.constants as hub_constants
    except ImportError:
        yield
        return
    saved = hub_constants.HF_HUB_OFFLINE
    hub_constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = saved


def _check_registries(ns: Any, config: ServeConfig, notes: list[str]) -> list[Finding]:
    findings: list[Finding] = []
    release = facts()
    ReasoningParserManager = release.load("ReasoningParserManager")
    TokenizerRegistry = release.load("TokenizerRegistry")
    ToolParserManager = release.load("ToolParserManager")

    mode = getattr(ns, "tokenizer_mode", None)
    if isinstance(mode, str) and mode.lower() != "auto":
        known = sorted(TokenizerRegistry.tokenizers)
        if mode.lower() not in TokenizerRegistry.tokenizers:
            findings.append(
                Finding(
                    "error",
                    "vllm-registry",
                    f"tokenizer-mode {mode!r} is not registered in vLLM {vllm_version()}; "
                    f"registered: auto, {', '.join(known)}",
                )
            )
    tool = getattr(ns, "tool_call_parser", None)
    if tool and not getattr(ns, "tool_parser_plugin", None):
        known = ToolParserManager.list_registered()
        if tool not in known:
            findings.append(
                Finding(
                    "error",
                    "vllm-registry",
                    f"tool-call-parser {tool!r} is not registered in vLLM {vllm_version()} "
                    "(set tool-parser-plugin to load your own); registered: " + ", ".join(known),
                )
            )
    reasoning = getattr(ns, "reasoning_parser", None)
    if reasoning and not getattr(ns, "reasoning_parser_plugin", None):
        known = ReasoningParserManager.list_registered()
        if reasoning not in known:
            findings.append(
                Finding(
                    "error",
                    "vllm-registry",
                    f"reasoning-parser {reasoning!r} is not registered in vLLM {vllm_version()} "
                    "(set reasoning-parser-plugin to load your own); registered: "
                    + ", ".join(known),
                )
            )
    backend = getattr(ns, "attention_backend", None)
    if backend:
        findings += _check_attention_backend(str(backend), config, notes)

    import vllm.envs

    for name in config.env:
        if name.startswith("VLLM_") and name not in vllm.envs.environment_variables:
            findings.append(
                Finding(
                    "error",
                    "vllm-env",
                    f"environment variable {name} is not one vLLM {vllm_version()} reads "
                    "(a typo, or removed); see vllm/envs.py",
                )
            )
    return findings


def _check_attention_backend(name: str, config: ServeConfig, notes: list[str]) -> list[Finding]:
    AttentionBackendEnum = facts().load("AttentionBackendEnum")

    key = name.upper()
    if key == "AUTO":
        return []
    try:
        member = AttentionBackendEnum[key]
    except (KeyError, ValueError):
        known = ", ".join(m.name for m in AttentionBackendEnum)
        return [
            Finding(
                "error",
                "vllm-registry",
                f"attention-backend {name!r} is not one of vLLM's backends: {known}",
            )
        ]
    capability = _capability(config.hardware)
    if capability is None:
        return []
    try:
        cls = member.get_class()
    except Exception as exc:
        notes.append(
            f"attention-backend {key}: could not import its class on this machine "
            f"({type(exc).__name__}), so its compute-capability support was not checked"
        )
        return []
    cap = facts().load("DeviceCapability")(*capability)
    supports = getattr(cls, "supports_compute_capability", None)
    if supports is not None and not supports(cap):
        gpu = config.hardware.get("name", "this GPU")
        return [
            Finding(
                "error",
                "vllm-attention-capability",
                f"attention-backend {key} does not support compute capability "
                f"{capability[0]}.{capability[1]} ({gpu}), according to vLLM "
                f"{vllm_version()}: remove attention-backend or pick one for this GPU",
            )
        ]
    return []


def _check_configs(engine_args: Any, notes: list[str]) -> list[Finding]:
    findings: list[Finding] = []
    CacheConfig = facts().load("CacheConfig")
    ParallelConfig = facts().load("ParallelConfig")

    try:
        CacheConfig(
            block_size=engine_args.block_size,
            gpu_memory_utilization=engine_args.gpu_memory_utilization,
            cache_dtype=engine_args.kv_cache_dtype,
            enable_prefix_caching=bool(engine_args.enable_prefix_caching),
            kv_cache_memory_bytes=engine_args.kv_cache_memory_bytes,
        )
    except Exception as exc:
        findings.append(Finding("error", "vllm-cache-config", _short(exc)))

    backend = engine_args.data_parallel_backend
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        notes.append(
            "ParallelConfig with data-parallel-backend ray: not built here because Ray is not "
            "installed (vLLM imports it in the constructor)"
        )
        return findings
    dp = engine_args.data_parallel_size
    rank = engine_args.data_parallel_start_rank
    if rank is None:
        rank = engine_args.data_parallel_rank or 0
    kwargs: dict[str, Any] = {
        "pipeline_parallel_size": engine_args.pipeline_parallel_size,
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "data_parallel_size": dp,
        "data_parallel_size_local": engine_args.data_parallel_size_local or dp,
        "data_parallel_rank": rank,
        "data_parallel_backend": backend,
        "enable_expert_parallel": engine_args.enable_expert_parallel,
        "all2all_backend": engine_args.all2all_backend,
        "enable_eplb": engine_args.enable_eplb,
        "eplb_config": engine_args.eplb_config,
        "is_moe_model": True,
        "distributed_executor_backend": engine_args.distributed_executor_backend,
    }
    if engine_args.data_parallel_address is not None:
        kwargs["data_parallel_master_ip"] = engine_args.data_parallel_address
    if engine_args.data_parallel_rpc_port is not None:
        kwargs["data_parallel_rpc_port"] = engine_args.data_parallel_rpc_port
    try:
        ParallelConfig(**kwargs)
    except Exception as exc:
        findings.append(Finding("error", "vllm-parallel-config", _short(exc)))
    return findings


def check_bench(config: BenchConfig) -> tuple[list[Finding], list[str]]:
    """Run vLLM's ``bench serve`` parser on a bench preset; returns ``(findings, notes)``."""
    argv = config.to_argv(
        base_url="http://127.0.0.1:8000",
        model="deepseek-ai/DeepSeek-V4-Flash-0731",
        result_dir="results",
        result_filename=f"{config.name}.json",
    )
    ns, message = parse(bench_parser(), argv)
    if ns is None:
        return [Finding("error", "vllm-parser", str(message))], []
    return [], []


def snapshot_text(command: str) -> str:
    """The option-table file for ``command`` as the installed vLLM's parser builds it."""
    table = live_table(command)
    return (
        "# Generated by `python -m dsv4_presets.vllm_check --write` from the installed vLLM.\n"
        "# Do not edit by hand; tests check it against vLLM's real parser.\n"
        + yaml.safe_dump(table.to_data(), sort_keys=False, width=100)
    )


def _main(argv: list[str] | None = None) -> int:
    """``python -m dsv4_presets.vllm_check [--write | --diff OLD NEW]``.

    Without options: print the installed vLLM's option tables.  ``--write``:
    overwrite the shipped tables of the installed release
    (``data/vllm/<release>/``).  ``--diff OLD NEW``: list the options added,
    removed and changed between two releases' shipped tables (no vLLM needed).
    """
    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("--write", action="store_true", help="overwrite the shipped tables")
    parser.add_argument(
        "--diff", nargs=2, metavar=("OLD", "NEW"), help="compare two releases' shipped tables"
    )
    args = parser.parse_args(argv)
    if args.diff:
        from dsv4_presets.schema import shipped_table, table_diff

        old, new = args.diff
        for command in SNAPSHOT_FILES:
            diff = table_diff(shipped_table(command, old), shipped_table(command, new))
            print(f"vllm {command}: {old} -> {new}")
            for what, names in diff.items():
                print(f"  {what} ({len(names)}): " + (", ".join(names) or "-"))
        return 0
    release = facts()
    out = resources.files("dsv4_presets").joinpath("data", "vllm", release.table_dir)
    for command, filename in SNAPSHOT_FILES.items():
        text = snapshot_text(command)
        if args.write:
            with resources.as_file(out) as folder:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / filename).write_text(text, encoding="utf-8")
            print(f"wrote {release.table_dir}/{filename} (vLLM {vllm_version()})")
        else:
            sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

"""The rules: what DSV4 users keep getting wrong, each with a message that says what to change.

Every rule is a function from a resolved preset to findings; :data:`SERVE_RULES`
and :data:`BENCH_RULES` list them with a one-line summary (``dsv4 validate
--rules`` prints them).  None of them needs vLLM: option names and value types
are checked against the option tables shipped in :mod:`dsv4_presets.schema`.
This module holds the checkpoint and option rules and the registry; kernel
and GPU rules are in :mod:`dsv4_presets.rules_platform`, placement rules in
:mod:`dsv4_presets.rules_topology`.  A rule that only means something on
NVIDIA GPUs names its platforms; on other hardware it is reported as not
applied (:func:`not_applied`) rather than run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsv4_presets.configs import BenchConfig, ServeConfig
from dsv4_presets.findings import Finding
from dsv4_presets.rules_platform import (
    rule_indexer_cache,
    rule_kernel_platform,
    rule_mega_moe_expert_parallel,
    vendor,
)
from dsv4_presets.rules_topology import (
    as_int,
    rule_dp_topology,
    rule_gpus_per_node,
    rule_same_host_split,
    truthy,
)
from dsv4_presets.schema import (
    OptionTable,
    check_minimum,
    check_value,
    human_int,
    shipped_table,
)
from dsv4_presets.vllm_releases import release_of

# kv-cache-dtype values that select DSV4's UE8M0 FP8 page layout ("fp8" is
# vLLM's alias for fp8_ds_mla on DSV4's FlashMLA sparse backend).
DSV4_KV_CACHE_DTYPES = ("fp8", "fp8_ds_mla")
DSV4_BLOCK_SIZE = 256

# Speculative methods that need a separate draft model (``speculative-config.model``).
DRAFT_MODEL_METHODS = ("eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "dflash")
# Methods that need no weights at all.
MODEL_FREE_METHODS = ("ngram", "ngram_gpu", "suffix")
# vLLM 0.32 methods that load each drafter a checkpoint can declare
# (``dsv4.checkpoint.drafter``): an MTP head or DSpark stages
# (vllm/config/speculative.py: MTPModelTypes, DSparkModelTypes).
DRAFTER_METHODS: dict[str, tuple[str, ...]] = {
    "mtp": ("mtp", "deepseek_mtp"),
    "dspark": ("dspark",),
}
# Draft tokens per step the DeepSeek-V4 recipes use with DSpark.
DSPARK_TOKENS = (3, 7)


# --------------------------------------------------------------------------- #
# Option names and values
# --------------------------------------------------------------------------- #


def _table_release(table: OptionTable) -> tuple[int, int] | None:
    """The release an option table was written from (None: not a release's table)."""
    try:
        return release_of(table.vllm_version)
    except ValueError:
        return None


def check_options(args: dict[str, Any], table: OptionTable, what: str) -> list[Finding]:
    """Unknown option names, and values of the wrong type, outside the choices or below
    the smallest value vLLM accepts (:data:`~dsv4_presets.schema.INT_MINIMUMS`)."""
    findings = []
    for key, value in args.items():
        spec = table.get(key)
        if spec is None:
            hint = table.suggest(key)
            did_you_mean = f"; did you mean {hint!r}?" if hint else ""
            findings.append(
                Finding(
                    "error",
                    "unknown-option",
                    f"{key!r} is not a {what} option (vLLM {table.vllm_version}){did_you_mean}",
                )
            )
            continue
        problem = check_value(spec, value) or check_minimum(
            table.command, key, value, _table_release(table)
        )
        if problem:
            findings.append(Finding("error", "bad-value", f"{key}: {problem}"))
    return findings


def rule_options(config: ServeConfig) -> list[Finding]:
    """Every key is a ``vllm serve`` option and every value has the option's type."""
    table = shipped_table("serve")
    findings = check_options(config.args, table, "vllm serve")
    for name in config.env:
        if name.startswith("VLLM_") and table.env_vars and name not in table.env_vars:
            findings.append(
                Finding(
                    "error",
                    "unknown-env",
                    f"environment variable {name} is not one vLLM {table.vllm_version} reads",
                )
            )
    return findings


def rule_required(config: ServeConfig) -> list[Finding]:
    """Options the preset says the user must set (addresses of multi-node presets)."""
    return [
        Finding("error", "required-setting", f"set {key}: {why}")
        for key, why in config.required.items()
        if config.args.get(key) in (None, "")
    ]


# --------------------------------------------------------------------------- #
# DSV4 rules
# --------------------------------------------------------------------------- #


def rule_kv_cache_fp8(config: ServeConfig) -> list[Finding]:
    """The KV cache must be FP8 (DSV4's UE8M0 page layout)."""
    value = config.args.get("kv-cache-dtype", "auto")
    if str(value) in DSV4_KV_CACHE_DTYPES:
        return []
    return [
        Finding(
            "error",
            "kv-cache-fp8",
            f"kv-cache-dtype is {value!r}; DSV4's sparse attention reads its K cache in the "
            "FP8 UE8M0 page layout (448 E4M3 values + 64 bf16 rope values + 8 scale bytes "
            "per token): set kv-cache-dtype: fp8",
        )
    ]


def rule_block_size(config: ServeConfig) -> list[Finding]:
    """The KV block size must be 256 tokens."""
    value = config.args.get("block-size")
    if as_int(value, -1) == DSV4_BLOCK_SIZE and not isinstance(value, bool):
        return []
    shown = "unset (vLLM would pick its default)" if value is None else repr(value)
    return [
        Finding(
            "error",
            "block-size-256",
            f"block-size is {shown}; DSV4's KV pages hold 256 tokens (its compressed caches "
            "hold 256 / compress_ratio entries per page and its kernels support only 256): "
            "set block-size: 256",
        )
    ]


def _speculative_method(config: ServeConfig) -> tuple[str | None, dict[str, Any]]:
    spec = config.args.get("speculative-config")
    spec = spec if isinstance(spec, dict) else {}
    method = spec.get("method", config.args.get("spec-method"))
    return (None if method is None else str(method)), spec


def _supported_methods(config: ServeConfig) -> tuple[str | None, list[str]]:
    """The drafter the checkpoint declares and the vLLM methods that load it."""
    drafter = config.checkpoint.get("drafter")
    drafter = None if drafter in (None, "none") else str(drafter)
    methods = list(DRAFTER_METHODS.get(drafter, ())) if drafter else []
    methods += [str(m) for m in config.checkpoint.get("speculative_methods", [])]
    return drafter, methods


def rule_speculative_method(config: ServeConfig) -> list[Finding]:
    """The speculative method must load the drafter the checkpoint declares."""
    method, spec = _speculative_method(config)
    if method is None:
        return []
    drafter, supported = _supported_methods(config)
    ckpt = config.checkpoint.get("name", "this checkpoint")
    if method in MODEL_FREE_METHODS:
        return []
    if method in supported:
        return _dspark_tokens(spec) if method == "dspark" else []
    has_draft = bool(spec.get("model") or config.args.get("spec-model"))
    if method in DRAFT_MODEL_METHODS and has_draft:
        return []
    use = f"use method: {supported[0]}" if supported else "remove speculative-config"
    if method in DRAFT_MODEL_METHODS:
        reason = f"method {method!r} needs a separate draft model (speculative-config.model)"
    elif method in DRAFTER_METHODS["mtp"] and drafter == "dspark":
        reason = (
            f"{ckpt} ships a DSpark drafter (DSpark stages under mtp.*), not an MTP head; "
            f"method {method!r} reads those weights as an MTP head and can half-load the "
            "drafter's blocks instead of failing"
        )
    elif method == "dspark" and drafter == "mtp":
        reason = f"{ckpt} ships an MTP head, not a DSpark drafter"
    else:
        reason = f"{ckpt}'s weights do not provide {method!r} drafting"
    shipped = drafter or "none"
    return [
        Finding(
            "error",
            "speculative-method",
            f"speculative method {method!r} does not match {ckpt}: {reason}; "
            f"its drafter: {shipped}; {use}",
        )
    ]


def _dspark_tokens(spec: dict[str, Any]) -> list[Finding]:
    tokens = as_int(spec.get("num_speculative_tokens"), 0)
    low, high = DSPARK_TOKENS
    if tokens == 0 or low <= tokens <= high:
        return []
    return [
        Finding(
            "warning",
            "speculative-method",
            f"speculative-config.num_speculative_tokens {tokens} for DSpark: the DeepSeek-V4 "
            f"recipes draft {low} to {high} tokens per step",
        )
    ]


def rule_max_model_len(config: ServeConfig) -> list[Finding]:
    """``max-model-len`` stays within the checkpoint's context length."""
    limit = as_int(config.checkpoint.get("max_context"), 0)
    value = config.args.get("max-model-len")
    if limit < 1 or value is None:
        return []
    length = human_int(value)
    if length is None or length <= limit:
        return []
    ckpt = config.checkpoint.get("name", "this checkpoint")
    return [
        Finding(
            "error",
            "max-model-len",
            f"max-model-len {value} is longer than {ckpt}'s context of {limit:,} tokens: "
            f"set max-model-len to at most {limit}",
        )
    ]


def rule_tp_fp8_alignment(config: ServeConfig) -> list[Finding]:
    """Tensor-parallel sizes must split the heads into whole FP8 weight blocks."""
    heads = as_int(config.checkpoint.get("num_attention_heads"), 0)
    head_dim = as_int(config.checkpoint.get("head_dim"), 0)
    block = as_int(config.checkpoint.get("fp8_weight_block"), 0)
    tp = as_int(config.args.get("tensor-parallel-size"), 1)
    if tp < 1 or heads < 1:
        return []
    ckpt = config.checkpoint.get("name", "this checkpoint")
    good = [
        n for n in range(1, heads + 1) if heads % n == 0 and _aligned(heads, head_dim, block, n)
    ]
    if heads % tp == 0 and _aligned(heads, head_dim, block, tp):
        return []
    if heads % tp:
        why = (
            f"{ckpt}'s {heads} attention heads do not split into {tp} equal shards "
            f"({heads / tp:.2f} heads per GPU)"
        )
    else:
        width = heads // tp * head_dim
        why = (
            f"each GPU's {width}-wide share of the head projections is not a whole number of "
            f"{block}x{block} FP8 weight blocks"
        )
    return [
        Finding(
            "error",
            "tp-fp8-alignment",
            f"tensor-parallel-size {tp} breaks FP8 block alignment: {why}; use one of "
            f"{', '.join(str(n) for n in good if n <= 64)}",
        )
    ]


def _aligned(heads: int, head_dim: int, block: int, tp: int) -> bool:
    if block <= 0 or head_dim <= 0:
        return True
    return (heads // tp) * head_dim % block == 0


def rule_auto_tool_choice(config: ServeConfig) -> list[Finding]:
    """``enable-auto-tool-choice`` needs a ``tool-call-parser``."""
    if truthy(config.args.get("enable-auto-tool-choice")) and not config.args.get(
        "tool-call-parser"
    ):
        expected = config.checkpoint.get("parsers", {}).get("tool-call-parser")
        fix = f"set tool-call-parser: {expected}" if expected else "set tool-call-parser"
        return [
            Finding(
                "error",
                "auto-tool-choice-parser",
                "enable-auto-tool-choice is on but no tool-call-parser is set (vLLM refuses to "
                f"start: it cannot find tool calls in the output): {fix}, or turn "
                "enable-auto-tool-choice off",
            )
        ]
    return []


def rule_checkpoint_parsers(config: ServeConfig) -> list[Finding]:
    """Tokenizer mode and parsers must be the checkpoint's own (DSV4's chat format)."""
    expected: dict[str, Any] = config.checkpoint.get("parsers", {}) or {}
    ckpt = config.checkpoint.get("name", "this checkpoint")
    findings = []
    for key, want in expected.items():
        value = config.args.get(key)
        if value is None or str(value) == str(want):
            continue
        if key == "tokenizer-mode" and str(value) == "auto":
            continue  # vLLM picks deepseek_v4 for DSV4 architectures
        findings.append(
            Finding(
                "error",
                "checkpoint-parsers",
                f"{key} is {value!r} but {ckpt} writes DeepSeek-V4's chat format: "
                f"set {key}: {want}",
            )
        )
    return findings


def rule_benchmark_prefix_caching(config: ServeConfig) -> list[Finding]:
    """Benchmark presets should keep prefix caching off (a warning)."""
    if config.purpose != "benchmark":
        return []
    value = config.args.get("enable-prefix-caching")
    if value is False:
        return []
    state = "on" if value is True else "left at vLLM's default (on)"
    return [
        Finding(
            "warning",
            "benchmark-prefix-caching",
            f"prefix caching is {state} in a benchmark preset: repeated runs with the same "
            "seeded prompts hit the cache and measure it instead of the change under test; "
            "set enable-prefix-caching: false",
        )
    ]


# --------------------------------------------------------------------------- #
# Bench rules
# --------------------------------------------------------------------------- #


def rule_bench_options(config: BenchConfig) -> list[Finding]:
    """Every key is a ``vllm bench serve`` option and every value has the option's type."""
    return check_options(config.args, shipped_table("bench"), "vllm bench serve")


def rule_bench_temperature(config: BenchConfig) -> list[Finding]:
    """Benchmarks should pin the temperature (vLLM's default sampling differs by model)."""
    if config.get("temperature") is None:
        return [
            Finding(
                "warning",
                "bench-temperature",
                "temperature is not set: vllm bench serve then uses the model's default "
                "sampling, which varies output lengths between runs; set temperature: 0",
            )
        ]
    return []


def rule_bench_ignore_eos(config: BenchConfig) -> list[Finding]:
    """Random-dataset benchmarks should ignore EOS so every request produces its output length."""
    if config.dataset_name == "random" and not truthy(config.get("ignore-eos")):
        return [
            Finding(
                "warning",
                "bench-ignore-eos",
                "a random-dataset benchmark without ignore-eos stops requests early at random "
                "EOS tokens, so output lengths differ between runs: set ignore-eos: true",
            )
        ]
    return []


@dataclass(frozen=True)
class Rule:
    """A named check, what it is for, and the GPU vendors it means something on."""

    name: str
    summary: str
    check: Callable[[Any], list[Finding]]
    vendors: tuple[str, ...] = ("nvidia", "amd")


SERVE_RULES: tuple[Rule, ...] = (
    Rule(
        "unknown-option / bad-value",
        "keys are vllm serve options; values have their types",
        rule_options,
    ),
    Rule(
        "required-setting",
        "options the preset requires (e.g. the head node's address)",
        rule_required,
    ),
    Rule(
        "kv-cache-fp8", "kv-cache-dtype must be fp8 (DSV4's UE8M0 page layout)", rule_kv_cache_fp8
    ),
    Rule("block-size-256", "block-size must be 256", rule_block_size),
    Rule(
        "kernel-platform",
        "kernels match the GPU (SM 10.x kernels on Blackwell, NVIDIA kernels not on ROCm)",
        rule_kernel_platform,
    ),
    Rule(
        "mega-moe-expert-parallel",
        "moe-backend deep_gemm_mega_moe has expert parallel",
        rule_mega_moe_expert_parallel,
        vendors=("nvidia",),
    ),
    Rule(
        "indexer-cache",
        "the indexer cache dtype is spelled as vLLM 0.32 reads it and DSV4 supports it",
        rule_indexer_cache,
    ),
    Rule(
        "speculative-method",
        "speculative method loads the drafter the checkpoint declares",
        rule_speculative_method,
    ),
    Rule(
        "tp-fp8-alignment",
        "tensor-parallel size splits heads into whole FP8 blocks",
        rule_tp_fp8_alignment,
    ),
    Rule(
        "auto-tool-choice-parser",
        "enable-auto-tool-choice needs a tool-call-parser",
        rule_auto_tool_choice,
    ),
    Rule(
        "checkpoint-parsers",
        "tokenizer mode and parsers match the checkpoint",
        rule_checkpoint_parsers,
    ),
    Rule("max-model-len", "max-model-len within the checkpoint's context", rule_max_model_len),
    Rule(
        "benchmark-prefix-caching",
        "benchmark presets keep prefix caching off (warning)",
        rule_benchmark_prefix_caching,
    ),
    Rule("gpus-per-node", "one node's engines fit on its GPUs", rule_gpus_per_node),
    Rule(
        "dp-topology",
        "multi-node data-parallel ranks, address and headless agree",
        rule_dp_topology,
    ),
    Rule(
        "same-host-split",
        "roles sharing a node have their own GPUs and ports and one KV connector",
        rule_same_host_split,
    ),
)

BENCH_RULES: tuple[Rule, ...] = (
    Rule(
        "unknown-option / bad-value",
        "keys are vllm bench serve options; values typed",
        rule_bench_options,
    ),
    Rule("bench-temperature", "temperature is pinned (warning)", rule_bench_temperature),
    Rule("bench-ignore-eos", "random datasets ignore EOS (warning)", rule_bench_ignore_eos),
)


def check_serve(config: ServeConfig) -> list[Finding]:
    """The serve rules that apply to this preset's GPU vendor, on one node's configuration."""
    findings: list[Finding] = []
    for rule in SERVE_RULES:
        if vendor(config) in rule.vendors:
            findings += rule.check(config)
    return findings


def not_applied(config: ServeConfig) -> list[str]:
    """Notes naming the rules that do not apply to this preset's GPU vendor, and why."""
    gpu = config.hardware.get("name", vendor(config))
    return [
        f"rule {rule.name} is {'/'.join(v.upper() for v in rule.vendors)}-specific: "
        f"not applied to {gpu} ({vendor(config)})"
        for rule in SERVE_RULES
        if vendor(config) not in rule.vendors
    ]


def check_bench(config: BenchConfig) -> list[Finding]:
    """All bench rules."""
    findings: list[Finding] = []
    for rule in BENCH_RULES:
        findings += rule.check(config)
    return findings

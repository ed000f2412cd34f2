"""The rules: what DSV4 users keep getting wrong, each with a message that says what to change.

Every rule is a function from a resolved preset to findings; :data:`SERVE_RULES`
and :data:`BENCH_RULES` list them with a one-line summary (``dsv4 validate
--rules`` prints them).  None of them needs vLLM: option names and value types
are checked against the option tables shipped in :mod:`dsv4_presets.schema`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsv4_presets.findings import Finding
from dsv4_presets.presets import BenchConfig, ServeConfig
from dsv4_presets.schema import OptionTable, check_value, shipped_table

# kv-cache-dtype values that select DSV4's UE8M0 FP8 page layout ("fp8" is
# vLLM's alias for fp8_ds_mla on DSV4's FlashMLA sparse backend).
DSV4_KV_CACHE_DTYPES = ("fp8", "fp8_ds_mla")
DSV4_BLOCK_SIZE = 256

# Option values that need Blackwell (SM 10.x) and fail or are refused on Hopper.
# From vLLM 0.32's kernels: each one's capability check names SM100.
BLACKWELL_ONLY: dict[str, dict[str, str]] = {
    "attention-backend": {
        "FLASHINFER_MLA_SPARSE_DSV4": "FlashInfer's DSV4 sparse MLA runs on SM 10.x/12.x only",
        "FLASHINFER_MLA_SPARSE": "FlashInfer's TRT-LLM sparse MLA kernels run on SM 10.x only",
        "FLASHINFER_MLA": "FlashInfer's MLA kernels run on SM 10.x only",
        "CUTLASS_MLA": "CUTLASS MLA kernels run on SM 10.x only",
        "TOKENSPEED_MLA": "TokenSpeed MLA kernels run on SM 10.x only",
    },
    "moe-backend": {
        "flashinfer_trtllm": "TRT-LLM-gen MXFP4 MoE kernels run on SM 10.x only",
    },
    "kv-cache-dtype": {
        "nvfp4": "FP4 KV cache needs Blackwell's FP4 tensor cores",
        "nvfp4_ds_mla": "FP4 KV cache needs Blackwell's FP4 tensor cores",
    },
}

# Speculative methods that need a separate draft model (``speculative-config.model``).
DRAFT_MODEL_METHODS = ("eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "dflash")
# Methods that need no weights at all.
MODEL_FREE_METHODS = ("ngram", "ngram_gpu", "suffix")


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("true", "1", "yes"))


def _int(value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool):
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


# --------------------------------------------------------------------------- #
# Option names and values
# --------------------------------------------------------------------------- #


def check_options(args: dict[str, Any], table: OptionTable, what: str) -> list[Finding]:
    """Unknown option names and values of the wrong type or outside the choices."""
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
        problem = check_value(spec, value)
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
    if _int(value, -1) == DSV4_BLOCK_SIZE and not isinstance(value, bool):
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


def rule_blackwell_only(config: ServeConfig) -> list[Finding]:
    """Blackwell-only options on a Hopper (or other non-Blackwell) preset."""
    arch = str(config.hardware.get("arch", "")).lower()
    if not arch or arch == "blackwell":
        return []
    gpu = config.hardware.get("name", arch)
    findings = []
    for key, values in BLACKWELL_ONLY.items():
        value = config.args.get(key)
        if value is None:
            continue
        lookup = {k.lower(): (k, why) for k, why in values.items()}
        hit = lookup.get(str(value).lower())
        if hit:
            findings.append(
                Finding(
                    "error",
                    "blackwell-only",
                    f"{key}: {hit[0]} on {gpu} ({arch}): {hit[1]}; remove {key} "
                    "(vLLM picks the Hopper kernel) or use a B200 preset",
                )
            )
    return findings


def _speculative_method(config: ServeConfig) -> tuple[str | None, dict[str, Any]]:
    spec = config.args.get("speculative-config")
    spec = spec if isinstance(spec, dict) else {}
    method = spec.get("method", config.args.get("spec-method"))
    return (None if method is None else str(method)), spec


def rule_speculative_method(config: ServeConfig) -> list[Finding]:
    """The speculative method must be one the checkpoint's weights support."""
    method, spec = _speculative_method(config)
    if method is None:
        return []
    supported = [str(m) for m in config.checkpoint.get("speculative_methods", [])]
    ckpt = config.checkpoint.get("name", "this checkpoint")
    if method in MODEL_FREE_METHODS or method in supported:
        return []
    has_draft = bool(spec.get("model") or config.args.get("spec-model"))
    if method in DRAFT_MODEL_METHODS and has_draft:
        return []
    use = f"use method: {supported[0]}" if supported else "remove speculative-config"
    if method in DRAFT_MODEL_METHODS:
        reason = f"method {method!r} needs a separate draft model (speculative-config.model)"
    else:
        reason = f"{ckpt}'s weights do not provide {method!r} drafting"
    shipped = ", ".join(supported) if supported else "none"
    return [
        Finding(
            "error",
            "speculative-method",
            f"speculative method {method!r} does not match {ckpt}: {reason}; "
            f"it ships draft layers for: {shipped}; {use}",
        )
    ]


def rule_tp_fp8_alignment(config: ServeConfig) -> list[Finding]:
    """Tensor-parallel sizes must split the heads into whole FP8 weight blocks."""
    heads = _int(config.checkpoint.get("num_attention_heads"), 0)
    head_dim = _int(config.checkpoint.get("head_dim"), 0)
    block = _int(config.checkpoint.get("fp8_weight_block"), 0)
    tp = _int(config.args.get("tensor-parallel-size"), 1)
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
    if _truthy(config.args.get("enable-auto-tool-choice")) and not config.args.get(
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


def rule_gpus_per_node(config: ServeConfig) -> list[Finding]:
    """One node's engines must fit on its GPUs."""
    gpus = _int(config.hardware.get("gpus_per_node"), 0)
    if gpus < 1:
        return []
    tp = _int(config.args.get("tensor-parallel-size"), 1)
    pp = _int(config.args.get("pipeline-parallel-size"), 1)
    dp = _int(config.args.get("data-parallel-size"), 1)
    dp_local = _int(config.args.get("data-parallel-size-local"), dp)
    need = tp * pp * dp_local
    if need <= gpus:
        return []
    gpu = config.hardware.get("name", "GPU")
    return [
        Finding(
            "error",
            "gpus-per-node",
            f"this node would run tensor-parallel {tp} x pipeline-parallel {pp} x "
            f"local data-parallel {dp_local} = {need} GPUs, but the node has {gpus} {gpu} GPUs: "
            "lower tensor-parallel-size or data-parallel-size-local",
        )
    ]


def rule_dp_topology(config: ServeConfig) -> list[Finding]:
    """Multi-node data parallel: ranks, addresses and headless workers must agree."""
    findings: list[Finding] = []
    dp = _int(config.args.get("data-parallel-size"), 1)
    dp_local = config.args.get("data-parallel-size-local")
    local = _int(dp_local, dp)
    start = config.args.get("data-parallel-start-rank")
    headless = _truthy(config.args.get("headless"))
    backend = str(config.args.get("data-parallel-backend", "mp"))
    if local < 1 or dp < 1:
        return findings
    if dp % local:
        findings.append(
            Finding(
                "error",
                "dp-topology",
                f"data-parallel-size {dp} is not a multiple of data-parallel-size-local "
                f"{local}: every node must run the same number of ranks",
            )
        )
    multi_node = dp > local
    if (
        multi_node
        and config.args.get("data-parallel-address") in (None, "")
        and not (config.required.get("data-parallel-address"))
    ):
        findings.append(
            Finding(
                "error",
                "dp-topology",
                f"data-parallel-size {dp} spans nodes ({local} per node) but "
                "data-parallel-address is not set: set it to the head node's IP on every node",
            )
        )
    if headless and backend == "ray":
        findings.append(
            Finding(
                "error",
                "dp-topology",
                "headless is for vLLM's native (mp) data parallel; with data-parallel-backend "
                "ray the workers join the Ray cluster (ray start) and run no vllm serve",
            )
        )
    if headless and start is None and backend != "ray":
        findings.append(
            Finding(
                "error",
                "dp-topology",
                "a headless node needs data-parallel-start-rank (its first rank: node index "
                f"x {local})",
            )
        )
    if start is not None:
        first = _int(start, -1)
        if first < 0 or first >= dp or first % local:
            findings.append(
                Finding(
                    "error",
                    "dp-topology",
                    f"data-parallel-start-rank {start!r} must be a multiple of "
                    f"data-parallel-size-local ({local}) below data-parallel-size ({dp})",
                )
            )
        elif first == 0 and headless:
            findings.append(
                Finding(
                    "error",
                    "dp-topology",
                    "the node with data-parallel-start-rank 0 is the head and must not be headless",
                )
            )
    if config.nodes and multi_node and backend != "ray":
        serving = [n for n in config.nodes if n.serve]
        if len(serving) * local != dp:
            findings.append(
                Finding(
                    "error",
                    "dp-topology",
                    f"{len(serving)} node kinds x {local} local ranks != data-parallel-size "
                    f"{dp}; add a node entry per node (with its data-parallel-start-rank)",
                )
            )
    return findings


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
    if config.dataset_name == "random" and not _truthy(config.get("ignore-eos")):
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
    """A named check and what it is for."""

    name: str
    summary: str
    check: Callable[[Any], list[Finding]]


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
    Rule("blackwell-only", "no Blackwell-only kernels on Hopper", rule_blackwell_only),
    Rule(
        "speculative-method",
        "speculative method matches the checkpoint's draft layers",
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
    """All serve rules on one node's configuration."""
    findings: list[Finding] = []
    for rule in SERVE_RULES:
        findings += rule.check(config)
    return findings


def check_bench(config: BenchConfig) -> list[Finding]:
    """All bench rules."""
    findings: list[Finding] = []
    for rule in BENCH_RULES:
        findings += rule.check(config)
    return findings

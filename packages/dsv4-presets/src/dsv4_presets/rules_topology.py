"""Rules about where engines run: GPUs per node, multi-node data parallel, same-host roles.

Each rule is a function from one node's resolved preset to findings (see
:mod:`dsv4_presets.rules` for the list).  The small value helpers used by
every rule module live here too.
"""

from __future__ import annotations

from typing import Any

from dsv4_presets.configs import ServeConfig
from dsv4_presets.findings import Finding

__all__ = [
    "as_int",
    "rule_dp_topology",
    "rule_gpus_per_node",
    "rule_same_host_split",
    "truthy",
]


def truthy(value: Any) -> bool:
    """True for YAML/CLI spellings of on (``true``, ``"1"``, ``"yes"``)."""
    return value is True or (isinstance(value, str) and value.lower() in ("true", "1", "yes"))


def as_int(value: Any, default: int) -> int:
    """``value`` as an int, or ``default`` when it is unset, a boolean or not a number."""
    if value is None:
        return default
    if isinstance(value, bool):
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _gpus_used(config: ServeConfig) -> int:
    tp = as_int(config.args.get("tensor-parallel-size"), 1)
    pp = as_int(config.args.get("pipeline-parallel-size"), 1)
    dp = as_int(config.args.get("data-parallel-size"), 1)
    return tp * pp * as_int(config.args.get("data-parallel-size-local"), dp)


def rule_gpus_per_node(config: ServeConfig) -> list[Finding]:
    """One node's engines must fit on its GPUs (all roles together on a shared host)."""
    gpus = as_int(config.hardware.get("gpus_per_node"), 0)
    if gpus < 1:
        return []
    gpu = config.hardware.get("name", "GPU")
    if config.same_host and config.nodes:
        roles = [c for c in config.all_nodes() if c.node_spec is None or c.node_spec.serve]
        need = sum(_gpus_used(c) for c in roles)
        if need <= gpus:
            return []
        parts = " + ".join(f"{c.node} {_gpus_used(c)}" for c in roles)
        return [
            Finding(
                "error",
                "gpus-per-node",
                f"the roles sharing this node need {parts} = {need} GPUs, but the node has "
                f"{gpus} {gpu} GPUs: shrink a role's tensor-parallel-size",
            )
        ]
    tp = as_int(config.args.get("tensor-parallel-size"), 1)
    pp = as_int(config.args.get("pipeline-parallel-size"), 1)
    dp = as_int(config.args.get("data-parallel-size"), 1)
    dp_local = as_int(config.args.get("data-parallel-size-local"), dp)
    need = tp * pp * dp_local
    if need <= gpus:
        return []
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
    dp = as_int(config.args.get("data-parallel-size"), 1)
    dp_local = config.args.get("data-parallel-size-local")
    local = as_int(dp_local, dp)
    start = config.args.get("data-parallel-start-rank")
    headless = truthy(config.args.get("headless"))
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
    # vLLM's Ray backend takes the head's own IP when no address is given
    # (EngineArgs.create_engine_config); only the native (mp) backend needs one.
    if (
        multi_node
        and backend != "ray"
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
        first = as_int(start, -1)
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


def _devices(config: ServeConfig) -> list[str] | None:
    text = config.env.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    return [d.strip() for d in str(text).split(",") if d.strip()]


def rule_same_host_split(config: ServeConfig) -> list[Finding]:
    """Roles sharing one node (prefill/decode): own GPUs, own ports, one KV connector."""
    if not (config.same_host and config.nodes):
        return []
    roles = [c for c in config.all_nodes() if c.node_spec is None or c.node_spec.serve]
    findings: list[Finding] = []

    def error(message: str) -> None:
        findings.append(Finding("error", "same-host-split", message))

    seen: dict[str, str] = {}
    for role in roles:
        devices = _devices(role)
        if devices is None:
            error(
                f"role {role.node} sets no CUDA_VISIBLE_DEVICES: every role on a shared node "
                "needs its own GPUs (env CUDA_VISIBLE_DEVICES on the node entry)"
            )
            continue
        if len(devices) != _gpus_used(role):
            error(
                f"role {role.node} sees {len(devices)} GPUs ({','.join(devices)}) but runs "
                f"{_gpus_used(role)} (tensor x pipeline x local data parallel)"
            )
        for device in devices:
            if device in seen:
                error(f"GPU {device} is given to both {seen[device]} and {role.node}")
            seen[device] = str(role.node)
    for option, what in (("port", "API port"), ("VLLM_NIXL_SIDE_CHANNEL_PORT", "NIXL port")):
        values = [
            (str(r.node), r.env.get(option) if option.isupper() else r.args.get(option))
            for r in roles
        ]
        used = [v for _, v in values if v is not None]
        if option == "port" and len(used) != len(roles):
            error("every role on a shared node needs its own port (args: port: ...)")
        if len(set(map(str, used))) != len(used):
            error(f"roles share a {what}: " + ", ".join(f"{n}={v}" for n, v in values))
    connectors = {str(r.node): r.args.get("kv-transfer-config") for r in roles}
    names = {
        n: (c.get("kv_connector") if isinstance(c, dict) else None) for n, c in connectors.items()
    }
    if any(v is None for v in names.values()) or len(set(names.values())) != 1:
        error(
            "the roles must move the KV cache through one kv-transfer-config connector; got "
            + ", ".join(f"{n}: {v}" for n, v in names.items())
        )
    elif "mooncake" in str(next(iter(names.values()))).lower():
        role_of = {n: (c or {}).get("kv_role") for n, c in connectors.items()}
        if sorted(map(str, role_of.values())) != ["kv_consumer", "kv_producer"]:
            error(
                "MooncakeConnector needs one kv_producer (prefill) and one kv_consumer "
                "(decode) role; got " + ", ".join(f"{n}: {v}" for n, v in role_of.items())
            )
    return findings

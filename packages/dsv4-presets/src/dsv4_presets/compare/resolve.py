"""Turning what the user asked for (SPECs, a bench name) into what a campaign runs.

Through the presets: a variant SPEC resolves to the exact ``vllm serve``
command, environment and vLLM build of its server; the bench preset to the
``vllm bench serve`` arguments both variants share.  Both are validated with
the DSV4 rules (and vLLM's parser when it imports) unless ``--no-validate``.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from .campaign import ResolvedBench, ResolvedVariant
from .spec import VariantSpec

__all__ = ["resolve_bench_spec", "resolve_variant"]


_SKIPPED: dict[str, Any] = {"status": "skipped", "why": "--no-validate"}


def _validate(config: Any, arg: str, what: str) -> dict[str, Any]:
    """Our DSV4 rules plus, when vLLM imports here, vLLM's own checks; raises on errors.

    Returns the record kept with the campaign (status and every finding).
    """
    from ..validate import validate

    findings = list(validate(config))
    errors = [f for f in findings if f.level == "error"]
    if errors:
        lines = "\n  ".join(str(f) for f in errors)
        raise ValueError(
            f"{arg}: {what} does not pass validation:\n  {lines}\n"
            "fix it, or pass --no-validate to compare anyway (recorded in the report)"
        )
    return {"status": "passed", "findings": [str(f) for f in findings]}


def resolve_variant(
    spec: VariantSpec,
    *,
    model: str | None,
    sets: Sequence[str],
    env: Sequence[tuple[str, str]],
    validate: bool,
) -> ResolvedVariant:
    """Turn a parsed SPEC into the server command it runs (through the presets)."""
    from .. import presets
    from ..vllm_exec import vllm_command

    arg = f"--{spec.variant.lower()}"
    try:
        config = presets.resolve_serve(spec.source, model=model, sets=(*sets, *spec.sets))
    except ValueError as exc:
        raise ValueError(f"{arg}: {exc}") from None
    if getattr(config, "nodes", ()):
        raise ValueError(
            f"{arg}: preset {config.name!r} is a multi-node preset; dsv4 compare starts "
            "single-node servers on this machine (compare the head node's preset on one node)"
        )
    merged_env = {**config.env, **dict(env), **dict(spec.env)}
    if spec.vllm is not None:
        vllm = tuple(spec.vllm)
    elif merged_env.get("DSV4_VLLM"):
        vllm = tuple(shlex.split(merged_env["DSV4_VLLM"]))
    else:
        vllm = tuple(vllm_command())
    served = config.args.get("served-model-name")
    if isinstance(served, list):
        served = served[0] if served else None
    served_model = str(served) if served else config.model
    tokenizer = config.args.get("tokenizer")
    if tokenizer is None and served_model != config.model:
        tokenizer = config.model
    validation = _validate(config, arg, "the preset") if validate else _SKIPPED
    return ResolvedVariant(
        spec=spec,
        preset=config.name,
        model=config.model,
        served_model=served_model,
        tokenizer=str(tokenizer) if tokenizer is not None else None,
        serve_args=tuple(config.to_argv()),
        env=merged_env,
        vllm=vllm,
        validation=validation,
        config={
            "args": dict(config.args),
            "env": dict(config.env),
            "sources": list(getattr(config, "sources", ())),
        },
    )


def resolve_bench_spec(
    name: str, *, sets: Sequence[str], bench_vllm: str | None, validate: bool = True
) -> ResolvedBench:
    """The benchmark both variants run, through the bench presets."""
    from .. import presets
    from ..vllm_exec import vllm_command

    try:
        config = presets.resolve_bench(name, sets=tuple(sets))
    except ValueError as exc:
        raise ValueError(f"--bench: {exc}") from None
    if validate:
        _validate(config, "--bench", "the bench preset")
    if bench_vllm is not None:
        words = shlex.split(bench_vllm)
        if not words:
            raise ValueError("--bench-vllm: expected a command, got nothing")
        vllm = tuple(words)
    else:
        vllm = tuple(vllm_command())
    return ResolvedBench(
        name=config.name, num_prompts=int(config.num_prompts), vllm=vllm, build_args=config.to_argv
    )

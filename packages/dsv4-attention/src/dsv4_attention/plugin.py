"""vLLM general plugin: put dsv4-kernels and the head-exact prefill into vLLM's DSV4 path.

vLLM runs :func:`register` (entry point group ``vllm.general_plugins``) in
every process it starts, before any model is built and whatever model is
served, and does not catch what a plugin raises.  So :func:`register` is cheap
and cannot fail:

* it reads two environment switches and vLLM's version, and otherwise only
  installs an import hook.  Nothing of vLLM's DSV4 code is imported or changed
  until ``vllm.models.deepseek_v4`` is first imported by vLLM itself; a process
  serving another model never pays for it;
* when that package has been imported, the plugin builds the whole set of
  changes for the platform (``vllm_targets``), checking the signature of every
  function it replaces and that every module which imported one by name holds
  vLLM's function.  Only if every check passes does it apply all changes; on
  an unknown vLLM version, a changed signature or any exception it changes
  nothing and logs one warning saying why.  It never half-patches;
* it logs through vLLM's logger, so its one line per process shows in
  ``vllm serve``'s output:
  ``dsv4-attention <version>: active on vLLM <version> (<platform>); replaced: ...``
  or ``dsv4-attention <version>: inactive on vLLM <version>: <reason>``.

Switches: ``DSV4_KERNELS_DISABLE=1`` turns the whole plugin off (the A/B
switch ``dsv4 compare`` uses); ``DSV4_PREFILL_DISABLE=1`` keeps vLLM's own
sparse-MLA prefill while still replacing the metadata kernels;
``DSV4_KERNELS_FORCE=1`` applies the CUDA set on other platforms (tests on
vLLM's CPU build; our functions run their torch references on CPU tensors).
Everything is reversible with :func:`unregister`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import vllm_targets as targets

ENV_DISABLE = "DSV4_KERNELS_DISABLE"
ENV_FORCE = "DSV4_KERNELS_FORCE"
ENV_PREFILL_DISABLE = "DSV4_PREFILL_DISABLE"
LOGGER_NAME = "vllm.dsv4_attention"  # under "vllm" so vLLM's handler prints it


@dataclass(frozen=True)
class _Patch:
    module: ModuleType
    name: str
    original: Any
    replacement: Any


class _Inactive(Exception):
    """A reason to leave vLLM unchanged (logged at info level)."""


class _Refused(Exception):
    """vLLM is not what the plugin was written against (logged as a warning)."""


_APPLIED: list[_Patch] = []
_STATE: dict[str, Any] = {"hook": None, "decided": False, "facts": None}


def _facts() -> targets.ReleaseFacts:
    """The facts of the running vLLM's release (register() checked it is supported)."""
    facts = _STATE["facts"] or targets.facts_for(_vllm_version())
    if facts is None:
        raise _Refused(f"unsupported vLLM version (supported: {targets.supported_text()})")
    return facts


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _our_version() -> str:
    from . import __version__

    return __version__


def _logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger
    except Exception:  # vLLM without its logger module: a plain logger
        return logging.getLogger(LOGGER_NAME)
    return init_logger(LOGGER_NAME)


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _say_inactive(reason: str, *, warning: bool) -> None:
    _STATE["decided"] = True
    line = f"dsv4-attention {_our_version()}: inactive on vLLM {_vllm_version()}: {reason}"
    if warning:
        _logger().warning(line)
    else:
        _logger().info(line)


# --- the import hook ----------------------------------------------------------


class _PatchAfterExec(importlib.abc.Loader):
    """Runs vLLM's loader for the DSV4 package, then decides and patches."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _remove_hook()
        _activate_safely()

    def __getattr__(self, name: str) -> Any:  # get_code, is_package, resource readers, ...
        return getattr(self._loader, name)


class _Dsv4ImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``vllm.models.deepseek_v4`` only."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != targets.DSV4_PACKAGE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchAfterExec(spec.loader)
        return spec


def _remove_hook() -> None:
    hook = _STATE["hook"]
    if hook is not None and hook in sys.meta_path:
        sys.meta_path.remove(hook)
    _STATE["hook"] = None


# --- deciding and patching --------------------------------------------------------


def _check_signature(function: Any, name: str) -> None:
    expected = _facts().signatures[name]
    try:
        found = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError) as exc:
        raise _Refused(f"cannot read the signature of vLLM's {name}: {exc}") from exc
    if found != expected:
        raise _Refused(
            f"vLLM's {name} has parameters {found}, expected {expected}; "
            "this vLLM is not the one the plugin was written against"
        )


def _platform() -> tuple[str, bool]:
    from vllm.platforms import current_platform

    return str(getattr(current_platform, "device_name", "unknown")), bool(
        current_platform.is_cuda()
    )


def _gather_replaced() -> bool:
    """Our gather runs only where vLLM would run its Triton gather (no CuTe-DSL)."""
    from vllm.utils.import_utils import has_cutedsl

    return targets.GATHER_ON_CUDA == "always" or (
        targets.GATHER_ON_CUDA == "when-no-cutedsl" and not has_cutedsl()
    )


def _plan() -> tuple[list[_Patch], str]:
    """Every change for this process, checked; raises _Inactive or _Refused instead."""
    platform, is_cuda = _platform()
    if not is_cuda and not _flag(ENV_FORCE):
        raise _Inactive(
            f"platform {platform}: nothing here is measured faster than vLLM's own "
            f"kernels there (set {ENV_FORCE}=1 to apply the CUDA set)"
        )
    ops = importlib.import_module(targets.OPS_MODULE)
    names = list(targets.CUDA_OPS)
    if _gather_replaced():
        names.append("dequantize_and_gather_k_cache")
    from .adapters import replacements

    ours = replacements({name: getattr(ops, name, None) for name in names})
    patches: list[_Patch] = []
    for name in names:
        original = getattr(ops, name, None)
        if not callable(original):
            raise _Refused(f"{targets.OPS_MODULE} has no function {name}")
        _check_signature(original, name)
        patches.append(_Patch(ops, name, original, ours[name]))
        for consumer_name in _facts().consumers[name]:
            consumer = importlib.import_module(consumer_name)
            if getattr(consumer, name, None) is not original:
                raise _Refused(f"{consumer_name}.{name} is not vLLM's {name}")
            patches.append(_Patch(consumer, name, original, ours[name]))
    labels = list(names)
    from .vllm_backend import (
        C4A_SHORT_ROWS_MEAN_KEYS,
        ENV_DECODE_DISABLE,
        ENV_MAX_HEADS,
        decode_enabled,
        max_heads,
        short_rows_max_heads,
    )

    heads, shared_heads, short_heads = max_heads(4), max_heads(1), short_rows_max_heads()
    prefill_on = not _flag(ENV_PREFILL_DISABLE) and max(heads, shared_heads) > 0
    decode_on = decode_enabled()
    notes = []
    if _flag(ENV_PREFILL_DISABLE):
        notes.append(f"prefill stays vLLM's ({ENV_PREFILL_DISABLE}=1)")
    elif not prefill_on:
        notes.append(
            "prefill stays vLLM's (its FlashMLA prefill is measured faster on this GPU; "
            f"{ENV_MAX_HEADS}=N enables the head-exact prefill up to N local heads)"
        )
    else:
        c4a = f"up to {heads} local heads"
        if short_heads > heads:
            c4a += (
                f", or {short_heads} in steps whose rows average at most "
                f"{C4A_SHORT_ROWS_MEAN_KEYS} valid keys per token"
            )
        limit = (
            f"up to {heads} local heads"
            if heads == shared_heads and short_heads <= heads
            else f"on C4A layers {c4a}; on SWA-only and C128A layers up to {shared_heads}"
        )
        labels.append(f"DeepseekV4FlashMLAAttention._forward_prefill (head-exact prefill {limit})")
    if decode_on:
        labels.append(
            "DeepseekV4FlashMLAAttention._forward_decode (head-exact decode up to 16 local "
            "heads at the step sizes measured faster, dsv4_attention.decode_table)"
        )
    elif _flag(ENV_DECODE_DISABLE):
        notes.append(f"decode stays vLLM's ({ENV_DECODE_DISABLE}=1)")
    else:
        notes.append("decode stays vLLM's (the head-exact decode is measured on Hopper only)")
    if prefill_on or decode_on:
        patches.append(_attention_patch())
        labels.append("scratch reserved and kernels compiled in vLLM's profile run")
    prefill = "; ".join(notes)
    summary = f"({platform}); replaced: {', '.join(labels)}"
    return patches, f"{summary}; {prefill}" if prefill else summary


def _attention_patch() -> _Patch:
    """``_select_dsv4_attn_cls`` returns our subclass where vLLM picks FlashMLA."""
    from .vllm_backend import make_head_exact_attention_cls

    model = importlib.import_module(targets.MODEL_MODULE)
    flashmla = importlib.import_module(targets.FLASHMLA_MODULE)
    select = getattr(model, "_select_dsv4_attn_cls", None)
    base = getattr(flashmla, "DeepseekV4FlashMLAAttention", None)
    if not callable(select) or not isinstance(base, type):
        raise _Refused("vLLM's DSV4 attention selector or FlashMLA attention class is missing")
    _check_signature(select, "_select_dsv4_attn_cls")
    _check_signature(getattr(base, "_forward_prefill", None), "_forward_prefill")
    _check_signature(getattr(base, "forward_mqa", None), "forward_mqa")
    _check_signature(getattr(base, "_forward_decode", None), "_forward_decode")
    _configure_backend()
    ours = make_head_exact_attention_cls(base)

    def _select_dsv4_attn_cls(vllm_config: Any) -> type:
        chosen = select(vllm_config)
        return ours if chosen is base else chosen

    _select_dsv4_attn_cls.__wrapped__ = select  # type: ignore[attr-defined]
    return _Patch(model, "_select_dsv4_attn_cls", select, _select_dsv4_attn_cls)


def _configure_backend() -> None:
    """Point the backend at vLLM's forward context, workspace manager and log."""
    from .vllm_backend import configure_runtime

    facts = _facts()
    context = importlib.import_module(facts.forward_context_module)
    workspace = importlib.import_module(facts.workspace_module)
    ubatching = importlib.import_module(facts.ubatching_module)
    for module, name in (
        (ubatching, "dbo_enabled"),
        (context, "is_forward_context_available"),
        (context, "get_forward_context"),
        (workspace, "current_workspace_manager"),
        (workspace, "is_workspace_manager_initialized"),
    ):
        if not callable(getattr(module, name, None)):
            raise _Refused(f"{module.__name__} has no function {name}")

    def forward_context() -> Any:
        return context.get_forward_context() if context.is_forward_context_available() else None

    def manager() -> Any:
        return (
            workspace.current_workspace_manager()
            if workspace.is_workspace_manager_initialized()
            else None
        )

    configure_runtime(
        forward_context=forward_context,
        workspace=manager,
        log=_logger().info,
        dual_batch=ubatching.dbo_enabled,
    )


def _activate_safely() -> None:
    """Decide once for this process; any failure leaves vLLM exactly as it was."""
    if _STATE["decided"]:
        return
    try:
        patches, summary = _plan()
    except _Inactive as reason:
        _say_inactive(str(reason), warning=False)
        return
    except _Refused as reason:
        _say_inactive(f"{reason}; nothing patched", warning=True)
        return
    except Exception as exc:  # never let the plugin stop vLLM
        _say_inactive(f"unexpected {type(exc).__name__}: {exc}; nothing patched", warning=True)
        return
    for patch in patches:
        setattr(patch.module, patch.name, patch.replacement)
    _APPLIED.extend(patches)
    _STATE["decided"] = True
    _logger().info(
        "dsv4-attention %s: active on vLLM %s %s", _our_version(), _vllm_version(), summary
    )


# --- public API ---------------------------------------------------------------------


def register() -> None:
    """Entry point for vLLM's plugin loader; cheap, safe to call more than once, never raises."""
    if _STATE["decided"] or _STATE["hook"] is not None:
        return
    try:
        if _flag(ENV_DISABLE):
            _say_inactive(f"disabled by {ENV_DISABLE}=1", warning=False)
            return
        version = _vllm_version()
        _STATE["facts"] = targets.facts_for(version)
        if _STATE["facts"] is None:
            _say_inactive(
                f"unsupported vLLM version {version} (supported: {targets.supported_text()}); "
                "nothing patched",
                warning=True,
            )
            return
        if targets.DSV4_PACKAGE in sys.modules:
            _activate_safely()
            return
        hook = _Dsv4ImportHook()
        _STATE["hook"] = hook
        sys.meta_path.insert(0, hook)
    except Exception as exc:  # never let the plugin stop vLLM
        _remove_hook()
        try:
            _say_inactive(f"unexpected {type(exc).__name__}: {exc}; nothing patched", warning=True)
        except Exception:
            logging.getLogger(LOGGER_NAME).warning("dsv4-attention: inactive (%s)", exc)


def unregister() -> None:
    """Put back everything :func:`register` changed and forget the decision."""
    _remove_hook()
    for patch in reversed(_APPLIED):
        if getattr(patch.module, patch.name, None) is patch.replacement:
            setattr(patch.module, patch.name, patch.original)
    _APPLIED.clear()
    _STATE["decided"] = False
    _STATE["facts"] = None


def patched() -> list[str]:
    """``module.name`` for every place that currently holds one of our replacements."""
    return sorted(
        f"{patch.module.__name__}.{patch.name}"
        for patch in _APPLIED
        if getattr(patch.module, patch.name, None) is patch.replacement
    )


def is_active() -> bool:
    """Whether this process runs with the plugin's replacements in place."""
    return bool(patched())

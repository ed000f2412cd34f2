"""vLLM general plugin: put dsv4-kernels and the head-exact paths into vLLM's DSV4 path.

vLLM runs :func:`register` (entry point group ``vllm.general_plugins``) in
every process it starts, before any model is built and whatever model is
served, and does not catch what a plugin raises.  So :func:`register` is cheap
and cannot fail, and nothing changes in a process that does not build a
DeepSeek-V4 model:

* :func:`register` reads the environment switches and vLLM's version, and
  otherwise installs an import hook;
* vLLM's CUDA model runners import ``vllm.models.deepseek_v4`` in every worker
  (their EPLB helpers do), whatever the model; ``vllm.models.deepseek_v41`` is
  imported where a DeepSeek-V4.1 model is built.  When one of them is imported,
  the plugin checks the signatures of everything it may replace for that family
  and then wraps only its ``_select_dsv4_attn_cls``, which vLLM calls only when
  it builds an attention layer of that family, with a pass-through; where vLLM's
  current config already names a model of neither family, it installs nothing
  and logs ``not active`` (the other family's package, imported in passing, is
  left alone);
* the first call of that selector while an engine builds its model is that
  engine's start-up decision (an engine is known by its workspace manager, so a
  second engine in the process decides anew): the served configuration is read
  once (``dsv4_attention.facts``), the GPU's own measured table is looked up
  (``dsv4_attention.tables``, by exact device name; a GPU never measured gets
  nothing replaced and a line naming the command that measures its table), one
  :class:`~dsv4_attention.runtime.HeadExactRuntime` is built for the engine, the
  ops replacements are applied (the first engine's, process-wide, each falling
  back to vLLM's own on an error of ours), and one line says what was replaced
  for which model:
  ``dsv4-attention <version>: active for DeepseekV4ForCausalLM on vLLM <version> (...)``;
  each layer kind then logs its own decision in vLLM's profile run.  Any
  failure there replaces nothing and logs ``not active`` with the reason.
  For DeepSeek-V4.1 the same runtime subclasses V4.1's own FlashMLA class
  (its ops are never replaced); on vLLM 0.33 and SM90, V4 layers where the
  measured table says so run vLLM's own prefill at the real heads
  (``dsv4_attention.native``).

Switches: ``DSV4_KERNELS_DISABLE=1`` turns the whole plugin off (the A/B
switch ``dsv4 compare`` uses); ``DSV4_PREFILL_DISABLE=1`` / ``DSV4_DECODE_DISABLE=1``
keep vLLM's own prefill / decode; ``DSV4_PREFILL_MAX_HEADS=N`` overrides the
measured head limit of the prefill; ``DSV4_TABLES_DIR=DIR`` adds tables a user
measured; ``DSV4_KERNELS_FORCE=1`` decides as on the H200 on other platforms
(tests on vLLM's CPU build; our functions run their torch references on CPU
tensors).  Everything is reversible with :func:`unregister`.  Design:
``docs/design.md``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import vllm_targets as targets
from .vllm_targets import V41_ARCHITECTURES

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
# The plugin's one record in this process (vLLM's loader calls module functions):
# the import hook, the selector trigger, whether the start-up decision was made,
# the release facts, and what the decision built (the runtime object and our class).
_STATE: dict[str, Any] = {
    "hook": None,
    "triggers": {},  # family -> _Patch of its selector
    "decided": False,
    "facts": None,
    "runtime": None,  # the last engine's runtime, held while that engine lives
    "cls": None,  # the last engine's attention class, likewise
    "family": None,
    "ops_guard": None,  # how the replaced ops fall back (adapters.OpsGuard)
    "engine": None,  # weakref to the engine the runtime is for (_engine_of)
    "replaced": [],  # what the first activation replaced (named in later engines' lines)
}
ENV_STARTUP_PLAN = "VLLM_ENABLE_STARTUP_PLAN"


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
    """Runs vLLM's loader for a DSV4 family's package, then installs its trigger."""

    def __init__(self, loader: importlib.abc.Loader, family: str) -> None:
        self._loader = loader
        self._family = family

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        hook = _STATE["hook"]
        if hook is not None:
            hook.packages.pop(module.__name__, None)
            if not hook.packages:
                _remove_hook()
        _activate_safely(self._family)

    def __getattr__(self, name: str) -> Any:  # get_code, is_package, resource readers, ...
        return getattr(self._loader, name)


class _Dsv4ImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loaders of the DSV4 families' packages only
    (``vllm.models.deepseek_v4``, ``vllm.models.deepseek_v41``)."""

    def __init__(self, packages: dict[str, str]) -> None:
        self.packages = packages  # package -> family, until imported

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        family = self.packages.get(fullname)
        if family is None:
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
        spec.loader = _PatchAfterExec(spec.loader, family)
        return spec


def _remove_hook() -> None:
    hook = _STATE["hook"]
    if hook is not None and hook in sys.meta_path:
        sys.meta_path.remove(hook)
    _STATE["hook"] = None


# --- deciding and patching --------------------------------------------------------

# Architectures the plugin acts on (vLLM's registry names), per family: DeepSeek-V4
# and its drafter; DeepSeek-V4.1 and its DSpark drafter (its own attention class).
V4_ARCHITECTURES = (
    "DeepseekV4ForCausalLM",
    "DeepseekV4ForConditionalGeneration",
    "DeepSeekV4MTPModel",
)
FAMILY_ARCHITECTURES = {"v4": V4_ARCHITECTURES, "v41": V41_ARCHITECTURES}
FAMILY_TEXT = {"v4": "DeepSeek-V4", "v41": "DeepSeek-V4.1"}


def _family_of(architectures: Sequence[str]) -> str | None:
    """The DSV4 family vLLM's config names (None: neither)."""
    for family, names in FAMILY_ARCHITECTURES.items():
        if set(architectures) & set(names):
            return family
    return None


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


def _served_architectures() -> tuple[str, ...]:
    """The architectures of vLLM's current config where one is set (empty otherwise)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except Exception:
        return ()
    config = get_current_vllm_config_or_none()
    model = getattr(config, "model_config", None)
    return tuple(getattr(model, "architectures", None) or ())


def _gather_replaced() -> bool:
    """Our gather runs only where vLLM would run its Triton gather (no CuTe-DSL)."""
    from vllm.utils.import_utils import has_cutedsl

    return targets.GATHER_ON_CUDA == "always" or (
        targets.GATHER_ON_CUDA == "when-no-cutedsl" and not has_cutedsl()
    )


def _ops_patches() -> tuple[list[_Patch], list[str]]:
    """The ops replacements (checked: signatures, and every module that imported one by
    name holds vLLM's function)."""
    ops = importlib.import_module(targets.OPS_MODULE)
    names = list(targets.CUDA_OPS)
    if _gather_replaced():
        names.append("dequantize_and_gather_k_cache")
    from .adapters import OpsGuard, replacements
    from .runtime import _capturing

    originals = {name: getattr(ops, name, None) for name in names}
    for name, original in originals.items():
        if not callable(original):
            raise _Refused(f"{targets.OPS_MODULE} has no function {name}")
        _check_signature(original, name)
    guard = OpsGuard(warning=_logger().warning, capturing=_capturing)
    _STATE["ops_guard"] = guard  # what the replaced ops fell back on (its ``failed``)
    ours = replacements(originals, guard)
    patches: list[_Patch] = []
    for name, original in originals.items():
        patches.append(_Patch(ops, name, original, ours[name]))
        for consumer_name in _facts().consumers[name]:
            consumer = importlib.import_module(consumer_name)
            if getattr(consumer, name, None) is not original:
                raise _Refused(f"{consumer_name}.{name} is not vLLM's {name}")
            patches.append(_Patch(consumer, name, original, ours[name]))
    return patches, names


def _vllm_classes(family: str) -> tuple[ModuleType, Any, type]:
    """A family's model module, its selector and its FlashMLA class, signatures checked."""
    _, model_module, flashmla_module = targets.FAMILY_MODULES[family]
    model = importlib.import_module(model_module)
    flashmla = importlib.import_module(flashmla_module)
    select = getattr(model, "_select_dsv4_attn_cls", None)
    base = getattr(flashmla, "DeepseekV4FlashMLAAttention", None)
    if not callable(select) or not isinstance(base, type):
        raise _Refused(
            f"vLLM's {FAMILY_TEXT[family]} attention selector or FlashMLA attention class is "
            "missing"
        )
    _check_signature(select, "_select_dsv4_attn_cls")
    for name in ("_forward_prefill", "forward_mqa", "_forward_decode", "_sparse_indexer_and_attn"):
        _check_signature(getattr(base, name, None), name)
    return model, select, base


def _access() -> Any:
    """How the runtime reaches vLLM: its forward context, workspace manager, logger,
    dual-batch state (modules named by the release's facts)."""
    from .runtime import VllmAccess

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

    # this engine's manager (vLLM makes one per worker; a second engine in the process
    # makes its own and replaces the module's current one), held weakly: it identifies
    # the engine, whose end lets the plugin drop the runtime (_hold_engine)
    engine_manager = (
        weakref.ref(workspace.current_workspace_manager())
        if workspace.is_workspace_manager_initialized()
        else None
    )

    def manager() -> Any:
        if engine_manager is not None:
            return engine_manager()
        return (
            workspace.current_workspace_manager()
            if workspace.is_workspace_manager_initialized()
            else None
        )

    parallel = importlib.import_module("vllm.distributed.parallel_state")

    def tp_group() -> Any:
        # vLLM's TP group of this rank (None before vLLM made its groups)
        ready = getattr(parallel, "model_parallel_is_initialized", None)
        if not callable(ready) or not ready():
            return None
        return parallel.get_tp_group()

    log = _logger()
    return VllmAccess(
        forward_context=forward_context,
        workspace=manager,
        info=log.info,
        warning=log.warning,
        dual_batch=ubatching.dbo_enabled,
        tp_group=tp_group,
    )


def _device(force: bool) -> Any:
    """The GPU as vLLM's platform reports it (NVML: no CUDA context is needed)."""
    from vllm.platforms import current_platform

    from .policy import Device

    if not current_platform.is_cuda():
        if force:
            return Device("NVIDIA H200 (forced)", (9, 0), wgmma=True, forced=True)
        name = getattr(current_platform, "device_name", "unknown")
        raise _Inactive(f"platform {name}: nothing is measured faster than vLLM's kernels there")
    capability = current_platform.get_device_capability()
    cap = None if capability is None else (int(capability.major), int(capability.minor))
    name = str(current_platform.get_device_name())
    wgmma = False
    if cap is not None and cap[0] == 9:
        from dsv4_kernels.sparse_mla import wgmma_available

        wgmma = bool(wgmma_available())
    return Device(name, cap, wgmma=wgmma)


def _native_prefill(device: Any) -> bool:
    """Whether vLLM's bundled FlashMLA runs the sparse prefill at the real heads here: a
    release whose FlashMLA documents it (0.33), an SM90 GPU, and FlashMLA available in
    this build (vLLM's own check)."""
    if not _facts().native_prefill_heads or device.forced:
        return False
    if device.capability is None or device.capability[0] != 9:
        return False
    ops = importlib.import_module("vllm.v1.attention.ops.flashmla")
    supported = getattr(ops, "is_flashmla_sparse_supported", None)
    return callable(supported) and bool(supported()[0])


def _native_patch() -> _Patch:
    """vLLM's ``flash_mla_sparse_fwd`` in its V4 FlashMLA module, wrapped to compute the
    real heads within ``native.real_heads`` (signature checked)."""
    from .native import wrap_sparse_fwd

    module = importlib.import_module(targets.FLASHMLA_MODULE)
    original = getattr(module, "flash_mla_sparse_fwd", None)
    if not callable(original):
        raise _Refused(f"{targets.FLASHMLA_MODULE} has no function flash_mla_sparse_fwd")
    _check_signature(original, "flash_mla_sparse_fwd")
    return _Patch(module, "flash_mla_sparse_fwd", original, wrap_sparse_fwd(original))


def _engine_of(vllm_config: Any) -> Any:
    """What identifies the engine building a layer: its workspace manager (vLLM makes one
    per worker at device initialisation, before the model is built; a second engine in
    the process makes its own), else its ``VllmConfig``."""
    try:
        workspace = importlib.import_module(_facts().workspace_module)
        if workspace.is_workspace_manager_initialized():
            return workspace.current_workspace_manager()
    except Exception:
        pass
    return vllm_config


def _same_engine(vllm_config: Any) -> bool:
    """Whether this process already decided for the engine now building layers."""
    held = _STATE["engine"]
    return held is not None and held() is _engine_of(vllm_config)


def _hold_engine(vllm_config: Any) -> None:
    """Remember the engine deciding now (weakly); when it is collected, the plugin lets
    go of its runtime and class, so nothing of ours keeps that engine's scratch alive
    (its layers hold their class, and the class its runtime, while the model lives)."""
    engine = _engine_of(vllm_config)

    def gone(ref: Any) -> None:
        if _STATE["engine"] is ref:
            _STATE.update(runtime=None, cls=None)

    try:
        # only a workspace manager's end is an engine's end (a config object may be a
        # temporary one: the engine is then known by it, and nothing is dropped)
        _STATE["engine"] = weakref.ref(engine, None if engine is vllm_config else gone)
    except TypeError:  # not weakly referable: held (a config, never GPU memory)
        _STATE["engine"] = lambda: engine


def _activate(vllm_config: Any, base: type, family: str = "v4") -> None:
    """The start-up decision of an engine (first call of a family's selector while that
    engine builds its model); never raises.  Each engine gets its own runtime, class and
    scratch; the ops replacements are process-wide, applied at the first activation."""
    _STATE["decided"] = True
    _hold_engine(vllm_config)
    _STATE.update(runtime=None, cls=None, family=None)
    try:
        from . import tables
        from .facts import read_serving_config
        from .policy import Switches
        from .runtime import HeadExactRuntime, make_attention_cls

        switches = Switches.read()
        serving = read_serving_config(vllm_config)
        if serving.architectures and _family_of(serving.architectures) != family:
            raise _Inactive(
                f"the model is {serving.model_text}; dsv4-attention acts on "
                f"{FAMILY_TEXT[family]} layers only when vLLM's config names that model"
            )
        device = _device(switches.force)
        table = tables.table_for(device.name, device.capability, switches.tables_dir)
        if table is None and device.forced:
            table = tables.table_for("NVIDIA H200")
        if table is None:
            measured = ", ".join(sorted({t.device_name for t in tables.all_tables().values()}))
            raise _Inactive(
                f"{device.name} has no measured table (measured: {measured}; tables are "
                f"used only on the GPU they were measured on); vLLM's kernels run unchanged. "
                f"To measure one on this GPU, from a clone of dsv4-serving run "
                f"`{tables.MEASURE_COMMAND}` and serve with {tables.ENV_TABLES_DIR}=DIR"
            )
        access = _access()
        native = _native_prefill(device)
        serving = dataclasses.replace(serving, family=family, native_prefill=native)
        runtime = HeadExactRuntime(serving, device, table, switches, access)
        patches: list[_Patch] = []
        if _APPLIED:  # an earlier engine of this process put them in place
            names = list(_STATE["replaced"])
        else:
            # V4.1 keeps its own ops: only V4's are replaced
            patches, names = _ops_patches() if table.combine and family == "v4" else ([], [])
            if family == "v4" and native and table.prefill.native_faster_heads:
                patches.append(_native_patch())
                heads = "/".join(str(h) for h in table.prefill.native_faster_heads)
                names.append(
                    f"flash_mla_sparse_fwd (vLLM's own, at the real heads at {heads} heads)"
                )
        cls = make_attention_cls(base, runtime)
    except _Inactive as reason:
        _say_inactive(str(reason), warning=False)
        return
    except _Refused as reason:
        _say_inactive(f"{reason}; nothing replaced", warning=True)
        return
    except Exception as exc:  # never let the plugin stop vLLM
        _say_inactive(f"unexpected {type(exc).__name__}: {exc}; nothing replaced", warning=True)
        return
    for patch in patches:
        setattr(patch.module, patch.name, patch.replacement)
    _APPLIED.extend(patches)
    _STATE.update(runtime=runtime, cls=cls, family=family, replaced=list(names))
    replaced = [
        *names,
        f"{base.__module__}.{base.__name__} (head-exact prefill and decode per layer kind)",
    ]
    _logger().info(
        "dsv4-attention %s: active for %s on vLLM %s (%s, table %s); replaced: %s",
        _our_version(),
        serving.model_text,
        _vllm_version(),
        device.name,
        table.device_name,
        ", ".join(replaced),
    )


def _install_trigger(family: str) -> None:
    """At the import of a family's package: leave a process serving a model of neither
    family alone, and a package of the other family (imported in passing) untouched;
    otherwise wrap the family's selector with the start-up trigger (checked first)."""
    served = _served_architectures()
    if served:
        served_family = _family_of(served)
        if served_family is None:
            raise _Inactive(
                f"the model is {'/'.join(served)}; dsv4-attention acts on DeepSeek-V4 and "
                "DeepSeek-V4.1 only"
            )
        if served_family != family:
            return
    model, select, base = _vllm_classes(family)

    def _select_dsv4_attn_cls(vllm_config: Any) -> type:
        chosen = select(vllm_config)
        if not _same_engine(vllm_config):  # the first layer this engine builds
            _activate(vllm_config, base, family)
        cls = _STATE["cls"]
        if cls is not None and chosen is base and _STATE["family"] == family:
            return cls
        return chosen

    _select_dsv4_attn_cls.__wrapped__ = select  # type: ignore[attr-defined]
    model._select_dsv4_attn_cls = _select_dsv4_attn_cls  # type: ignore[attr-defined]
    _STATE["triggers"][family] = _Patch(
        model, "_select_dsv4_attn_cls", select, _select_dsv4_attn_cls
    )


def _activate_safely(family: str = "v4") -> None:
    """At the import of a family's package; any failure leaves vLLM exactly as it was."""
    if _STATE["decided"] or family in _STATE["triggers"]:
        return
    try:
        _install_trigger(family)
    except _Inactive as reason:
        _say_inactive(str(reason), warning=False)
    except _Refused as reason:
        _say_inactive(f"{reason}; nothing replaced", warning=True)
    except Exception as exc:  # never let the plugin stop vLLM
        _say_inactive(f"unexpected {type(exc).__name__}: {exc}; nothing replaced", warning=True)


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
                "nothing replaced",
                warning=True,
            )
            return
        if os.environ.get(ENV_STARTUP_PLAN, "0").strip() not in ("", "0"):
            _say_inactive(
                f"{ENV_STARTUP_PLAN} is set: vLLM would replay a saved memory profile that did "
                "not count the plugin's scratch; unset it to use dsv4-attention",
                warning=True,
            )
            return
        pending = {}
        for family, (package, _, _) in targets.FAMILY_MODULES.items():
            if package in sys.modules:
                _activate_safely(family)
            else:
                pending[package] = family
        if pending and not _STATE["decided"]:
            hook = _Dsv4ImportHook(pending)
            _STATE["hook"] = hook
            sys.meta_path.insert(0, hook)
    except Exception as exc:  # never let the plugin stop vLLM
        _remove_hook()
        try:
            _say_inactive(f"unexpected {type(exc).__name__}: {exc}; nothing replaced", warning=True)
        except Exception:
            logging.getLogger(LOGGER_NAME).warning("dsv4-attention: inactive (%s)", exc)


def unregister() -> None:
    """Put back everything :func:`register` changed and forget the decision."""
    _remove_hook()
    for patch in reversed(_APPLIED):
        if getattr(patch.module, patch.name, None) is patch.replacement:
            setattr(patch.module, patch.name, patch.original)
    _APPLIED.clear()
    for trigger in _STATE["triggers"].values():
        if getattr(trigger.module, trigger.name, None) is trigger.replacement:
            setattr(trigger.module, trigger.name, trigger.original)
    _STATE.update(
        triggers={},
        decided=False,
        facts=None,
        runtime=None,
        cls=None,
        family=None,
        ops_guard=None,
        engine=None,
        replaced=[],
    )


def patched() -> list[str]:
    """``module.name`` for every place that currently holds one of our replacements."""
    return sorted(
        f"{patch.module.__name__}.{patch.name}"
        for patch in _APPLIED
        if getattr(patch.module, patch.name, None) is patch.replacement
    )


def is_active() -> bool:
    """Whether the engine that built a DeepSeek-V4 or V4.1 model last in this process runs
    the plugin's runtime (the replacements in place)."""
    return _STATE["runtime"] is not None


def runtime() -> Any:
    """The :class:`~dsv4_attention.runtime.HeadExactRuntime` of the engine that built a
    DeepSeek-V4 model last in this process (each engine's own is its attention class's
    ``dsv4_runtime``); None before one was built, or when the plugin is not active."""
    return _STATE["runtime"]


def waiting() -> bool:
    """Whether the selector trigger is installed and no decision was made yet (a process
    that imported vLLM's DSV4 package without building a DSV4 model)."""
    return bool(_STATE["triggers"]) and not _STATE["decided"]

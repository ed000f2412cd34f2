"""The plugin's attention class as vLLM selects it on a Hopper GPU, in this CPU process
(for the ``vllm`` tests that drive a layer through vLLM's own code)."""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def hopper_attention_class() -> Iterator[type]:
    """Register the plugin afresh as on a CUDA machine (``DSV4_KERNELS_FORCE``: this CPU
    platform decides as on the H200), import vLLM's DSV4 model (the import that installs
    the selector trigger), yield the class vLLM's wrapped ``_select_dsv4_attn_cls`` returns
    on an sm_90 device (its first call builds the runtime: ``cls.dsv4_runtime``), and
    unregister the plugin at the end."""
    from vllm.config import VllmConfig
    from vllm.models.deepseek_v4.nvidia import model
    from vllm.platforms.interface import DeviceCapability

    from dsv4_attention import plugin

    plugin.unregister()
    os.environ["DSV4_KERNELS_FORCE"] = "1"
    plugin.register()
    import vllm.models.deepseek_v4  # noqa: F401  (the import that installs the trigger)

    assert plugin.waiting()  # the selector trigger is in place, nothing replaced yet
    saved = model.current_platform
    model.current_platform = types.SimpleNamespace(
        get_device_capability=lambda device_id=0: DeviceCapability(9, 0), is_cuda=lambda: True
    )
    try:
        cls = model._select_dsv4_attn_cls(VllmConfig())  # the start-up decision
    finally:
        model.current_platform = saved
        del os.environ["DSV4_KERNELS_FORCE"]
    assert plugin.is_active()
    try:
        yield cls
    finally:
        plugin.unregister()

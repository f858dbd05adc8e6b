"""verl's engine on CPU processes (gloo): `use_cpu()`.

verl ships cuda, npu and rocm platforms only, and registers its FSDP engines for those devices, so its
`TrainingWorker` cannot be built on a machine without an accelerator. `use_cpu()` registers a CPU platform (devices
"cpu", collectives gloo, memory statistics 0), selects it, and registers verl's own `FSDPEngineWithLMHead` for the
"cpu" device, its code unchanged. The tests (tests/integrations/test_verl.py) and `python -m benchmarks verl` run verl's
actor update on CPU through it; nothing in the library calls it. Imports verl when called.
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any

import torch

# torch.cuda's interface as verl calls it, answered for the CPU.
_CPU_MODULE = types.SimpleNamespace(
    is_available=lambda: True, current_device=lambda: "cpu", device_count=lambda: 1, set_device=lambda *a: None,
    synchronize=lambda *a, **k: None, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    empty_cache=lambda: None, max_memory_allocated=lambda *a, **k: 0, max_memory_reserved=lambda *a, **k: 0,
    memory_allocated=lambda *a, **k: 0, memory_reserved=lambda *a, **k: 0,
    reset_peak_memory_stats=lambda *a, **k: None, mem_get_info=lambda *a, **k: (0, 0),
    get_device_name=lambda *a, **k: "CPU", get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
)


def use_cpu() -> None:
    """Make verl run on CPU processes: the platform below, selected (VERL_PLATFORM for verl's own resolution, or
    replacing a platform it already resolved), and the language model's FSDP engines registered for "cuda" (verl's,
    or LongStraw's once `longstraw.integrations.verl` is imported) registered for the "cpu" device too. Call it
    before verl builds a worker. Idempotent."""
    os.environ["VERL_PLATFORM"] = "cpu"
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, get_platform, set_platform

    if PlatformRegistry.get("cpu") is None:
        PlatformRegistry.register(platform="cpu")(_platform_class(PlatformBase))
    if get_platform().device_name != "cpu":  # resolved before this call (e.g. by an import): replaced
        set_platform(PlatformRegistry._platforms["cpu"]())
    from verl.workers.engine.base import EngineRegistry  # its import resolves the platform
    for backends in EngineRegistry._engines.get("language_model", {}).values():
        for device in ("cuda",):
            if device in backends:
                backends["cpu"] = backends[device]


def _platform_class(base: type) -> type:
    """verl's `PlatformBase` implemented for the CPU."""
    class PlatformCPU(base):
        """The CPU as a verl platform: devices are "cpu", collectives gloo, memory statistics 0."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _CPU_MODULE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    return PlatformCPU

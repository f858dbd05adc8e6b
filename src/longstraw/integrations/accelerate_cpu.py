"""accelerate's FSDP path on CPU processes (gloo): `accelerate_fsdp_on_cpu()`.

accelerate enables FSDP only for accelerator distributed types (MULTI_GPU, ...); on CPU processes (MULTI_CPU,
`ACCELERATE_USE_CPU=1` or `use_cpu=True`) it drops the FSDP plugin silently and runs plain DDP, so a CPU run of
`fsdp=True` would not be sharded. The tests (tests/integrations/) and `longstraw bench trl-scale` run FSDP2 on CPU
processes through this patch; nothing in the library calls it. Imports accelerate when called.
"""

from __future__ import annotations

from typing import Any

_PATCHED = "_longstraw_fsdp_on_cpu"  # marks the patched initialiser, so that a second call changes nothing


def accelerate_fsdp_on_cpu() -> None:
    """Let accelerate run its FSDP path on CPU processes (gloo).

    Every `AcceleratorState()` re-reads the process state (MULTI_CPU), so the patch is on its initialiser: a plugin
    it was given is kept, with its mixed precision set, and the distributed type is FSDP, as on a GPU. Model
    preparation is then accelerate's own (`fsdp2_prepare_model`: `fully_shard` per transformer layer and the root,
    on a CPU device mesh). Idempotent; lasts for the process."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    if getattr(init, _PATCHED, False):
        return

    def patched(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if self.distributed_type != DistributedType.MULTI_CPU:
            return
        if fsdp_plugin is not None and getattr(self, "fsdp_plugin", None) is None:
            if self.mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self.mixed_precision)
            self.fsdp_plugin = fsdp_plugin
        if getattr(self, "fsdp_plugin", None) is not None:
            self.distributed_type = DistributedType.FSDP

    setattr(patched, _PATCHED, True)
    AcceleratorState.__init__ = patched

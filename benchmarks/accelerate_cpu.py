"""accelerate's FSDP and DeepSpeed paths on CPU processes (gloo): `accelerate_fsdp_on_cpu()`,
`accelerate_deepspeed_on_cpu()`.

accelerate enables FSDP only for accelerator distributed types (MULTI_GPU, ...); on CPU processes (MULTI_CPU,
`ACCELERATE_USE_CPU=1` or `use_cpu=True`) it drops the FSDP plugin silently and runs plain DDP, so a CPU run of
`fsdp=True` would not be sharded. DeepSpeed it refuses on CPU processes, and without them finds no backend on a
machine without an accelerator. The tests (tests/integrations/) and `python -m benchmarks trl-scale` run FSDP2 and
DeepSpeed on CPU processes through these patches; nothing in the library calls them. Imports accelerate when called.
"""

from __future__ import annotations

import os
from typing import Any

_PATCHED = "_longstraw_on_cpu"  # marks a patched function, so that a second call changes nothing


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


def accelerate_deepspeed_on_cpu() -> None:
    """Let accelerate run DeepSpeed on CPU processes: torchrun's environment without ACCELERATE_USE_CPU and a
    `deepspeed` config in the TrainingArguments. accelerate then asks for DeepSpeed but finds no accelerator backend;
    the patch answers gloo, so DeepSpeed's communication starts over gloo and the distributed type is DEEPSPEED.
    DeepSpeed's shared-memory all-reduce for CPUs (a C++ extension compiled at first use, minutes) is switched off:
    gloo carries the collectives. Idempotent; lasts for the process."""
    import deepspeed.ops
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    prepare = PartialState._prepare_backend
    if getattr(prepare, _PATCHED, False):
        return

    def patched(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        found, kind = prepare(self, cpu, sagemaker_dp, backend)
        wants_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if found is None and not cpu and wants_deepspeed and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.NO  # accelerate turns NO into DEEPSPEED once DeepSpeed is initialised
        return found, kind

    setattr(patched, _PATCHED, True)
    PartialState._prepare_backend = patched

"""What the engine checks of a model split by transformers' tensor-parallel plan, before it touches anything.

A tensor-parallel model (transformers' `apply_tensor_parallelism`, e.g. through `distributed.tp.tensor_parallel`)
marks every module it hooked with `_is_hooked`. The engine runs on such a model unchanged (`distributed/tp.py`) when:
* its family is one LongStraw's parity tests ran under tensor parallelism (`TP_MODEL_TYPES`);
* the output projection is a plain tensor or split by vocabulary on one mesh dimension (`tp_logprobs`);
* no module still carries transformers' `replicated_with_grad_allreduce` hook, which all-reduces the *accumulated*
  gradient after every backward: LongStraw runs several backwards per group (one per micro-batch and per prompt
  chunk), so from the second one the gradient of those parameters (Qwen3's per-head q/k norms) would be summed over
  the ranks again. `distributed.tp.adopt` replaces it with a hook that sums each backward's gradient once."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

# Families whose transformers tensor-parallel plan LongStraw's float64 parity tests ran (tests/distributed/test_tp.py).
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether transformers' tensor- (or expert-) parallel plan hooked a module of `model`."""
    return any(getattr(m, "_is_hooked", False) for m in model.modules())


def grad_allreduce_hooked(model: torch.nn.Module) -> list[str]:
    """The modules whose forward is still transformers' `ReplicatedWithGradAllReduce` wrapper."""
    return [name for name, m in model.named_modules()
            if "ReplicatedWithGradAllReduce" in getattr(m.__dict__.get("forward"), "__qualname__", "")]


def check_tensor_parallel_model(model: torch.nn.Module) -> None:
    """Raise ValueError saying what to change for a tensor-parallel model the engine cannot run exactly (see above)."""
    if not is_tensor_parallel(model):
        return
    model_type = getattr(model.config, "model_type", None)  # its own type: a multimodal wrapper is not its text tower
    if model_type not in TP_MODEL_TYPES:
        raise ValueError(f"tensor parallelism on {model_type}: LongStraw has not verified its tensor-parallel plan "
                         f"(supported: {', '.join(TP_MODEL_TYPES)}); run it without --tp / tp_size")
    pretrained: Any = model  # a transformers PreTrainedModel
    head = pretrained.get_output_embeddings() if hasattr(pretrained, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, DTensor) and (weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),)):
        raise ValueError(f"the output projection is a DTensor with placements {tuple(weight.placements)}: LongStraw's "
                         "log-probs take it split by vocabulary on one mesh dimension (Shard(0), transformers' "
                         "'colwise_gather_output' plan for lm_head) or whole")
    hooked = grad_allreduce_hooked(model)
    if hooked:
        raise ValueError(f"{hooked[0]} (and {len(hooked) - 1} more) still carry transformers' gradient all-reduce "
                         "hook, which sums the accumulated gradient again after each of LongStraw's backwards: call "
                         "longstraw.distributed.tp.adopt(model) once after loading")

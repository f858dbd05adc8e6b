"""What both TRL trainers with LongStraw's backward share (`trl.py`: `GRPOTrainer`'s, `trl_async.py`: the
asynchronous one): the causal LM the tree runs, the bf16 autocast around it, the data-parallel gradient average that
replaces DDP's reducer, and the refusals that need the loaded model."""

from __future__ import annotations

from typing import Any

import torch

try:
    from accelerate.utils import is_peft_model
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"longstraw.integrations needs TRL: pip install 'longstraw[trl]' ({err})") from err

from longstraw.admission.admission import check_architecture
from longstraw.api.checks import check_model_options
from longstraw.engine.options import BackwardOptions
from longstraw.engine.precision import dtype_name
from longstraw.models.architecture import eval_mode_when_equal, hf


def policy_of(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM backward_tree runs: unwrapped from accelerate, and the PEFT model's LoRA-injected base."""
    unwrapped: Any = accelerator.unwrap_model(model)
    return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped


def autocast_of(bf16: bool, policy: torch.nn.Module) -> Any:
    """bf16=True over float32 parameters is autocast mixed precision, which accelerate applies around the prepared
    model's forward; LongStraw runs the layers itself, so it enters the same autocast around the whole tree
    (forwards, recomputes and their backward). Over bfloat16 parameters it computes in their dtype."""
    enabled = bool(bf16) and hf(policy).get_input_embeddings().weight.dtype == torch.float32
    return torch.autocast(hf(policy).device.type, dtype=torch.bfloat16, enabled=enabled)


def average_gradients(policy: torch.nn.Module, processes: int) -> None:
    """Data parallelism: the mean of every trainable parameter's gradient over the processes, in one all-reduce
    per optimizer step, as DDP averages them. backward_tree runs the unwrapped model, so DDP's reducer (armed
    only by a forward through its wrapper) never fires; a parameter without a gradient counts as zeros."""
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])  # (sum of numels,), one bucket
    torch.distributed.all_reduce(flat)
    flat /= processes
    for p, g, part in zip(params, grads, flat.split([g.numel() for g in grads])):
        p.grad = part.view_as(g)


def tensor_parallel_refusals(model: torch.nn.Module) -> list[str]:
    """A model split by tensor parallelism (DTensor parameters) is refused: no TRL run here can configure it (the
    message says why), and the drop-in's gradient average over processes takes plain tensors."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return ["a tensor-parallel model (DTensor parameters): the TRL drop-in does not run tensor parallelism "
                "(accelerate refuses it on CPU processes and its FSDP2 x TP path needs a transformers class this "
                "release lacks); train it with `longstraw train --tp T`, or load it without tp_plan/tp_size"]
    return []


def model_refusals(policy: torch.nn.Module, options: BackwardOptions, bf16: bool) -> list[str]:
    """Why LongStraw cannot train this loaded model with these options (empty: it can): a tensor-parallel split, bf16
    autocast over a parameter dtype it does not run over, an architecture admission refuses (dropout on, mixed dtypes,
    soft-cap ...), and what backward_tree would refuse on its first batch."""
    out = tensor_parallel_refusals(policy)
    dtype = hf(policy).get_input_embeddings().weight.dtype
    if bf16 and dtype not in (torch.bfloat16, torch.float32):
        out.append(f"bf16=True with {dtype_name(dtype)} parameters: bf16 autocast runs over "
                   "float32 (or bfloat16) parameters; load the model in float32 or bfloat16, or set bf16=False")
    try:  # supported family, dropout off (TRL trains in train() mode), uniform dtype, no logit soft-cap
        with eval_mode_when_equal(policy):
            check_architecture(policy, 1)
    except ValueError as err:
        out.append(str(err))
    try:  # what backward_tree would refuse on its first batch: nothing to train, a recurrent exact chunk of 1
        check_model_options(policy, options)
    except ValueError as err:
        out.append(str(err))
    return out


def router_refusals(trainer: Any, keep_prompt_graph: bool) -> list[str]:
    """Why LongStraw cannot add a TRL trainer's Mixture-of-Experts load-balancing term (router_aux_loss_coef != 0)."""
    if not trainer.aux_loss_enabled:
        return []
    coef = trainer.router_aux_loss_coef
    out = [] if coef >= 0 else [f"router_aux_loss_coef={coef}: LongStraw's router term takes a coefficient >= 0"]
    if keep_prompt_graph:
        out.append("a Mixture-of-Experts load-balancing loss (router_aux_loss_coef != 0) with "
                   "longstraw_keep_prompt_graph > 0: the router term's prompt share needs every prompt chunk "
                   "recomputed to its last layer; set longstraw_keep_prompt_graph=0")
    return out


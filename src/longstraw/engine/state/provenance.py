"""What produced a prompt state: the model's identity and a digest of its weights.

A state is only valid for the model and weights that captured it. `backward_group` accepts a reused `prompt_state`
(e.g. the one `sample_group` captured) and must refuse one that another model captured (another architecture, a
different layer count or head layout: K/V of the wrong shape can crash a kernel), or that these weights captured
before an optimizer step (a gradient 50–90% wrong, with no error).

* identity: the config fields that fix the state's layout (model type, layers, widths, head counts, layer kinds,
  windows, latent ranks) and a digest of the parameter layout (names, shapes, dtypes).
* weights: a digest of 8 values sampled at fixed positions of every parameter (first and last included). Any
  optimizer step that moves a parameter moves nearly all of its values, so it changes the digest; the same
  weights read twice (or gathered again by FSDP) give the same digest. PyTorch's in-place version counters would
  be cheaper but miss fused optimizers and `.data` updates. Cost: one small gather per parameter tensor and one
  host copy, independent of the tensors' sizes (docs/usage.md gives the measurement at 1.5B parameters).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from longstraw.models.composite import text_config

SAMPLES_PER_PARAMETER = 8

# Config fields that fix a prompt state's layout (absent ones read as None).
_IDENTITY_FIELDS = (
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "layer_types", "sliding_window", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "conv_kernel", "state_size", "num_heads", "hybrid_override_pattern",
)


@dataclass(frozen=True)
class Provenance:
    """The model identity (config fields and parameter layout) and weights digest of a captured state."""

    identity: tuple[tuple[str, str], ...]
    weights: str


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's local shard; others as they are."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _field(config: object, name: str) -> str:
    """repr of a config field (None where absent). A field that differs by layer in a heterogeneous config (Gemma-4's
    head_dim) refuses a global read: its serialized value is taken (the parameter layout holds the layers' sizes)."""
    try:
        return repr(getattr(config, name, None))
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return repr(config.to_dict().get(name))  # type: ignore[attr-defined]


def provenance(model: torch.nn.Module) -> Provenance:
    """The identity and weights digest of `model` now."""
    config = text_config(model)
    fields: list[tuple[str, str]] = [(name, _field(config, name)) for name in _IDENTITY_FIELDS]
    layout = hashlib.blake2b(digest_size=8)
    samples = []
    for name, param in model.named_parameters():
        t = _local(param.detach())
        layout.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        n = t.numel()
        if n == 0:
            continue
        flat = t.reshape(-1)  # a view for the contiguous parameters models have
        k = min(SAMPLES_PER_PARAMETER, n)
        index = torch.arange(k, device=t.device) * (n - 1) // max(k - 1, 1)  # int64: exact at any size
        samples.append(flat[index].to(torch.float64))
    fields.append(("parameter layout", layout.hexdigest()))
    values = torch.cat(samples).cpu() if samples else torch.zeros(0, dtype=torch.float64)
    weights = hashlib.blake2b(values.numpy().tobytes(), digest_size=16).hexdigest()
    return Provenance(identity=tuple(fields), weights=weights)


def mismatch(captured: Provenance, now: Provenance) -> str | None:
    """Why a state with provenance `captured` is not valid for a model with provenance `now` (None: it is)."""
    if captured.identity != now.identity:
        theirs, ours = dict(captured.identity), dict(now.identity)
        differ = [f"{name} {theirs.get(name)} (state) vs {ours.get(name)} (model)"
                  for name in ours if theirs.get(name) != ours.get(name)]
        return "it was captured by another model: " + "; ".join(differ)
    if captured.weights != now.weights:
        return ("it was captured with other weights (this model before an optimizer step, or another model of the "
                "same architecture)")
    return None

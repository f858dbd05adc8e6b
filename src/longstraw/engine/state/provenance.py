"""What produced a prompt state: the model's identity, config, module attributes, adapter state, weights and buffers.

A state is only valid for the model and weights that captured it. `backward_group` accepts a reused `prompt_state`
and must refuse one that another model captured (another architecture, layer count or head layout: K/V of the wrong
shape can crash a kernel), or that this model captured in another condition: before an optimizer step (a gradient
50-90% wrong, with no error), with a LoRA adapter disabled, before an edit of a few embedding rows, a rescaled RoPE
buffer or a changed norm epsilon. Each is silently wrong otherwise, so each is recorded:

* identity: the config fields that fix the state's layout (`_IDENTITY_FIELDS`) and digests of the parameter and
  buffer layouts (names, shapes, dtypes).
* config: every public entry of the config (`to_dict()`, nested dicts flattened) but `_INERT_CONFIG`'s.
* attributes: every module's public plain attributes (int, float, bool, str, None, and tuples, lists and str-keyed dicts
  of them: an RMSNorm's `variance_epsilon`, a LoRA layer's `scaling`) but `training` and `gradient_checkpointing`.
* adapters: for each PEFT adapter layer, whether its adapters are disabled, which are active and which merged; for
  a `PeftModel`, its own disabled flag.
* tensors: a checksum of every parameter and buffer value. Each tensor is read as a matrix of its last dimension (0- and
  1-D tensors as one row), reinterpreted as 32-bit integers (16- or 8-bit where its rows' bytes do not divide), and
  summed along each row and each column modulo 2**32 (exact, order- and device-independent): a changed value changes its
  row's sum, a permutation of rows the order of the row sums, one within a row the column sums (only changes that keep
  every sum go unseen). The sums are hashed per tensor on the host, so a refusal names the changed tensors.

Cheaper signals cannot be trusted alone (measured on torch 2.13): a tensor's version counter is not moved by fused
AdamW, by writes through `p.data` or by a NumPy view; 8 sampled values per tensor miss the sparse update of a few
embedding rows; storage addresses change when FSDP gathers the same weights again. So every value is read, at capture
and at each check: two passes over the weights' memory (`python -m benchmarks provenance` measures it; docs/usage.md
gives the numbers). Sharded (DTensor) parameters are read as their local shard, so each rank checks its own shards."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from longstraw.engine.hf.composite import text_config
from longstraw.models.architecture import hf

# Config fields that fix a prompt state's layout (absent ones read as None).
_IDENTITY_FIELDS = (
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "layer_types", "sliding_window", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "conv_kernel", "state_size", "num_heads", "hybrid_override_pattern",
)

# Config entries that do not change what a forward computes: output switches, names, labels, the dtype (the layout
# digests hold every tensor's dtype). Private entries (leading underscore: `_attn_implementation`, which the engine
# sets while it runs a segment) are skipped too.
_INERT_CONFIG = frozenset({
    "transformers_version", "architectures", "name_or_path", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict", "torchscript", "dtype", "torch_dtype", "id2label", "label2id", "problem_type", "tokenizer_class",
})

# Module attributes that do not change the values a forward computes.
_INERT_ATTRIBUTES = frozenset({"training", "gradient_checkpointing"})

# At most this many differences are named in a refusal (then "and N more").
_NAMED = 3

_Items = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Provenance:
    """What captured a state: identity (layout fields and layout digests), config entries, module attributes,
    adapter state, and a checksum of each parameter and buffer; each a tuple of (name, value) pairs."""

    identity: _Items
    config: _Items
    attributes: _Items
    adapters: _Items
    tensors: _Items


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


def _plain(value: object) -> bool:
    """Whether `value` is a plain scalar, or a tuple, list or str-keyed dict of plain values (what can change a
    module's computation and compares by value)."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return isinstance(value, dict) and all(isinstance(k, str) and _plain(v) for k, v in value.items())


def _flat(prefix: str, entries: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(dotted key, repr) of each public entry of a config dict, nested dicts (text_config, rope) flattened."""
    for key, value in entries.items():
        if key.startswith("_") or key in _INERT_CONFIG:
            continue
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            yield from _flat(f"{prefix}{key}.", value)
        else:
            yield f"{prefix}{key}", repr(value)


def _config(model: torch.nn.Module) -> _Items:
    config = getattr(hf(model), "config", None)
    to_dict = getattr(config, "to_dict", None)
    return tuple(_flat("", to_dict())) if callable(to_dict) else ()


def _attributes(model: torch.nn.Module) -> _Items:
    return tuple((f"{name}.{key}" if name else key, repr(value))
                 for name, module in model.named_modules() for key, value in vars(module).items()
                 if not key.startswith("_") and key not in _INERT_ATTRIBUTES and _plain(value))


def _adapters(model: torch.nn.Module) -> _Items:
    """Each PEFT adapter layer's disabled flag, active and merged adapters (`BaseTunerLayer`: `disable_adapters` is a
    bool property there, a method elsewhere), and a `PeftModel`'s own disabled flag (`disable_adapter()` sets it)."""
    found = []
    for name, module in model.named_modules():
        disabled = getattr(module, "disable_adapters", None)
        if isinstance(disabled, bool):
            active = list(getattr(module, "active_adapters", None) or [])
            merged = list(getattr(module, "merged_adapters", None) or [])
            state = "disabled" if disabled else "enabled"
            found.append((name or "model", f"{state}, active {active}, merged {merged}"))
        flag = vars(module).get("_adapters_disabled")
        if isinstance(flag, bool):
            found.append((f"{name or 'model'} (PeftModel)", "disabled" if flag else "enabled"))
    return tuple(found)


def _sums(t: torch.Tensor) -> torch.Tensor:
    """The row sums and the column sums (int32, modulo 2**32) of `t`'s bits as a matrix of its last dimension."""
    t = t.reshape(1, 1) if t.ndim == 0 else t
    m = t.contiguous().reshape(-1, t.shape[-1])
    width = m.shape[-1] * m.element_size()
    size = 4 if width % 4 == 0 else 2 if width % 2 == 0 else 1  # by the row's bytes only: the same wherever it lies
    if (m.storage_offset() * m.element_size()) % size:
        m = m.clone()  # a view at an unaligned offset (into a flat buffer) cannot be reinterpreted in place
    bits = m.view(torch.int32 if size == 4 else torch.int16 if size == 2 else torch.uint8)
    return torch.cat((bits.sum(dim=1, dtype=torch.int32), bits.sum(dim=0, dtype=torch.int32)))


def _tensors(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, _Items]:
    """The layout digest (names, shapes, dtypes) of `named` and each tensor's checksum (hex), the sums of all the
    tensors of a device copied to the host at once."""
    layout = hashlib.blake2b(digest_size=8)
    entries: list[tuple[str, torch.Tensor | None]] = []
    for name, tensor in named:
        t = _local(tensor.detach())
        layout.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        entries.append((name, None if t.numel() == 0 or t.is_meta else _sums(t)))
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, sums in entries:
        if sums is not None:
            by_device.setdefault(sums.device, []).append(sums)
    host = {device: iter(np.split(torch.cat(parts).cpu().numpy(), np.cumsum([p.numel() for p in parts])[:-1]))
            for device, parts in by_device.items()}
    checksums = tuple((name, "empty" if sums is None else
                       hashlib.blake2b(next(host[sums.device]).tobytes(), digest_size=8).hexdigest())
                      for name, sums in entries)
    return layout.hexdigest(), checksums


def provenance(model: torch.nn.Module) -> Provenance:
    """The identity, config, module attributes, adapter state and tensor checksums of `model` now."""
    config = text_config(model)
    fields: list[tuple[str, str]] = [(name, _field(config, name)) for name in _IDENTITY_FIELDS]
    with torch.no_grad():
        parameter_layout, parameters = _tensors(model.named_parameters())
        buffer_layout, buffers = _tensors(model.named_buffers())
    fields += [("parameter layout", parameter_layout), ("buffer layout", buffer_layout)]
    return Provenance(identity=tuple(fields), config=_config(model), attributes=_attributes(model),
                      adapters=_adapters(model),
                      tensors=tuple((f"parameter {n}", c) for n, c in parameters) +
                      tuple((f"buffer {n}", c) for n, c in buffers))


def _differences(captured: _Items, now: _Items, show: bool = True) -> list[str]:
    """'name A (state) vs B (model)' (or just the name, show=False) for each name whose value differs."""
    theirs, ours = dict(captured), dict(now)
    names = [n for n in dict.fromkeys([*theirs, *ours]) if theirs.get(n) != ours.get(n)]
    return [f"{n} {theirs.get(n, 'absent')} (state) vs {ours.get(n, 'absent')} (model)" if show else n for n in names]


def _named(differences: list[str]) -> str:
    more = len(differences) - _NAMED
    return "; ".join(differences[:_NAMED]) + (f" (and {more} more)" if more > 0 else "")


def mismatch(captured: Provenance, now: Provenance) -> str | None:
    """Why a state with provenance `captured` is not valid for a model with provenance `now` (None: it is)."""
    for part, why in (("identity", "it was captured by another model"), ("config", "the model's config differs"),
                      ("adapters", "it was captured in another adapter state (e.g. under disable_adapter(), or with "
                                   "another adapter active or merged)"), ("attributes", "a module attribute differs")):
        if getattr(captured, part) != getattr(now, part):
            return f"{why}: " + _named(_differences(getattr(captured, part), getattr(now, part)))
    if captured.tensors != now.tensors:
        changed = _differences(captured.tensors, now.tensors, show=False)
        weights = any(n.startswith("parameter ") for n in changed)
        what = ("it was captured with other weights (this model before an optimizer step or an in-place edit, or "
                "another model of the same architecture)" if weights else "it was captured with other buffer values")
        return f"{what}: {_named([f'{n} differs' for n in changed])}"
    return None

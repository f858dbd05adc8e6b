"""Layers that attend to another layer's keys and values (Gemma-4's KV sharing, `num_kv_shared_layers`).

The last `num_kv_shared_layers` decoder layers of a Gemma-4 text model compute no K/V of their own: each reuses the
K/V of the last earlier layer of its kind (sliding or full attention, the layer transformers marks "store"), handed
over through the decoder's `shared_kv_states` for the segment's own tokens. Such a layer keeps no prompt state, and
its attention reads the store layer's prompt K/V."""

from __future__ import annotations

from typing import Any

import torch


def kv_shared_layers(config: Any) -> frozenset[int]:
    """Indices of the decoder layers that reuse an earlier layer's K/V (none outside Gemma-4). A config whose every
    layer reuses K/V (an assistant model fed by another model's) is refused: its K/V come from outside the model."""
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    layers = config.num_hidden_layers
    if shared >= layers:
        raise ValueError(f"{config.model_type} with num_kv_shared_layers={shared} of {layers} layers reads every "
                         "layer's K/V from another model: LongStraw runs self-contained decoders only")
    return frozenset(range(layers - shared, layers))


def kv_source(module: torch.nn.Module, layer: int) -> int:
    """The layer whose prompt K/V the attention `module` of decoder layer `layer` reads: `layer` itself, or for a
    KV-shared layer the store layer of its kind."""
    if not getattr(module, "is_kv_shared_layer", False):
        return layer
    config: Any = module.config
    kinds, modes = config.layer_types, config.kv_sharing_modes
    return next(i for i, mode in enumerate(modes) if mode == "store" and kinds[i] == kinds[layer])

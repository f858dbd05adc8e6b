"""Tokenizers: the model's own (Hugging Face directory, hub id or .gguf), or a byte tokenizer for presets.

The built-in presets are random-init models with no tokenizer of their own; `ByteTokenizer` maps UTF-8
bytes to ids 0–255 (the presets' vocabularies are larger), so tasks and the trainer run end to end on them.
"""

from __future__ import annotations

from typing import Any

from longstraw.models import PRESETS, converted_gguf, resolve_model_path


class ByteTokenizer:
    """UTF-8 bytes as token ids 0–255; EOS 256. No chat template (tasks then encode plain text)."""

    eos_token_id = 256
    pad_token_id = 256
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer that goes with `load_model(name_or_path)`."""
    if name_or_path in PRESETS:
        return ByteTokenizer()
    name_or_path = resolve_model_path(name_or_path)
    from transformers import AutoTokenizer

    if name_or_path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(converted_gguf(name_or_path))
    try:  # the local cache first: a cached model must not wait on (or retry against) an unreachable hub
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except OSError:
        return AutoTokenizer.from_pretrained(name_or_path)

"""Tokenizers: the model's own (Hugging Face directory, hub id or .gguf), or a byte tokenizer for presets.

The built-in presets are random-init models with no tokenizer of their own; `ByteTokenizer` maps UTF-8
bytes to ids 0–255 (the presets' vocabularies are larger), so tasks and the trainer run end to end on them."""

from __future__ import annotations

from typing import Any

from longstraw.models.gguf_files import converted_gguf, resolve_model_path
from longstraw.models.presets import PRESETS
from longstraw.models.sources import remote_code_error


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
        return AutoTokenizer.from_pretrained(converted_gguf(name_or_path), trust_remote_code=False)
    try:
        try:  # the local cache first: a cached model must not wait on (or retry against) an unreachable hub
            return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True, trust_remote_code=False)
        except OSError:
            return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    except ValueError as err:  # a tokenizer that needs its own code: refused in one line, never run
        raise remote_code_error(err, name_or_path) or err from None


def byte_tokenizer_hf() -> Any:
    """`ByteTokenizer`'s ids as a transformers `PreTrainedTokenizerFast` (bytes 0–255, EOS and pad 256), for
    libraries that need a transformers tokenizer with the presets (TRL's GRPOTrainer). Built locally, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()  # byte -> the printable character byte-level BPE vocabularies use for it
    vocab = {table[b]: b for b in range(256)} | {"<eos>": ByteTokenizer.eos_token_id}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")

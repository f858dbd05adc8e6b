"""A tiny real tokenizer built in-process (byte-level BPE, no download) for the task tests."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from longstraw.tasks.haystack import _INTERJECTIONS, _PREDICATES, _SUBJECTS, NAMES

# Byte-level, so every string encodes (digits, JSON, UUIDs) even where the training text never showed it.
_CORPUS = [f"{s} {p}." for s in _SUBJECTS for p in _PREDICATES] + list(_INTERJECTIONS) + [
    "There is an important piece of information hidden inside a lot of irrelevant text.",
    "What is the pass key? Answer with the number only. The pass key for " + ", ".join(NAMES),
    "0123456789 12345 67890 Remember it.",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _build() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (vocab 400) without a chat template."""
    return _build()


@pytest.fixture(scope="session")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The same tokenizer with a small jinja chat template."""
    tok = _build()
    tok.chat_template = CHAT_TEMPLATE
    return tok

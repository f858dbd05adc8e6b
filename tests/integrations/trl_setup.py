"""What the TRL equality tests share, in one process or in several (trl_ddp_child.py): the fixed completions
that stand in for generation, the reward, the float64 log-prob kernel swapped into TRL, the gradient recorder, and
one training run from a saved model; and, for the children, accelerate's FSDP path on CPU processes
(`accelerate_fsdp_on_cpu`, from `benchmarks.accelerate_cpu`, which `python -m benchmarks trl-scale` uses
too) and DeepSpeed's (`accelerate_deepspeed_on_cpu`, with `deepspeed_config`)."""

from __future__ import annotations

import contextlib
import os

import torch
from datasets import Dataset
from helpers import faithful_float64
from transformers import AutoModelForCausalLM, TrainerCallback

from benchmarks.accelerate_cpu import accelerate_deepspeed_on_cpu, accelerate_fsdp_on_cpu  # noqa: F401
from longstraw.models.tokenizer import byte_tokenizer_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
G = 4
MAX_COMPLETION = 12
PROMPTS = [f"Question {i:02d}: what is the colour of item {i:02d}?" for i in range(8)]  # equal lengths
RAGGED = [p + " Please." * (i % 3) for i, p in enumerate(PROMPTS)]


class Float64LogProbs:
    """TRL's `ChunkedLogProbFunction` interface computed plainly in the input dtype (TRL's accumulates in float32):
    log_softmax(logits * logit_scale / temperature) at the targets, and the entropy TRL logs."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        assert softcap is None
        logits = hidden @ weight.t() + (0 if bias is None else bias)
        logp = torch.log_softmax(logits * logit_scale * (1 / temperature), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return logp.gather(-1, targets[:, None]).squeeze(-1), entropy, None, None, None


def completions(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Stands in for `GRPOTrainer._generate_single_turn`: the j-th completion of a prompt is a fixed function of the
    prompt's ids and j, so both trainers train on the same completions. Lengths 3, 8, 5 end with EOS; the 4th is
    cut at max_completion_length (no EOS) for some prompts, which mask_truncated_completions then drops, and for
    others ends with EOS at 6 tokens, so groups differ in their longest completion (dr_grpo's normaliser)."""
    eos = self.processing_class.eos_token_id
    out = []
    for k, ids in enumerate(prompt_ids):
        j = k % num_generations
        gen = torch.Generator().manual_seed(sum(ids) * 8 + j)
        truncated = j == 3 and sum(ids) % 2 == 0
        n = [3, 8, 5, MAX_COMPLETION if truncated else 6][j]
        tokens = torch.randint(97, 123, (n,), generator=gen).tolist()  # lower-case letters
        if not truncated:
            tokens[-1] = eos
        out.append(tokens)
    return out, None


def rollout_with_observations(prompts, trainer):
    """A multi-turn stand-in for TRL's `rollout_func`: the fixed completions of `completions` (one per entry of
    `prompts`, which holds each prompt G times), where tokens [1, 1 + n//3) of each are an environment's
    observation: `env_mask` 0 there (TRL turns it into its tool mask, as it does for `tools`' results)."""
    prompt_ids = [trainer.processing_class(p, add_special_tokens=False)["input_ids"] for p in prompts]
    completion_ids, _ = completions(trainer, prompt_ids, None, None, trainer.num_generations)
    env_mask = [[0 if 1 <= t < 1 + len(ids) // 3 else 1 for t in range(len(ids))] for ids in completion_ids]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "env_mask": env_mask}


def reward(completions, **kwargs):
    return [float(c.count("a") + c.count("e") + len(c) % 3) for c in completions]


class Gradients(TrainerCallback):
    """Each optimizer step's gradient, flattened, just before the optimizer uses it."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                     for p in model.parameters() if p.requires_grad]).clone())


# The GRPOConfig every equality test starts from (SGD, constant lr, no clipping: the update is the gradient).
SETTINGS = dict(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=MAX_COMPLETION,
                max_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
                bf16=False, report_to="none", save_strategy="no", seed=0, logging_steps=1, disable_tqdm=True,
                temperature=0.7)


def deepspeed_config(stage: int) -> dict:
    """A DeepSpeed config for TrainingArguments' `deepspeed`: ZeRO `stage`, the batch sizes, accumulation and
    clipping from the TrainingArguments ("auto"), as TRL's and accelerate's example configs have them."""
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def train(trainer_cls, config_cls, model_dir, tmp_path, dtype=torch.float64, prompts=PROMPTS, peft_config=None,
           sample=False, info=None, rollout_func=None, **config):
    """One run from the saved model; returns (gradient per optimizer step, parameters after). sample: TRL's own
    generation (transformers' generate) instead of the fixed completions. info: a dict that gets how the run was
    distributed ("fsdp": accelerate's FSDP on, "sharded": the parameters are DTensors, "zero_stage": DeepSpeed's ZeRO
    stage or None) and the trainer's "log_history". Under ZeRO-3 the parameters returned are gathered whole."""
    # accelerate sets ACCELERATE_USE_FSDP=true for good once it is given an FSDP plugin, which would make every later
    # run in this process FSDP (version 1); a run with fsdp=True passes its plugin itself.
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if dtype == torch.float64:
        faithful_float64(model)
    settings = dict(SETTINGS, **config)
    gradients = Gradients()
    trainer = trainer_cls(model, reward_funcs=reward, args=config_cls(output_dir=str(tmp_path / "out"), **settings),
                          train_dataset=Dataset.from_dict({"prompt": list(prompts)}),
                          processing_class=byte_tokenizer_hf(), callbacks=[gradients], peft_config=peft_config,
                          rollout_func=rollout_func)
    if not sample and rollout_func is None:
        trainer._generate_single_turn = completions.__get__(trainer)
    trainer.train()
    if info is not None:
        info["log_history"] = list(trainer.state.log_history)
        from torch.distributed.tensor import DTensor

        info["fsdp"] = bool(trainer.is_fsdp_enabled)
        info["sharded"] = isinstance(next(trainer.model.parameters()), DTensor)
        info["zero_stage"] = trainer.model_wrapped.zero_optimization_stage() if trainer.is_deepspeed_enabled else None
    gather = contextlib.nullcontext()
    if trainer.is_deepspeed_enabled and trainer.model_wrapped.zero_optimization_stage() == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(trainer.model.parameters()))
    with gather:
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad])
    return gradients.steps, params



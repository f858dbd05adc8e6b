"""verl's actor update on CPU processes, for the equality tests of `longstraw.integrations.verl` (test_verl.py).

verl runs on CPU processes through `benchmarks.verl_cpu.use_cpu` (a CPU platform; verl's own engine
registered for the "cpu" device): its `TrainingWorker` then runs over a 1-rank gloo group, unchanged otherwise.
float64: verl's `PrecisionType` knows no "fp64", so `to_dtype` learns it, and the model's RMSNorms compute in
float64 (`helpers.faithful_float64`; transformers rounds them to float32) with SDPA attention (eager attention's
softmax is float32): both sides then differ only by summation order.

`run_update` builds a worker (verl's engine or LongStraw's), replaces its optimizer by SGD (AdamW's first step
amplifies round-off), runs `train_mini_batch` on one batch and returns the gradient of every optimizer step.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from benchmarks.verl_cpu import use_cpu

use_cpu()

from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.torch_dtypes import PrecisionType  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402

_to_dtype = PrecisionType.to_dtype
PrecisionType.to_dtype = staticmethod(lambda p: torch.float64 if p in ("fp64", torch.float64) else _to_dtype(p))

from verl.trainer.config.config import CheckpointConfig  # noqa: E402
from verl.workers.config import (  # noqa: E402
    ActorConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    TrainingWorkerConfig,
)
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

VOCAB = 128


def save_tiny_model(family: str, folder: str) -> None:
    """A random tiny `family` model (qwen3, or the qwen3_next hybrid: gated DeltaNet + full attention) in `folder`."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=512, tie_word_embeddings=False)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=2, **common))
    elif family == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            decoder_sparse_step=1, **common)
        model = transformers.Qwen3NextForCausalLM(config)
    else:
        raise ValueError(f"unknown family {family!r}")
    model.save_pretrained(folder)


def make_batch(prompt_lengths: tuple[int, ...] = (12, 9), g: int = 4, r_max: int = 7, seed: int = 0,
               observation: bool = False, token_advantages: bool = False, system: int = 0,
               turns: bool = False) -> TensorDict:
    """verl's actor batch after the rollout, in its no-padding layout: len(prompt_lengths) prompts × g responses of
    2..r_max tokens. observation: tokens 2-3 of every response of 5+ tokens are a tool's output (response_mask 0),
    as verl's multi-turn rollouts mark them. Old and reference log-probs are random in [-7, -4] (the policy's own
    are about -4.85 on a 128-token vocabulary): the ratios spread over and beyond the clip range. system: a system
    prompt of that many tokens before every prompt (different questions after one shared prefix). turns: prompt p > 0
    is prompt p−1's first row (its prompt and response) followed by its own tokens: successive turns of one
    conversation, each row of turn p continuing that row."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, VOCAB, (system,), generator=gen) if system else torch.zeros(0, dtype=torch.long)
    rows: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for p, length in enumerate(prompt_lengths):
        prompt = torch.cat([shared, torch.randint(1, VOCAB, (length,), generator=gen)])
        if turns and p > 0:
            _, before, answer = rows[-g]  # the previous turn's first row
            prompt = torch.cat([before, answer, prompt[system:]])
        for _ in range(g):
            r = int(torch.randint(2, r_max + 1, (1,), generator=gen))
            rows.append((p, prompt, torch.randint(1, VOCAB, (r,), generator=gen)))
    b, p_max = len(rows), max(len(prompt) for _, prompt, _ in rows)
    prompts, prompt_mask = torch.zeros(b, p_max, dtype=torch.long), torch.zeros(b, p_max, dtype=torch.long)
    responses, attention = torch.zeros(b, r_max, dtype=torch.long), torch.zeros(b, r_max, dtype=torch.long)
    for k, (_, prompt, response) in enumerate(rows):
        prompts[k, p_max - len(prompt):], prompt_mask[k, p_max - len(prompt):] = prompt, 1
        responses[k, :len(response)], attention[k, :len(response)] = response, 1
    loss_mask = attention.clone()
    if observation:
        loss_mask[attention.sum(-1) >= 5, 2:4] = 0
    attention_mask = torch.cat([prompt_mask, attention], 1)  # (B, P_max + R_max)
    advantages = torch.randn(b, 1, generator=gen).expand(b, r_max).clone()
    if token_advantages:
        advantages = advantages + torch.randn(b, r_max, generator=gen)  # GAE-like: one per token
    td = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": loss_mask.float(),
        "old_log_probs": (-torch.rand(b, r_max, generator=gen) * 3 - 4) * attention,
        "ref_log_prob": (-torch.rand(b, r_max, generator=gen) * 3 - 4) * attention,
        "advantages": advantages * loss_mask,
    }, batch_size=[b])
    tu.assign_non_tensor(td, uid=np.array([f"prompt-{p}" for p, _, _ in rows], dtype=object))
    return td


def run_update(engine_cls: type, model_dir: str, batch: TensorDict, actor: dict[str, Any], epochs: int = 2,
               micro_batch: int = 4, dtype: str = "fp64", lr: float = 1.0, remove_padding: bool = True,
               compute_dtype: str | None = None, ulysses: int = 1) -> list[torch.Tensor]:
    """One `train_mini_batch` (epochs × one mini-batch of every row of every rank, micro-batches of `micro_batch` rows)
    through verl's TrainingWorker built with `engine_cls`; the gradient (flat, whole) at each optimizer step. `batch`
    is this rank's share of the data-parallel batch. remove_padding: verl's `use_remove_padding` (its default packs a
    micro-batch's rows into one sequence; False pads them). compute_dtype: FSDP's mixed-precision param_dtype (verl's
    autocast dtype too), default `dtype`. ulysses: verl's ulysses_sequence_parallel_size (the ranks of one group hold
the same `batch`)."""
    import torch.distributed as dist
    from helpers import faithful_float64
    from verl.workers.engine_workers import TrainingWorker

    for backend in ("fsdp", "fsdp2"):
        EngineRegistry._engines["language_model"][backend]["cpu"] = engine_cls
    precision = {"param_dtype": compute_dtype or dtype, "reduce_dtype": dtype, "buffer_dtype": dtype}
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=remove_padding,
                                   override_config={"attn_implementation": "sdpa"}),
        engine_config=FSDPEngineConfig(strategy="fsdp2", model_dtype=dtype, mixed_precision=precision,
                                       use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch,
                                       use_torch_compile=False, ulysses_sequence_parallel_size=ulysses),
        optimizer_config=FSDPOptimizerConfig(lr=lr), checkpoint_config=CheckpointConfig())
    worker = TrainingWorker(config=config)
    worker.reset()
    model = worker.engine.module
    if dtype == "fp64":
        faithful_float64(model)
        model.config._experts_implementation = "eager"  # torch's grouped_mm has no float64
    params = [p for p in model.parameters() if p.requires_grad]
    worker.engine.optimizer = torch.optim.SGD(params, lr=lr)
    rows = batch.shape[0]
    actor = dict(actor)
    temperature = actor.pop("temperature", 1.0)
    settings = dict(strategy="fsdp2", rollout_n=4, ppo_mini_batch_size=rows // 4,
                    ppo_micro_batch_size_per_gpu=micro_batch, use_dynamic_bsz=False) | actor
    worker.set_loss_fn(partial(ppo_loss, config=ActorConfig(**settings)))
    grads: list[torch.Tensor] = []
    step = worker.engine.optimizer_step

    def recorded() -> Any:
        grads.append(torch.cat([_full(p.grad).flatten() for p in params]))
        return step()

    worker.engine.optimizer_step = recorded
    data = left_right_2_no_padding(batch.clone())
    dp = dist.get_world_size() // ulysses
    tu.assign_non_tensor(data, temperature=temperature, calculate_entropy=False, global_batch_size=rows * dp,
                         mini_batch_size=rows * dp, epochs=epochs,
                         seed=42, dataloader_kwargs={"shuffle": False}, compute_loss=True)
    worker.train_mini_batch(data)
    return grads


def _full(grad: torch.Tensor | None) -> torch.Tensor:
    if grad is None:
        raise AssertionError("a trainable parameter got no gradient")
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad

"""What the asynchronous-trainer tests share, in one process or two (trl_async_child.py): scripted rollout samples
fed through TRL's documented worker interface (no vLLM server), a weight sync that sends nowhere, one training run of
`LongStrawAsyncGRPOTrainer`, and the reference.

The reference is written from TRL 1.16's `AsyncGRPOTrainer.compute_loss` with every sample run on its own through
transformers (no LongStraw code): each micro-batch's rows come from TRL's own planner (`FixedCountBatcher`, or
`TokenBudgetBatcher` with a token budget), a row's
loss is Σ over its samples' trained tokens of −min(r A, clip(r, 1 − ε_low, 1 + ε_high) A) with r = exp(logp − old)
(old log-probs and advantages in float32, as TRL packs them), divided by max(trained tokens of the micro-batch /
processes, 1) and by gradient accumulation, plus the router coefficient over gradient accumulation times transformers'
aux loss over the row's trie (each trie node's router logits once, the nodes TRL's `TreeRow` makes), and the step's
gradient is the mean of the rows' gradients over the processes (DDP's average), then one SGD step.
"""

from __future__ import annotations

import importlib
import queue
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from helpers import faithful_float64
from transformers import AutoModelForCausalLM
from trl.experimental.async_grpo.async_grpo_trainer import FixedCountBatcher, TokenBudgetBatcher
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.experimental.async_grpo.packing import TreeRow
from trl_setup import Gradients

from longstraw.models.tokenizer import byte_tokenizer_hf

# AsyncGRPOConfig settings of every equality run: SGD at a constant rate without clipping (the update is the
# gradient), fixed-count micro-batches (token_budget 0: per_device_train_batch_size samples per rank), no staleness
# drop, temperature and asymmetric clipping as TRL users set them.
SETTINGS = dict(per_device_train_batch_size=6, gradient_accumulation_steps=2, max_steps=2, learning_rate=0.5,
                optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, bf16=False, report_to="none",
                save_strategy="no", seed=0, logging_steps=1, disable_tqdm=True, temperature=0.7, epsilon=0.2,
                epsilon_high=0.28, token_budget=0, max_staleness=100, num_generations=3)


def samples(count: int, seed: int = 0, vocab: int = 64) -> list[RolloutSample]:
    """`count` scored samples as TRL's rollout worker makes them: a system prompt every sample shares (10 tokens),
    groups of 3 samples per prompt (6 prompt tokens), each sample a completion, a tool result (masked out of the loss:
    completion_mask 0) and a second completion; the third sample of each group repeats the first's first completion
    (it forks after it, as a conversation's rows do). Old log-probs and advantages are float32 values."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (10,), generator=g)
    out, firsts = [], []
    for i in range(count):
        group = i // 3
        task = torch.randint(3, vocab, (6,), generator=torch.Generator().manual_seed(1000 + seed * 100 + group))
        n1, n2, tool = 3 + (i * 5) % 4, 2 + (i * 3) % 3, 2 + i % 2
        first = firsts[-2] if i % 3 == 2 else torch.randint(3, vocab, (n1,), generator=g)
        firsts.append(first)
        n1 = first.numel()
        parts = [system, task, first, torch.randint(3, vocab, (tool,), generator=g),
                 torch.randint(3, vocab, (n2,), generator=g)]
        ids = torch.cat(parts).numpy()
        mask = np.concatenate([np.zeros(16, np.int64), np.ones(n1, np.int64), np.zeros(tool, np.int64),
                               np.ones(n2, np.int64)])
        old = (-0.3 - 2.5 * torch.rand(ids.size, generator=g)).to(torch.float32).numpy()
        advantage = float(torch.randn((), generator=g).to(torch.float32))
        out.append(RolloutSample(prompt=[], completion=[], input_ids=ids, completion_mask=mask, old_log_probs=old,
                                 advantage=advantage, model_version=0, group_id=group,
                                 metrics={"reward": advantage}))
    return out


class ScriptedWorker:
    """TRL's `RolloutWorkerProtocol` over a list of samples: its queue holds them all from the start."""

    def __init__(self, items: list[RolloutSample]) -> None:
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        for item in items:
            self.rollout_buffer.put(item)
        self.versions: list[int] = []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        raise RuntimeError("the scripted worker ran out of samples")


class NoWeightSync:
    """TRL's `WeightTransferProtocol` sending nowhere (no vLLM server): it only consumes the weights."""

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Any) -> None:
        for _ in iterator:
            pass

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def train_ours(model_dir: str, items: list[RolloutSample], out_dir: str, dtype: torch.dtype = torch.float64,
               info: dict | None = None, **config: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One LongStrawAsyncGRPOTrainer run from the saved model on `items`; (gradient per optimizer step, parameters
    after). info: gets the trainer's log history."""
    from longstraw.integrations.trl_async import LongStrawAsyncGRPOConfig, LongStrawAsyncGRPOTrainer

    settings = dict(SETTINGS, **config)
    settings["model_init_kwargs"] = {"dtype": dtype, "experts_implementation": "eager",
                                     **settings.get("model_init_kwargs", {})}
    gradients = Gradients()
    trainer = LongStrawAsyncGRPOTrainer(model_dir, args=LongStrawAsyncGRPOConfig(output_dir=out_dir, **settings),
                                        train_dataset=Dataset.from_dict({"prompt": ["p"] * 8}),
                                        processing_class=byte_tokenizer_hf(), callbacks=[gradients],
                                        rollout_worker=ScriptedWorker(items), weight_transfer=NoWeightSync())
    if dtype == torch.float64:
        faithful_float64(trainer.accelerator.unwrap_model(trainer.model))
    trainer.train()
    if info is not None:
        info["log_history"] = list(trainer.state.log_history)
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad])
    return gradients.steps, params


def _row_loss(model: torch.nn.Module, row: TreeRow, tokens_per_rank: float, steps: int, settings: dict,
              coef: float) -> torch.Tensor:
    """TRL's compute_loss for one rank's row, each sample run on its own (module docstring)."""
    low, high, temperature = settings["epsilon"], settings["epsilon_high"], settings["temperature"]
    loss = torch.zeros((), dtype=torch.float64)
    seen: set[int] = set()
    layers: list[list[torch.Tensor]] = []
    for sample, nodes in zip(row.samples, row.sample_nodes):
        ids = torch.as_tensor(sample["input_ids"])[None]
        out = model(input_ids=ids, output_router_logits=bool(coef), use_cache=False)
        logp = torch.log_softmax(out.logits[0, :-1] / temperature, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        trained = torch.as_tensor(sample["completion_mask"])[1:].bool()
        old = torch.as_tensor(sample["old_log_probs"], dtype=torch.float32)[1:][trained]
        advantage = torch.tensor(sample["advantage"], dtype=torch.float32)
        ratio = torch.exp(logp[trained] - old)
        loss = loss - torch.min(ratio * advantage, torch.clamp(ratio, 1 - low, 1 + high) * advantage).sum()
        if coef:
            first = [k for k, node in enumerate(nodes) if node not in seen]
            seen.update(nodes)
            layers = layers or [[] for _ in out.router_logits]
            for parts, logits in zip(layers, out.router_logits):
                parts.append(logits.reshape(ids.shape[1], -1)[first])
    loss = loss / tokens_per_rank / steps
    if coef:
        module = importlib.import_module(type(model).__module__)
        config = model.config
        aux = module.load_balancing_loss_func(tuple(torch.cat(p) for p in layers), config.num_local_experts
                                              if hasattr(config, "num_local_experts") else config.num_experts,
                                              config.num_experts_per_tok, None)
        loss = loss + coef * aux / steps
    return loss


def train_reference(model_dir: str, items: list[RolloutSample], processes: int = 1,
                    dtype: torch.dtype = torch.float64, coef: float = 0.0, attention: str = "sdpa",
                    **config: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The reference of the module docstring: (gradient per optimizer step, parameters after)."""
    settings = dict(SETTINGS, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention,
                                                 experts_implementation="eager")
    if dtype == torch.float64:
        faithful_float64(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    dicts = [{"input_ids": s.input_ids, "completion_mask": s.completion_mask, "old_log_probs": s.old_log_probs,
              "advantage": s.advantage, "group_id": s.group_id, "metrics": s.metrics} for s in items]
    if settings["token_budget"] > 0:
        batches = iter(TokenBudgetBatcher(dicts, processes, settings["token_budget"], defaultdict(list)))
    else:
        batches = iter(FixedCountBatcher(dicts, processes, settings["per_device_train_batch_size"] * processes))
    steps = settings["gradient_accumulation_steps"]
    gradients = []
    for _ in range(settings["max_steps"]):
        model.zero_grad()
        for _ in range(steps):
            rows = next(batches)
            trained = sum(int(np.asarray(s["completion_mask"])[1:].sum()) for row in rows for s in row.samples)
            per_rank = max(trained / processes, 1.0)
            for row in rows:
                (_row_loss(model, row, per_rank, steps, settings, coef) / processes).backward()
        gradients.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                    for p in params]).clone())
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p -= settings["learning_rate"] * p.grad
    return gradients, torch.cat([p.detach().flatten() for p in params])

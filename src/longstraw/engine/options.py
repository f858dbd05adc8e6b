"""`BackwardOptions`: how `backward_group` computes one group's gradient, validated once on construction.

The same object serves the Python API, the trainer (`TrainConfig.plan.backward_options()`) and the TRL integration,
so every rule about a combination of options lives here. What can only be checked against a model, a group or a
prompt state (the architecture, the prompt's length) is checked by `backward_group` before anything runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from longstraw.choices import MIN_TEMPERATURE, int_at_least
from longstraw.engine.activation_checkpointing import check_checkpoint
from longstraw.engine.logprobs import DEFAULT_TOKEN_CHUNK
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.state.sharding import ContextShards
from longstraw.plan import EXACT, Plan, plan_named

ROUTER_COUNTS = ("sequences", "packed")


@dataclass(frozen=True)
class BackwardOptions:
    """Every option of one group's backward.

    plan: a `longstraw.plan.Plan` (standard, standard_batched, detach, exact) or its name.
    loss: a `LossConfig` (`longstraw.engine.loss.config`: the loss and its parameters, e.g.
    `LossConfig("dapo", epsilon_high=0.3, beta=0.04)`) or a loss's name (its defaults).
    chunk_size: prompt tokens per capture chunk (and per prompt-backward chunk of the exact plan).
    micro_batch: responses replayed at once (detach/exact). token_chunk: rows per block of the chunked log-prob.
    checkpoint: "none" or "layers" (per-layer activation checkpointing of every forward with grad).
    offload_state: keep the prompt state (and the exact plan's state gradient) in host memory, one layer's part
    copied to the device where it is read (detach/exact).
    keep_prompt_graph: exact plan, capturing itself: the last N capture chunks keep their graph until the prompt
    backward, which then skips their recompute (0: recompute every chunk, the lowest peak).
    temperature: log-probs of logits / temperature (the sampling temperature), in every plan.
    allow_train_mode: accept a model in train() mode whose train and eval forwards compute the same numbers.
    context_shards: a context-parallel group (`state.sharding.ContextShards`, made by
    `distributed.context.ContextParallel`) (detach/exact): each rank keeps 1/C of the prompt's attention state.
    router_aux_coef: a Mixture-of-Experts model's load-balancing loss over the batch's sequences times this, added to
    the loss (`engine/router.py`); 0: none. Costs one forward of the batch without grad first (the top-k counts).
    Under detach its shared tokens' share of the gradient is left out, like every path through a state.
    router_count: how often the term counts a token that several trajectories hold: "sequences" (once per trajectory,
    as transformers' forward of the batch) or "packed" (once per position of the tree's trie, as one packed forward
    of the tree: TRL's asynchronous trainer; detach/exact, `engine/tree/routes.py`)."""

    plan: Plan = EXACT
    loss: LossConfig = LossConfig()
    chunk_size: int = 2048
    micro_batch: int = 1
    token_chunk: int = DEFAULT_TOKEN_CHUNK
    checkpoint: str = "none"
    offload_state: bool = False
    keep_prompt_graph: int = 0
    temperature: float = 1.0
    allow_train_mode: bool = False
    router_aux_coef: float = 0.0
    router_count: str = "sequences"
    context_shards: ContextShards | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", plan_named(self.plan))
        if isinstance(self.loss, str):
            object.__setattr__(self, "loss", LossConfig(self.loss))
        elif not isinstance(self.loss, LossConfig):
            raise TypeError(f"loss must be a LossConfig (e.g. LossConfig('dapo', beta=0.04)) or a loss's name, got "
                            f"{type(self.loss).__name__}")
        for name in ("chunk_size", "micro_batch", "token_chunk"):
            int_at_least(name, getattr(self, name), 1)
        object.__setattr__(self, "checkpoint", check_checkpoint(self.checkpoint))
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
                math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be a finite number >= {MIN_TEMPERATURE}, got {temperature!r}: below it "
                             "logits / temperature can overflow to inf (1e-45 makes every logit inf)")
        object.__setattr__(self, "temperature", float(temperature))
        for name in ("offload_state", "allow_train_mode"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        plan, keep = self.plan, self.keep_prompt_graph
        if self.context_shards is not None and not plan.supports_context_parallel:
            raise ValueError(f"context parallelism shards the prompt state: use plan detach or exact, not {plan}")
        if self.offload_state and not plan.supports_offload:
            raise ValueError(f"offload_state moves the prompt state to host memory: the {plan} plan has none; use "
                             "plan detach or exact")
        int_at_least("keep_prompt_graph", keep, 0, " (capture chunks whose graph is kept)")
        if keep and not plan.supports_kept_graphs:
            raise ValueError(f"keep_prompt_graph keeps capture graphs for the exact plan's prompt backward; the {plan} "
                             "plan has none: pass keep_prompt_graph=0 or plan='exact'")
        aux = self.router_aux_coef
        if isinstance(aux, bool) or not isinstance(aux, (int, float)) or not (math.isfinite(aux) and aux >= 0):
            raise ValueError(f"router_aux_coef must be a finite number >= 0, got {aux!r}")
        object.__setattr__(self, "router_aux_coef", float(aux))
        if self.router_count not in ROUTER_COUNTS:
            raise ValueError(f"router_count must be one of {', '.join(ROUTER_COUNTS)}, got {self.router_count!r}")
        if self.router_count == "packed" and not plan.captures_state:
            raise ValueError(f"router_count='packed' weighs the runs of the tree walk; the {plan} plan runs every "
                             "trajectory as a full sequence: use plan exact or detach")
        if aux and keep:
            raise ValueError("router_aux_coef > 0 adds the prompt tokens' router term in a recompute of every prompt "
                             "chunk, which a kept capture graph would skip: pass keep_prompt_graph=0")
        if aux and self.context_shards is not None:
            raise ValueError("router_aux_coef > 0 is not supported with context parallelism: run without it, or set "
                             "router_aux_coef=0")
        if keep and self.context_shards is not None:
            raise ValueError("keep_prompt_graph is not supported with context parallelism: pass keep_prompt_graph=0")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options a caller sets."""
        return tuple(f.name for f in fields(cls))

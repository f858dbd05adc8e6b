"""The Mixture-of-Experts load-balancing loss (transformers' `load_balancing_loss_func`) as a term of the backward.

transformers' MoE causal LMs (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, gpt-oss) compute, over every token of a batch
(the attention mask weighting each) and every MoE layer's router logits z (rows, E):

    p = softmax(z),  c_e = Σ_rows mask · [e in top_k(p)],  s_e = Σ_rows mask · p_e,  n = Σ_rows mask
    aux = E · Σ_e (c_e / n) · (s_e / n)          (c, s, n summed over the layers; float32 sums)

The counts c carry no gradient, so d aux / d p_row = mask · E · c / n²: the same weight vector for every row. Once
c and n are known (`tree.routes.count_routes` runs the batch's tokens once without grad first), each token's share of
the gradient is added where its routers run with grad (a replay for response tokens, the exact plan's prompt
recompute for prompt tokens), as `RouterAux.term`. A token weighs as many sequences of the batch as hold it (a prefix
tree's shared token: the trajectories through it, `tree/routes.py`). `aux_gradient` repeats transformers' float32
arithmetic, so the added gradient is the one autograd gives through transformers' function."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from longstraw.models.architecture import hf


@dataclass(frozen=True)
class RouterCounts:
    """Top-k assignments per expert over a batch, summed over its MoE layers: counts (E,) float64 (whole numbers),
    rows: Σ over the MoE layers of the batch's (weighted) tokens, transformers' `total_rows`."""

    counts: torch.Tensor
    rows: float

    def __add__(self, other: RouterCounts) -> RouterCounts:
        return RouterCounts(self.counts + other.counts.to(self.counts.device), self.rows + other.rows)

    def rounded(self) -> RouterCounts:
        """Counts and rows are whole numbers (each token's weight is a count of rows); sums only reassociate."""
        return RouterCounts(self.counts.round(), float(round(self.rows)))


def _router_recorder(model: torch.nn.Module) -> tuple[type[torch.nn.Module], int, str | None]:
    """What transformers records as `router_logits`: the module class, the output's index, and the submodule name
    the class is narrowed to (None: every module of the class)."""
    recorders = getattr(hf(model), "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    target = getattr(recorder, "target_class", None)
    if recorder is None or target is None:
        model_type = hf(model).config.model_type
        raise ValueError(f"router_aux_coef > 0 needs a Mixture-of-Experts model whose router logits transformers "
                         f"records (output_router_logits); {model_type} has none: set router_aux_coef=0")
    return target, int(getattr(recorder, "index", 0) or 0), getattr(recorder, "layer_name", None)


def top_k(model: torch.nn.Module) -> int:
    """Experts per token (the `top_k` transformers passes to `load_balancing_loss_func`)."""
    config = hf(model).config
    k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"router_aux_coef > 0: {config.model_type}'s config has no num_experts_per_tok")
    return k


class RouterTap:
    """Forward hooks on every router module; `logits` holds each router call's (rows, E) logits since `clear`."""

    def __init__(self, model: torch.nn.Module) -> None:
        cls, self.index, name = _router_recorder(model)
        self.modules: list[torch.nn.Module] = [m for path, m in model.named_modules()
                                               if isinstance(m, cls) and (name is None or path.endswith(name))]
        if not self.modules:
            raise ValueError(f"router_aux_coef > 0: no {cls.__name__} module in the model")
        self.logits: list[torch.Tensor] = []

    def _hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        out = output[self.index] if isinstance(output, (tuple, list)) else output
        assert isinstance(out, torch.Tensor)
        self.logits.append(out.reshape(-1, out.shape[-1]))

    @contextmanager
    def hooked(self) -> Iterator[RouterTap]:
        handles = [m.register_forward_hook(self._hook) for m in self.modules]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.logits = []

    def clear(self) -> None:
        """Before a forward: drop what earlier forwards (or an activation-checkpointing recompute) recorded."""
        self.logits = []

    def take(self) -> list[torch.Tensor]:
        out, self.logits = self.logits, []
        return out


def count(logits: list[torch.Tensor], weights: torch.Tensor, k: int) -> RouterCounts:
    """Top-k assignments of routers' logits [(rows, E)], each row weighted by `weights` (rows,)."""
    w = weights.reshape(-1).detach().to(torch.float64)
    num_experts = logits[0].shape[-1]
    counts = torch.zeros(num_experts, dtype=torch.float64, device=w.device)
    for z in logits:
        chosen = torch.topk(torch.softmax(z.detach(), dim=-1), k, dim=-1).indices  # as transformers selects
        counts.scatter_add_(0, chosen.reshape(-1).to(w.device), w.repeat_interleave(k))
    return RouterCounts(counts, float(w.sum()) * len(logits))


def aux_gradient(counts: RouterCounts, coef: float) -> torch.Tensor:
    """d (coef · aux) / d p_row for a row of weight 1 (E,) float32, by autograd through transformers' own float32
    arithmetic (`load_balancing_loss_func`'s last lines)."""
    prob_sum = torch.zeros(counts.counts.numel(), dtype=torch.float32, requires_grad=True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(_aux(counts, prob_sum) * coef, prob_sum)
    return grad


def aux_value(counts: RouterCounts, prob_sums: torch.Tensor) -> float:
    """transformers' aux loss from the batch's counts and its (weighted) probability sums (E,)."""
    return float(_aux(counts, prob_sums.float().cpu()))


def _aux(counts: RouterCounts, prob_sums: torch.Tensor) -> torch.Tensor:
    """transformers' float32 aux loss (`load_balancing_loss_func`'s last lines) of counts and prob_sums (E,)."""
    rows = torch.tensor(counts.rows, dtype=torch.float32)
    tokens_per_expert = counts.counts.to(torch.float32).cpu() / rows
    return torch.sum(tokens_per_expert * (prob_sums / rows).unsqueeze(0)) * counts.counts.numel()


class RouterAux:
    """One backward's load-balancing term, `coef` · aux over a batch with `counts`. A walk calls `tap.clear()` before a
    forward with grad, `term(weights)` after it, and adds the term to what it backpropagates."""

    def __init__(self, model: torch.nn.Module, counts: RouterCounts, coef: float) -> None:
        self.tap = RouterTap(model)
        self.grad = aux_gradient(counts, coef)  # (E,) float32
        self.counts = counts

    def term(self, weights: torch.Tensor) -> torch.Tensor:
        """A zero-valued scalar whose gradient is this forward's rows' share of d (coef · aux): weights (rows,)
        per token, in the order the routers see them ((B, T) flattened)."""
        logits = self.tap.take()
        if not logits:
            raise RuntimeError("no router ran in this forward")
        total = None
        for z in logits:
            w = weights.reshape(-1).to(device=z.device, dtype=torch.float64)
            probs = torch.softmax(z, dim=-1)  # (rows, E)
            scale = (w[:, None] * self.grad.to(device=z.device, dtype=torch.float64)[None, :]).to(probs.dtype)
            part = (probs * scale).sum()
            total = part if total is None else total + part
        assert total is not None
        return total - total.detach()

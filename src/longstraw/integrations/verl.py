"""verl's actor update with LongStraw's backward: each prompt encoded once per mini-batch, not once per response.

Turned on by verl's own plug-in point, no fork of verl:

    actor_rollout_ref.model.external_lib=longstraw.integrations.verl

verl imports this module in every worker; importing it puts `LongStrawFSDPEngine` in verl's engine registry for the
language model's FSDP backends (`strategy` fsdp or fsdp2), so the actor builds it instead of `FSDPEngineWithLMHead`.
Everything else stays verl's; `forward_backward_batch` of a training mini-batch runs `backward_tree` once over one
prefix tree of all its rows, inside one all-gather / reduce-scatter of the FSDP parameters, with the loss that is
verl's `ppo_loss` (`loss_config`); what it cannot reproduce is refused before any parameter or gradient is touched.
verl's Ulysses group shards the prompt state as LongStraw's context-parallel group (`distributed.context`).
LongStraw's own settings are the workers' LONGSTRAW_* environment variables (`settings_from_environment`).
docs/verl.md has the variables, the loss mapping and the clamps."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

try:
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine.utils import postprocess_batch_func
    from verl.workers.utils.losses import ppo_loss
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"longstraw.integrations.verl needs verl: pip install 'longstraw[verl]' ({err})") from err

from longstraw.api.tree import backward_tree
from longstraw.distributed.context import ContextParallel
from longstraw.distributed.context import check_supported as check_context_supported
from longstraw.distributed.fsdp import sharded_compute
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.options import BackwardOptions
from longstraw.engine.tree.build import Trajectory, Tree, build_tree
from longstraw.models.architecture import hf
from longstraw.plan import EXACT, Plan, plan_named

__all__ = ["LongStrawFSDPEngine", "install", "loss_config", "settings_from_environment"]

# verl's loss_agg_mode -> the LongStraw loss whose normaliser it is (`loss_config` scales it to verl's).
_AGG_LOSS = {
    "token-mean": "dapo",  # Σ tokens / tokens of the mini-batch (over the data-parallel ranks)
    "token-sum": "dapo",  # Σ tokens (a token normaliser of 1)
    "seq-mean-token-mean": "grpo",  # mean over sequences of each sequence's token mean
    "seq-mean-token-sum": "luspo",  # mean over sequences of each sequence's token sum
    "seq-mean-token-sum-norm": "luspo",  # the same divided by a constant horizon
}
_KL_TYPES = ("low_var_kl", "k3")  # the k3 estimate, LongStraw's KL term
# verl's numerical-stability clamps (verl/trainer/ppo/core_algos.py), as LongStraw's loss options:
_KL_CLAMP = (20.0, 10.0)  # kl_penalty_forward, low_var_kl and k3 alike: ref − logp to ±20 before exp, k3 to ±10
_LOG_RATIO_CLAMP = {
    "vanilla": (-20.0, 20.0),  # compute_policy_loss_vanilla: logp − old to ±20 before exp
    "gspo": (-float("inf"), 10.0),  # compute_policy_loss_gspo: the sequence's mean log-ratio at most 10
}


@dataclass(frozen=True)
class Settings:
    """LongStraw's own options inside verl (the loss's come from verl's actor config)."""

    plan: Plan = EXACT  # or its name
    chunk_size: int = 2048
    micro_batch: int = 1
    checkpoint: str = "none"
    tree_min_shared: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", plan_named(self.plan))


def settings_from_environment(environ: dict[str, str] | None = None) -> Settings:
    """The LONGSTRAW_* variables (LONGSTRAW_PLAN, _CHUNK_SIZE, _MICRO_BATCH, _CHECKPOINT, _TREE_MIN_SHARED: the
    `Settings` fields; docs/verl.md), validated (a bad value names the variable)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name, kind in (("plan", str), ("chunk_size", int), ("micro_batch", int), ("checkpoint", str),
                       ("tree_min_shared", int)):
        key = f"LONGSTRAW_{name.upper()}"
        if key in env:
            try:
                values[name] = kind(env[key])
            except ValueError:
                raise ValueError(f"{key}={env[key]!r} is not a valid {kind.__name__}") from None
    if values.get("tree_min_shared", 1) < 1:
        raise ValueError(f"LONGSTRAW_TREE_MIN_SHARED={values['tree_min_shared']} must be >= 1")
    try:
        settings = Settings(**values)
        BackwardOptions(plan=settings.plan, chunk_size=settings.chunk_size, micro_batch=settings.micro_batch,
                        checkpoint=settings.checkpoint)
    except (TypeError, ValueError) as err:
        raise ValueError(f"LONGSTRAW_* environment: {err}") from err
    return settings


def _actor_config(loss_function: Callable[..., Any] | None) -> Any | None:
    """verl's ActorConfig when `loss_function` is its policy loss (`partial(ppo_loss, config=...)`), else None."""
    if isinstance(loss_function, partial) and loss_function.func is ppo_loss:
        return loss_function.keywords.get("config")
    return None


def _clip_ratios(config: Any) -> tuple[float, float]:
    """verl's (low, high) clip widths: clip_ratio_low / clip_ratio_high, each clip_ratio when unset."""
    low, high = config.clip_ratio_low, config.clip_ratio_high
    return (config.clip_ratio if low is None else low), (config.clip_ratio if high is None else high)


def config_refusals(config: Any) -> list[str]:
    """What in verl's actor config LongStraw's loss cannot reproduce, each with the reason and what to change."""
    out = []
    mode = config.policy_loss.get("loss_mode", "vanilla")
    if mode not in ("vanilla", "gspo"):
        out.append(f"policy_loss.loss_mode={mode!r}: LongStraw maps 'vanilla' (PPO clip, dual clip) and 'gspo'")
    agg = config.loss_agg_mode
    if agg not in _AGG_LOSS:
        out.append(f"loss_agg_mode={agg!r}: LongStraw maps {', '.join(_AGG_LOSS)}")
    if config.entropy_coeff != 0 or config.calculate_entropy:
        out.append("entropy_coeff / calculate_entropy: LongStraw's loss has no entropy term (its per-token entropy "
                   "needs the whole vocabulary's distribution of every response token kept for the backward); set "
                   "entropy_coeff=0 and calculate_entropy=False")
    if config.use_kl_loss and config.kl_loss_type not in _KL_TYPES:
        out.append(f"kl_loss_type={config.kl_loss_type!r}: LongStraw's KL term is the k3 estimate; use "
                   "kl_loss_type=low_var_kl (verl's k3, clamped to ±10)")
    if mode == "vanilla":
        low, high = _clip_ratios(config)
        c = config.get("clip_ratio_c", 3.0)
        if c < 1.0 + high:
            out.append(f"clip_ratio_c={c} is below 1 + clip_ratio_high ({1.0 + high}): LongStraw's dual clip "
                       "(delta) equals verl's from there up; raise clip_ratio_c")
        if low >= 1:
            out.append(f"clip_ratio_low={low}: must be < 1")
    return out


def loss_config(config: Any, group_size: int, *, dp_size: int, batch_num_tokens: float, global_batch_size: int,
                horizon: int) -> LossConfig:
    """The loss (its options) that makes one group's share of LongStraw's loss equal to its share of verl's
    `ppo_loss` summed over the micro-batches of a mini-batch on this rank, before the data-parallel mean that FSDP
    takes (verl's agg_loss multiplies each rank's loss by dp_size for that mean). docs/verl.md has the mapping of
    each loss_agg_mode (B = `global_batch_size`, N = `batch_num_tokens`, the padded response width `horizon` when
    loss_scale_factor is unset), of vanilla PPO's dual clip (delta = clip_ratio_c) and gspo, and of verl's clamps."""
    agg, mode = config.loss_agg_mode, config.policy_loss.get("loss_mode", "vanilla")
    if mode not in _LOG_RATIO_CLAMP:
        raise ValueError(f"policy_loss.loss_mode {mode!r} is not mapped: choose one of {', '.join(_LOG_RATIO_CLAMP)}")
    low, high = _clip_ratios(config)
    options: dict[str, Any] = {
        "epsilon_low": float(low), "epsilon_high": float(high),
        "sequence_ratio": mode == "gspo",
        "delta": float(config.get("clip_ratio_c", 3.0)) if mode == "vanilla" else None,
        "beta": float(config.kl_loss_coef) if config.use_kl_loss else 0.0,
        "log_ratio_clamp": _LOG_RATIO_CLAMP[mode],
        "kl_clamp": _KL_CLAMP if config.use_kl_loss else None,
    }
    if agg == "token-mean":
        options |= {"token_normalizer": float(batch_num_tokens), "loss_scale": float(dp_size)}
    elif agg == "token-sum":
        options |= {"token_normalizer": 1.0, "loss_scale": float(dp_size)}
    elif agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        options |= {"loss_scale": group_size * dp_size / global_batch_size}
    elif agg == "seq-mean-token-sum-norm":
        factor = config.loss_scale_factor if config.loss_scale_factor is not None else horizon
        options |= {"loss_scale": group_size * dp_size / global_batch_size / factor}
    else:
        raise ValueError(f"loss_agg_mode {agg!r} is not mapped: choose one of {', '.join(_AGG_LOSS)}")
    return LossConfig(_AGG_LOSS[agg], **options)


def _tree(data: Any, with_ref: bool, settings: Settings, device: torch.device) -> Tree | None:
    """The mini-batch's rows with a token in the loss as one prefix tree, each row its own group (None: no row has a
    token in the loss; such rows add nothing to verl's loss either, whose normalisers count them as the options do).
    The rows come in verl's no-padding layout: `input_ids` nested (B, j1) of prompt + response without padding;
    `attention_mask` (B, P_max + R_max) left-padded prompt, right-padded response; `response_mask`, `old_log_probs`,
    `advantages`, `ref_log_prob` (B, R_max). Refuses what a LongStraw trajectory cannot hold."""
    if "rollout_is_weights" in data.keys():
        raise ValueError("rollout importance-sampling weights (rollout_is_weights) are not mapped: LongStraw's loss "
                         "has no per-token weight; turn off algorithm.rollout_correction")
    response_mask = data["response_mask"]
    attention = data["attention_mask"][:, -response_mask.shape[-1]:]  # (B, R_max): the response part
    trajectories = []
    for k, seq in enumerate(data["input_ids"].unbind()):
        length = int(attention[k].sum())
        if length == 0 or not bool(attention[k, :length].all()):
            raise ValueError(f"row {k}: its response is not one right-padded stretch of tokens (attention "
                             f"{attention[k].tolist()}): LongStraw replays each response as one sequence")
        mask = response_mask[k, :length].bool()
        advantages = data["advantages"][k, :length]
        bad = mask & ~torch.isfinite(advantages)
        if bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            raise ValueError(f"row {k} of the mini-batch: its advantage is {float(advantages[t])} at response "
                             f"token {t} ({int(bad.sum())} of its {int(mask.sum())} loss tokens are not finite); "
                             "advantages must be finite: look for a NaN or inf reward score in this row's group, or "
                             "an advantage estimator (algorithm.adv_estimator) dividing by a zero or NaN spread")
        first = advantages[mask][:1]
        if mask.any() and not bool((advantages[mask] == first).all()):
            raise ValueError("per-token advantages (e.g. GAE from a critic) are not mapped: LongStraw's losses take "
                             "one advantage per response (GRPO, RLOO, REINFORCE++ outcome advantages)")
        if mask.any():
            trajectories.append(Trajectory(
                ids=seq.to(device), loss_start=seq.numel() - length, advantage=float(first), loss_mask=mask.to(device),
                old_logprobs=data["old_log_probs"][k, :length].to(device),
                ref_logprobs=data["ref_log_prob"][k, :length].to(device) if with_ref else None, group=k))
    return build_tree(trajectories, settings.tree_min_shared) if trajectories else None


def _temperature(data: Any) -> float:
    t = data["temperature"] if "temperature" in data.keys() else 1.0
    if isinstance(t, torch.Tensor):
        if not bool((t == t.flatten()[0]).all()):
            raise ValueError("per-sample temperatures are not mapped: LongStraw takes one temperature per group "
                             "and these rows differ")
        t = t.flatten()[0]
    return float(t)


class LongStrawFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP engine for the language model, whose training mini-batch runs `backward_tree` over one prefix tree of
    its rows. Forward-only passes (old and reference log-probs), other loss functions and the rest stay verl's."""

    def forward_backward_batch(self, data: Any, loss_function: Callable[..., Any], forward_only: bool = False) -> Any:
        config = _actor_config(loss_function)
        if forward_only or config is None:
            return super().forward_backward_batch(data, loss_function, forward_only)
        settings = settings_from_environment()
        refusals = config_refusals(config) + self._context_refusals(settings)
        if refusals:
            raise ValueError("LongStraw cannot compute verl's loss with: " + "; ".join(refusals))
        dp_group, dp_size = self.get_data_parallel_group(), self.get_data_parallel_size()
        # The normalisers verl's ppo_loss reads, computed as forward_backward_batch computes them.
        device = next(self.module.parameters()).device
        batch_num_tokens = data["loss_mask"].sum().to(device)
        torch.distributed.all_reduce(batch_num_tokens, op=torch.distributed.ReduceOp.SUM, group=dp_group)
        tree = _tree(data, bool(config.use_kl_loss), settings, device)
        # every row its own group: verl's normalisers are the mini-batch's (`loss_config` of a group of one row)
        options = BackwardOptions(plan=settings.plan, chunk_size=settings.chunk_size, micro_batch=settings.micro_batch,
                                  checkpoint=settings.checkpoint, temperature=_temperature(data),
                                  allow_train_mode=True,
                                  loss=loss_config(config, 1, dp_size=dp_size, batch_num_tokens=float(batch_num_tokens),
                                                   global_batch_size=int(data["global_batch_size"]),
                                                   horizon=data["response_mask"].shape[-1]),
                                  context_shards=self._context_shards())
        autocast_dtype = getattr(self, "_autocast_dtype", torch.float32)
        autocast = (nullcontext() if autocast_dtype == torch.float32
                    else torch.autocast(device_type=device.type, dtype=autocast_dtype))
        total, metrics = 0.0, {}
        # gradients reduce-scattered once at the end, as verl's no_sync accumulation does over its micro-batches
        with sharded_compute(self.module), autocast:
            if tree is not None:
                result = backward_tree(hf(self.module), tree, options)
                total = result.loss
                metrics = {f"actor/longstraw_{key}": float(result.stats[key])
                           for key in ("tokens_encoded", "tokens_flattened", "tree_nodes", "tree_depth",
                                       "peak_path_state_bytes")}
        output = {"loss": total, "metrics": {"actor/pg_loss": total, **metrics}}
        return postprocess_batch_func(output_lst=[output], indices=None, data=data)

    def _context_refusals(self, settings: Settings) -> list[str]:
        """What keeps verl's Ulysses group from sharding LongStraw's prompt state: a plan without a prompt state, a
        layer kind context parallelism does not cover."""
        size = self.ulysses_sequence_parallel_size
        if size <= 1:
            return []
        if not settings.plan.supports_context_parallel:
            return [f"ulysses_sequence_parallel_size={size} with LONGSTRAW_PLAN={settings.plan.name}: that plan keeps "
                    "no prompt state to shard; use exact or detach, or set ulysses_sequence_parallel_size=1"]
        try:
            check_context_supported(hf(self.module))
        except ValueError as err:
            return [f"ulysses_sequence_parallel_size={size}: {err}"]
        return []

    def _context_shards(self) -> ContextParallel | None:
        """verl's Ulysses group as LongStraw's context-parallel group (None without Ulysses). Its ranks hold the same
        rows and each ends with the complete gradient, so FSDP's mean over all ranks (dp × sp) is verl's mean over
        the data-parallel ranks, with verl's normalisers (`get_data_parallel_size` is already world / sp)."""
        if self.ulysses_sequence_parallel_size <= 1:
            return None
        if getattr(self, "_longstraw_context", None) is None:
            self._longstraw_context = ContextParallel(self.ulysses_parallel_group)
        return self._longstraw_context


def install() -> None:
    """Put `LongStrawFSDPEngine` wherever verl's registry holds `FSDPEngineWithLMHead` (the language model's fsdp
    and fsdp2 backends, every device). Idempotent; runs when this module is imported."""
    for backends in EngineRegistry._engines.get("language_model", {}).values():
        for key, cls in list(backends.items()):
            if cls is FSDPEngineWithLMHead:
                backends[key] = LongStrawFSDPEngine


install()

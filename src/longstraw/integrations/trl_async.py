"""TRL's asynchronous GRPO trainer with LongStraw's tree: the one-line switch for `AsyncGRPOTrainer` users.

    from longstraw.integrations.trl_async import LongStrawAsyncGRPOConfig, LongStrawAsyncGRPOTrainer
    trainer = LongStrawAsyncGRPOTrainer("Qwen/Qwen3.5-0.8B", args=LongStrawAsyncGRPOConfig(...), ...)

TRL's trainer runs each rank's prefix trie at once with a FlashAttention-3 tree kernel: CUDA only, every activation of
the trie held together, no model with a recurrent or convolutional layer or attention sinks. Here the same trie runs
as one `backward_tree`, one root-to-leaf path in memory, on any model LongStraw admits. What changes, and only that:
* the model loads with the attention the user asks for (`model_init_kwargs["attn_implementation"]`, else
  transformers' default) instead of TRL's tree kernel, and LongStraw's admission check replaces TRL's refusals of
  recurrent layers and sinks (`_loaded_for_longstraw`);
* the collator adds each rank's samples to TRL's packed batch (`SampleBatch`), since the tree is built from them;
* `compute_loss` runs `backward_tree` with TRL's loss: the per-token clipped ratio (`epsilon`, `epsilon_high`) summed
  and divided by the micro-batch's trained tokens per rank and by gradient accumulation (`LossConfig("dapo")` with
  that `token_normalizer`), plus the router term over the trie's positions (`router_count="packed"`), and averages
  the gradient over the processes as DDP would.
Everything else is TRL's: the rollout worker and queue, staleness, weight sync, the planner's micro-batches, metrics,
optimizer, checkpoints. TRL 1.16's trainer (`trl.experimental.async_grpo`) is the tested one; a later TRL's stable
`trl.AsyncGRPOTrainer` is taken when present."""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

try:
    try:
        from trl import AsyncGRPOConfig, AsyncGRPOTrainer  # type: ignore[attr-defined]
    except ImportError:
        from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"longstraw.integrations.trl_async needs TRL >= 1.16: pip install 'longstraw[trl]' ({err})"
                      ) from err

from longstraw.api.tree import backward_tree
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.precision import accumulation_dtype
from longstraw.engine.tree.build import Trajectory, build_tree
from longstraw.integrations.trl_config import LongStrawOptions, backward_options, option, refuse
from longstraw.integrations.trl_shared import autocast_of, average_gradients, model_refusals, policy_of, router_refusals
from longstraw.models.architecture import hf

__all__ = ["LongStrawAsyncGRPOConfig", "LongStrawAsyncGRPOTrainer"]

_TRAINER_MODULE: Any = sys.modules[AsyncGRPOTrainer.__module__]  # whose globals the trainer reads


@dataclass
class LongStrawAsyncGRPOConfig(LongStrawOptions, AsyncGRPOConfig):
    """TRL's `AsyncGRPOConfig` plus how LongStraw computes the gradient (`trl_config.LongStrawOptions`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        backward_options(self)  # refused here, when the config is built, not at the first micro-batch


def config_refusals(args: AsyncGRPOConfig) -> list[str]:
    """Why this configuration cannot be trained with LongStraw's backward (empty: it can)."""
    out = []
    if args.fp16:
        out.append("fp16=True: Trainer's gradient scaler scales the loss it backpropagates, and LongStraw runs its own "
                   "backward; load the model in bfloat16 (or float32) and set fp16=False")
    if args.fsdp or args.deepspeed:
        out.append("fsdp / deepspeed: the asynchronous drop-in runs one process per data-parallel rank (DDP's gradient "
                   "average); LongStraw's FSDP2 and ZeRO paths are in the synchronous drop-in "
                   "(longstraw.integrations.trl)")
    return out


@contextmanager
def _loaded_for_longstraw(args: AsyncGRPOConfig) -> Iterator[None]:
    """While TRL's `__init__` runs: its model loader asked for the user's attention (`model_init_kwargs`'
    attn_implementation, else transformers' default) instead of the tree kernel, the model's recurrent layer types
    and sink parameters hidden from the two refusals that follow the load (TRL's kernel cannot run them; LongStraw's
    walk can, `_model_refusals` checks the model instead), and shown again where TRL next touches the model,
    `add_fused_lm_head`, which LongStraw does not need (its loss computes the log-probs itself); off CUDA, no peak
    FLOP rate (TRL asks CUDA for the device's name), so no MFU metric."""
    load, fuse = _TRAINER_MODULE.create_model_from_path, _TRAINER_MODULE.add_fused_lm_head
    peak = _TRAINER_MODULE.get_peak_flops_per_device
    # TRL passes its tree kernel beside model_init_kwargs, so the user's choice leaves them while TRL loads
    init_kwargs = args.model_init_kwargs if isinstance(args.model_init_kwargs, dict) else {}
    attention = init_kwargs.pop("attn_implementation", None)  # None: transformers' default
    hidden: list[tuple[Any, type, torch.nn.Module]] = []

    def show() -> None:
        while hidden:
            config, cls, model = hidden.pop()
            config.__class__ = cls
            model.__dict__.pop("named_parameters", None)

    def loaded(path: str, **kwargs: Any) -> torch.nn.Module:
        kwargs["attn_implementation"] = attention
        model = load(path, **kwargs)
        config = model.config.get_text_config()
        hidden.append((config, type(config), model))
        # a property of a subclass hides the layer types whether the config stores them, computes them (Jamba) or
        # maps the name to another field (Falcon-H1, Nemotron-H: layers_block_type)
        names = {"layer_types", getattr(config, "attribute_map", {}).get("layer_types", "layer_types")}
        config.__class__ = type(type(config).__name__, (type(config),), {n: property(lambda _: None) for n in names})
        named = model.named_parameters
        model.__dict__["named_parameters"] = lambda *a, **k: ((n, p) for n, p in named(*a, **k)
                                                             if not n.endswith(".sinks"))
        return model

    def unfused(model: torch.nn.Module, **_: Any) -> None:
        show()

    def peak_flops(accelerator: Any, dtype: str) -> float | None:
        return peak(accelerator, dtype) if accelerator.device.type == "cuda" else None

    module = _TRAINER_MODULE
    module.create_model_from_path, module.add_fused_lm_head, module.get_peak_flops_per_device = loaded, unfused, \
        peak_flops
    try:
        yield
    finally:
        module.create_model_from_path, module.add_fused_lm_head, module.get_peak_flops_per_device = load, fuse, peak
        show()
        if attention is not None:
            init_kwargs["attn_implementation"] = attention


class SampleBatch:
    """TRL's collator (the packer) with each rank's samples added, as tensors whose first dimension is the rank (the
    dispatcher hands each rank its own): `ls_ids`, `ls_mask` (its completion_mask), `ls_old` (its old log-probs, float32
    as TRL packs them), all (P, S, L) zero-padded, `ls_length` (P, S) (0: no sample), `ls_advantage` (P, S) float32."""

    def __init__(self, packer: Any) -> None:
        self.packer = packer

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        batch = self.packer(examples)
        (rows,) = examples
        samples = [row.samples for row in rows]
        p, s = len(rows), max(len(row) for row in samples)
        length = max(len(x["input_ids"]) for row in samples for x in row)
        per_token = {"ls_ids": ("input_ids", torch.long), "ls_mask": ("completion_mask", torch.long),
                     "ls_old": ("old_log_probs", torch.float32)}  # key: (the sample's field, dtype)
        out = {key: torch.zeros(p, s, length, dtype=dtype) for key, (_, dtype) in per_token.items()}
        out |= {"ls_length": torch.zeros(p, s, dtype=torch.long),
                "ls_advantage": torch.zeros(p, s, dtype=torch.float32)}
        for r, row in enumerate(samples):
            for i, x in enumerate(row):
                n = len(x["input_ids"])
                for key, (name, dtype) in per_token.items():
                    out[key][r, i, :n] = torch.as_tensor(x[name], dtype=dtype)
                out["ls_length"][r, i], out["ls_advantage"][r, i] = n, float(x["advantage"])
        return {**batch, **out}


class LongStrawAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL's `AsyncGRPOTrainer` whose loss and backward are `longstraw.backward_tree` over each rank's samples. Takes
    AsyncGRPOTrainer's arguments; `args` may be a `LongStrawAsyncGRPOConfig` or a plain `AsyncGRPOConfig` (its
    defaults). Raises ValueError, listing every reason, for what it cannot train."""

    args: AsyncGRPOConfig
    model: torch.nn.Module

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(AsyncGRPOTrainer.__init__).bind(self, *args, **kwargs)
        named = bound.arguments
        if named.get("args") is None:
            named["args"] = LongStrawAsyncGRPOConfig(f"{str(named['model']).rstrip('/').split('/')[-1]}-AsyncGRPO")
        refuse(config_refusals(named["args"]), "LongStrawAsyncGRPOTrainer")
        self._longstraw = backward_options(named["args"])
        with _loaded_for_longstraw(named["args"]):
            super().__init__(*bound.args[1:], **bound.kwargs)
        refuse(self._model_refusals(), "LongStrawAsyncGRPOTrainer")

    def _policy(self) -> torch.nn.Module:
        return policy_of(self.accelerator, self.model)

    def _model_refusals(self) -> list[str]:
        out = []
        kind = str(self.accelerator.distributed_type.value)
        if kind not in ("NO", "MULTI_CPU", "MULTI_GPU"):
            out.append(f"accelerate's {kind}: the asynchronous drop-in runs under DDP (accelerate's MULTI_GPU / "
                       "MULTI_CPU) or one process")
        if self._is_vlm:
            out.append("a multimodal model: LongStraw replays text-only samples")
        out.extend(router_refusals(self, bool(self._longstraw.keep_prompt_graph)))
        if self.aux_loss_enabled and not self._longstraw.plan.captures_state:
            out.append(f"a Mixture-of-Experts load-balancing loss with longstraw_plan={self._longstraw.plan.name!r}: "
                       "TRL counts each position of its packed trie once, which the tree walk's plans (exact, "
                       "detach) reproduce and the full-sequence plans do not")
        policy = self._policy()
        options = self._longstraw
        if self.aux_loss_enabled and self.router_aux_loss_coef > 0:
            try:  # the router term's own checks (a model whose router logits LongStraw can record)
                options = replace(options, router_aux_coef=self.router_aux_loss_coef, router_count="packed")
            except ValueError:
                pass  # refused above: kept prompt graphs or a full-sequence plan
        out.extend(reason.replace("set router_aux_coef=0", "set router_aux_loss_coef=0.0")
                   for reason in model_refusals(policy, options, bool(self.args.bf16)))
        return out

    def _log_step_metrics(self) -> None:
        """TRL's, with its FLOP count per token (for MFU) NaN where it cannot count the architecture: it reads fields
        only the model types it accepts have (gpt-oss, Qwen3-Next or Jamba lack `moe_intermediate_size`)."""
        count = _TRAINER_MODULE.compute_flops_per_token

        def counted(config: Any, seq_len: int) -> float:
            try:
                return count(config, seq_len)
            except (AttributeError, TypeError):
                return float("nan")

        _TRAINER_MODULE.compute_flops_per_token = counted
        try:
            super()._log_step_metrics()
        finally:
            _TRAINER_MODULE.compute_flops_per_token = count

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        inner = loader.__dict__.get("base_dataloader", loader)  # accelerate's adapters iterate the loader they wrap
        inner.collate_fn = SampleBatch(inner.collate_fn)  # read by each new iterator of the loader
        return loader

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> torch.Tensor:
        if return_outputs or not self.model.training:
            raise ValueError("LongStrawAsyncGRPOTrainer computes the training loss only (it backpropagates it itself)")
        start = time.time()
        trajectories, trained = self._trajectories(inputs)
        total, aux, logprobs = 0.0, float("nan"), []
        world = self.accelerator.num_processes
        if trajectories:
            tree = build_tree(trajectories, option(self.args, "tree_min_shared"))
            with autocast_of(bool(self.args.bf16), self._policy()):
                result = backward_tree(self._policy(), tree, self._options(inputs))
            total, logprobs = result.loss, result.logprobs
            if self.aux_loss_enabled:
                aux = float(result.stats["router_aux_loss"])
                total += self.router_aux_loss_coef * aux / self.current_gradient_accumulation_steps
            for key in ("tokens_encoded", "tokens_flattened", "tree_nodes", "tree_depth"):
                self._metrics["train"][f"longstraw/{key}"].append(float(result.stats[key]))
        self._last_forward_time_s = time.time() - start
        if world > 1 and self.accelerator.sync_gradients:
            average_gradients(self._policy(), world)  # the last micro-batch of an optimizer step: DDP's average
        self._log_loss_metrics(trajectories[:trained], logprobs[:trained], aux)
        self._account(inputs)
        return torch.tensor(total, device=self.accelerator.device, requires_grad=True)

    def _options(self, inputs: dict[str, Any]) -> Any:
        """backward_tree's options for this micro-batch: TRL's loss divides the sum of its per-token terms by the
        micro-batch's trained tokens per rank (at least 1) and by gradient accumulation, and adds the router term's
        coefficient over gradient accumulation times the trie's aux loss."""
        steps = self.current_gradient_accumulation_steps
        per_rank = max(float(inputs["global_n_tokens"][0]) / self.accelerator.num_processes, 1.0)
        loss = LossConfig("dapo", epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                          token_normalizer=per_rank * steps)
        options = replace(self._longstraw, loss=loss, temperature=self.temperature)
        if self.aux_loss_enabled:
            options = replace(options, router_aux_coef=self.router_aux_loss_coef / steps, router_count="packed")
        return options

    def _trajectories(self, inputs: dict[str, Any]) -> tuple[list[Trajectory], int]:
        """This rank's samples as trajectories, and how many come first with trained tokens. A token at position
        p >= 1 with completion_mask 1 is trained, scored from position p − 1 (TRL's packing). With the router term, a
        sample without a trained token still runs in TRL's packed forward, so it joins the tree after the others
        with one loss token of advantage 0, whose loss and gradient are exactly 0."""
        ids, mask, old = inputs["ls_ids"][0], inputs["ls_mask"][0].bool(), inputs["ls_old"][0]
        lengths, advantages = inputs["ls_length"][0].tolist(), inputs["ls_advantage"][0].tolist()
        dtype = accumulation_dtype(hf(self._policy()).get_input_embeddings().weight.dtype)  # the log-probs'
        trained, untrained = [], []
        for i, n in enumerate(lengths):
            if n == 0:
                continue
            keep = mask[i, :n].clone()
            keep[0] = False
            where = keep.nonzero()
            if where.numel():
                first = int(where[0])
                trained.append(Trajectory(ids=ids[i, :n], loss_start=first, advantage=advantages[i],
                                          loss_mask=keep[first:], old_logprobs=old[i, first:n].to(dtype), group=i))
            elif self.aux_loss_enabled and n > 1:
                untrained.append(Trajectory(ids=ids[i, :n], loss_start=n - 1, advantage=0.0,
                                            old_logprobs=torch.zeros(1, dtype=dtype, device=old.device), group=i))
        return trained + untrained, len(trained)

    def _log_loss_metrics(self, trajectories: list[Trajectory], logprobs: list[torch.Tensor], aux: float) -> None:
        """TRL's loss metrics over all ranks from the tree's log-probs: mean ratio, the k3 KL estimate, the clipped
        shares, and the aux loss. Entropy is not logged: LongStraw's log-prob pass does not compute it."""
        device = self.accelerator.device
        sums = torch.zeros(6, dtype=torch.float64, device=device)
        seq_low, seq_high = [], []
        for t, logp in zip(trajectories, logprobs):
            keep = t.in_loss().to(logp.device)
            log_ratio = (logp[keep] - t.old_logprobs[keep].to(logp)).double()  # type: ignore[index]
            ratio = log_ratio.exp()
            low = (ratio < 1 - self.epsilon_low) & (t.advantage < 0)
            high = (ratio > 1 + self.epsilon_high) & (t.advantage > 0)
            sums += torch.stack([ratio.sum(), (ratio - 1 - log_ratio).sum(), low.sum(), high.sum(),
                                 (low | high).sum(), torch.tensor(ratio.numel())]).to(sums)
            seq_low.append(float(low.double().mean()))
            seq_high.append(float(high.double().mean()))
        ratio, kl, low, high, region, count = self.accelerator.reduce(sums, reduction="sum").tolist()
        for key, value in (("ratio", ratio), ("kl", kl), ("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high),
                           ("clip_ratio/region_mean", region)):
            self._metrics["train"][key].append(value / count if count else float("nan"))
        edges = torch.tensor([min(seq_low, default=float("nan")), max(seq_high, default=float("nan"))], device=device)
        gathered = self.accelerator.gather(edges[None]).reshape(-1, 2)
        self._metrics["train"]["clip_ratio/low_min"].append(float(gathered[:, 0].nan_to_num(float("inf")).min()))
        self._metrics["train"]["clip_ratio/high_max"].append(float(gathered[:, 1].nan_to_num(float("-inf")).max()))
        if self.aux_loss_enabled:
            value = torch.tensor([aux], device=device).nan_to_num(0.0)
            self._metrics["train"]["aux_loss"].append(float(self.accelerator.reduce(value, reduction="sum")) /
                                                      self.accelerator.num_processes)

    def _account(self, inputs: dict[str, Any]) -> None:
        """TRL's per-step accounting, flushed at each optimizer step (`_log_step_metrics`)."""
        forwarded, mean_len = float(inputs["global_n_forward_tokens"][0]), float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += forwarded
        self._step_trained_tokens += float(inputs["global_n_tokens"][0])
        self._step_seq_len_weighted += mean_len * forwarded
        self._step_samples += forwarded / mean_len
        self._step_forward_s += self._last_forward_time_s

"""TRL's `GRPOTrainer` with LongStraw's backward: the one-line change for TRL users.

    from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer
    trainer = LongStrawGRPOTrainer(model, reward_funcs=..., args=LongStrawGRPOConfig(...), train_dataset=...)

Everything TRL does around the loss stays TRL's (config, data, generation, rewards and advantages, reference and old
log-probs, logging, callbacks, optimizer, scheduler, checkpoints, evaluation's loss). Two methods change:

* `_prepare_inputs` deals whole groups to the micro-batches (`_deal_groups`) where TRL shuffles rows, so that each
  prompt's G completions stay together.
* `compute_loss` runs `backward_tree` once over one prefix tree of its micro-batch's rows, with the options that make
  LongStraw's loss TRL's (`_loss_options`; docs/trl.md has the table), and returns the loss value as a tensor without
  a graph: the backward Trainer then runs on it reaches no parameter.

What the loss cannot reproduce is refused with the reason when the trainer is built, before any parameter is
touched (`trl_config.config_refusals`, `_model_refusals`)."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import torch

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"longstraw.integrations.trl needs TRL: pip install 'longstraw[trl]' ({err})") from err

from longstraw.api.tree import backward_tree
from longstraw.distributed.context import check_supported as check_context_supported
from longstraw.distributed.context import context_blocks
from longstraw.distributed.fsdp import check_same_work, sharded_compute
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.options import BackwardOptions
from longstraw.engine.tree.build import Trajectory, Tree, build_tree
from longstraw.integrations.deepspeed import gathered as deepspeed_gathered
from longstraw.integrations.deepspeed import hand_over, plain_leaves
from longstraw.integrations.trl_config import (
    LongStrawGRPOConfig,
    backward_options,
    config_refusals,
    fsdp_refusals,
    loss_kind,
    loss_parameters,
    option,
    refuse,
    steps_per_generation,
    work_of,
)
from longstraw.integrations.trl_shared import autocast_of, average_gradients, model_refusals, policy_of, router_refusals

__all__ = ["LongStrawGRPOConfig", "LongStrawGRPOTrainer"]

class LongStrawGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose loss and backward are `longstraw.backward_tree` over each micro-batch's prefix tree.
    Takes GRPOTrainer's arguments; `args` may be a `LongStrawGRPOConfig` or a plain `GRPOConfig` (its defaults). Raises
    ValueError, listing every reason, for what it cannot train."""

    # For mypy: Trainer types `args` as TrainingArguments and leaves `model`, `num_generations` (which GRPOConfig
    # requires) and `_buffered_inputs` (None at first) unannotated.
    args: GRPOConfig
    model: torch.nn.Module
    num_generations: int
    _buffered_inputs: list[dict[str, Any]] | None  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        named = bound.arguments
        if named.get("args") is None:
            model = named["model"]
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            named["args"] = LongStrawGRPOConfig(f"{name.rstrip('/').split('/')[-1]}-GRPO")
        refuse(config_refusals(named["args"]))
        super().__init__(*bound.args[1:], **bound.kwargs)
        refuse(self._model_refusals())
        self._longstraw = backward_options(self.args)
        cp = option(self.args, "cp")
        self._context = context_blocks(cp) if cp > 1 else None

    def _policy(self) -> torch.nn.Module:
        return policy_of(self.accelerator, self.model)

    def _model_refusals(self) -> list[str]:
        out = []
        kind = str(self.accelerator.distributed_type.value)
        cp, world = option(self.args, "cp"), self.accelerator.num_processes
        if kind == "FSDP":
            out.extend(fsdp_refusals(self.accelerator.state.fsdp_plugin))
        elif kind in ("MEGATRON_LM", "XLA"):
            out.append(f"accelerate's {kind}: LongStraw runs the model's layers itself, outside the wrapper that "
                       "distributes them; use DDP (accelerate's MULTI_GPU / MULTI_CPU) or FSDP2")
        if self._is_vlm:
            out.append("a multimodal processor: LongStraw replays text-only completions")
        out.extend(router_refusals(self, bool(option(self.args, "keep_prompt_graph"))))
        if self.aux_loss_enabled and cp > 1:
            out.append("a Mixture-of-Experts load-balancing loss (router_aux_loss_coef != 0) with longstraw_cp > 1: "
                       "LongStraw's router term is not supported with context parallelism; set longstraw_cp=1 or "
                       "router_aux_loss_coef=0.0")
        policy = self._policy()
        out.extend(model_refusals(policy, backward_options(self.args), bool(self.args.bf16)))
        if cp > 1 and world % cp:
            out.append(f"longstraw_cp={cp} needs a number of processes that is a multiple of {cp}, got {world}: launch "
                       f"{cp * max(1, world // cp)} processes, or set longstraw_cp=1")
        if cp > 1:
            try:
                check_context_supported(policy)
            except ValueError as err:
                out.append(f"longstraw_cp={cp}: {err}")
        if option(self.args, "fsdp_gather") == "layer" and (kind != "FSDP" or cp != world):
            out.append(f"longstraw_fsdp_gather='layer' gathers FSDP2's layers through its hooks, whose collectives "
                       f"need every process to run the same forwards and backwards: use it under FSDP2 with "
                       f"longstraw_cp equal to the number of processes ({world}), or set longstraw_fsdp_gather='all' "
                       f"(here: {kind if kind != 'NO' else 'no FSDP'}, longstraw_cp={cp})")
        return out

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's buffering of a generation batch over its micro-steps, with whole groups per micro-batch."""
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)  # evaluation: TRL's own path and loss
        generate_every = steps_per_generation(self.args) * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            # TRL shuffles the batch's rows here with torch.randperm; whole groups are dealt instead, but the same
            # draw is made, so that the global random stream, hence the next generation's samples, stay TRL's.
            torch.randperm(len(next(v for v in batch.values() if v is not None)))
            self._buffered_inputs = self._deal_groups(batch)
        return self._buffered_inputs[self._step % steps_per_generation(self.args)]

    def _deal_groups(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Split a generation batch (each prompt's G completions consecutive, as TRL's advantage code also assumes)
        into `steps_per_generation` micro-batches of whole groups: each of the k optimizer steps it feeds gets a
        contiguous 1/k of the groups, spread as evenly as whole groups allow (some micro-batches may be empty)."""
        g, rows = self.num_generations, batch["completion_ids"].size(0)
        prompts = [ids[mask.bool()] for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
        for first in range(0, rows, g):
            if any(not torch.equal(prompts[first], prompts[i]) for i in range(first + 1, first + g)):
                raise ValueError(f"rows {first}..{first + g - 1} of the generation batch do not share one prompt: "
                                 "LongStraw needs each prompt's num_generations completions consecutive (TRL's "
                                 "sampler order); a custom sampler or rollout_func changed it")
        groups = list(range(rows // g))
        spg = steps_per_generation(self.args)
        steps = max(spg // self.args.gradient_accumulation_steps, 1)  # optimizer steps this batch feeds, per pass
        per_step, slices_per_step = len(groups) // steps, spg // steps
        out = []
        for step in range(steps):
            mine = groups[step * per_step:(step + 1) * per_step]
            base, extra = divmod(len(mine), slices_per_step)
            start = 0
            for k in range(slices_per_step):
                part = mine[start:start + base + (k < extra)]
                start += len(part)
                out.append(_rows(batch, [r for grp in part for r in range(grp * g, (grp + 1) * g)], rows))
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        batches = [inputs] if self._context is None else self._context_batches(inputs)
        if self.is_deepspeed_enabled:
            return self._deepspeed_loss(batches)
        # FSDP2 (`sharded_compute`): every process enters, whatever its number of groups; with gather='layer' every
        # process runs the same groups (the context-parallel block is the whole world: `_model_refusals`), checked.
        gather = option(self.args, "fsdp_gather")
        if gather == "layer":
            check_same_work(work_of(batches))
        with sharded_compute(self.accelerator.unwrap_model(self.model), gather=gather):
            total = self._backward_batches(batches)
        if self.accelerator.num_processes > 1 and self.accelerator.sync_gradients and not self.is_fsdp_enabled:
            # the last micro-batch of an optimizer step: what DDP's reducer would do
            average_gradients(self._policy(), self.accelerator.num_processes)
        return torch.tensor(total, device=self.accelerator.device, requires_grad=True)

    def _backward_batches(self, batches: list[dict[str, Any]]) -> float:
        """Every row of `batches` backpropagated, one prefix tree per batch; returns the sum of their losses (with the
        MoE term's value times its coefficient, as TRL; `aux_loss` metric gathered even for a batch without rows)."""
        total = 0.0
        for batch in batches:
            built = self._tree_of(batch)
            aux = float("nan")
            if built is not None:
                tree, options = built
                with autocast_of(bool(self.args.bf16), self._policy()):
                    result = backward_tree(self._policy(), tree, options)
                total += result.loss
                for key in ("tokens_encoded", "tokens_flattened", "tree_nodes", "tree_depth"):
                    self._metrics["train"][f"longstraw/{key}"].append(float(result.stats[key]))
                if options.router_aux_coef:
                    aux = float(result.stats["router_aux_loss"])
                    total += aux * options.router_aux_coef
            if self.aux_loss_enabled:
                gathered = self.accelerator.gather_for_metrics(torch.tensor([aux], device=self.accelerator.device))
                self._metrics["train"]["aux_loss"].append(gathered.nanmean().item())
        return total

    def _tree_of(self, inputs: dict[str, Any]) -> tuple[Tree, BackwardOptions] | None:
        """The micro-batch's kept rows (`_kept_rows`) as one prefix tree, each row its own group (TRL's normalisers
        are the micro-batch's: `_loss_options` of a group of one row), with backward_tree's options; the MoE term
        counts each tree token once per row that holds it, as TRL's forward does. None: no row to train."""
        g, rows = self.num_generations, inputs["completion_ids"].size(0)
        kept = [i for first in range(0, rows, g) for i in self._kept_rows(inputs, range(first, first + g))]
        if not kept:
            return None
        options = replace(self._longstraw, temperature=self.temperature,
                          loss=LossConfig(loss_kind(self.args), **self._loss_options(1, inputs)))
        if self.aux_loss_enabled:
            # TRL adds router_aux_loss_coef * aux_loss / gradient_accumulation_steps to each micro-batch's loss
            options = replace(options,
                              router_aux_coef=self.router_aux_loss_coef / self.current_gradient_accumulation_steps)
        if self._context is not None:  # every process of a context-parallel block runs the tree; scaled by 1/C
            options = replace(options, context_shards=self._context,
                              loss=replace(options.loss, loss_scale=options.loss.loss_scale / self._context.size))
        prompt_ids, prompt_mask, tool_mask = inputs["prompt_ids"], inputs["prompt_mask"], inputs.get("tool_mask")
        lengths = inputs["completion_mask"].sum(1)
        old, ref = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        trajectories = []
        for i in kept:
            prompt, n = prompt_ids[i][prompt_mask[i].bool()], int(lengths[i])
            trajectories.append(Trajectory(
                ids=torch.cat([prompt, inputs["completion_ids"][i, :n]]), loss_start=prompt.numel(),
                advantage=float(inputs["advantages"][i]),
                loss_mask=None if tool_mask is None else tool_mask[i, :n].bool(),
                old_logprobs=None if old is None else old[i, :n], ref_logprobs=None if ref is None else ref[i, :n],
                group=i))
        return build_tree(trajectories, option(self.args, "tree_min_shared")), options

    def _deepspeed_loss(self, batches: list[dict[str, Any]]) -> torch.Tensor:
        """DeepSpeed ZeRO (integrations/deepspeed.py): the micro-batch's gradient, returned inside the loss that
        Trainer's `engine.backward` hands to DeepSpeed (which Trainer runs without its 1/gradient_accumulation_steps
        scaling; LongStraw's losses are scaled for the accumulation already)."""
        engine, policy = self.model_wrapped, self._policy()
        with deepspeed_gathered(engine):
            params = [p for p in policy.parameters() if p.requires_grad]
            with plain_leaves(policy) as leaves:
                total = self._backward_batches(batches)
            # a parameter without a gradient (or a process without a row) hands over zeros: every process then
            # takes part in each of DeepSpeed's reductions
            grads = [torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
                     for leaf in (leaves[id(p)] for p in params)]
            return hand_over(total, params, grads, self.accelerator.device)

    def _context_batches(self, inputs: dict[str, Any]) -> list[dict[str, Any]]:
        """Context parallelism: the micro-batches of every process of this block, in rank order, each backpropagated
        by every process of the block with 1/C of each node's state and 1/C of its loss (`_tree_of`), so that the C
        copies of the block's gradient that the data-parallel reduction averages add up to TRL's."""
        assert self._context is not None
        mine = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        gathered: list[Any] = [None] * self._context.size
        torch.distributed.all_gather_object(gathered, mine, group=self._context.group)
        device = self.accelerator.device
        return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()} for batch in gathered]

    def _kept_rows(self, inputs: dict[str, Any], rows: range) -> list[int]:
        """The rows of one prompt's group that are in the loss, checked. TRL's `tool_mask` (a rollout_func's
        `env_mask`) becomes the loss masks. Completions with no token in the loss add nothing to TRL's loss either and
        are left out (they still count in its averages, `_loss_options`); with the MoE load-balancing loss, one that
        has tokens in TRL's forward (all tool-masked) is refused: its tokens' router term would be missing."""
        completion_mask, tool_mask = inputs["completion_mask"], inputs.get("tool_mask")
        lengths = {i: int(completion_mask[i].sum()) for i in rows}
        keep = [i for i in rows if lengths[i] > 0 and (tool_mask is None or bool(tool_mask[i, :lengths[i]].any()))]
        if self.aux_loss_enabled and (unrouted := [i for i in rows if i not in keep]):
            raise ValueError(f"completions {unrouted} have no token in the loss (all tool-masked, truncated by "
                             "mask_truncated_completions, or empty) but their prompt and tokens run in TRL's "
                             "forward, so they count in the MoE load-balancing loss, which LongStraw's tree of the "
                             "loss's rows would leave out; set router_aux_loss_coef=0.0")
        for i in keep:
            if not bool(completion_mask[i, :lengths[i]].all()):
                raise ValueError(f"completion {i}'s attention mask is not a prefix of ones: LongStraw runs each "
                                 "completion as one sequence after its prompt (mask tokens out of the loss with a "
                                 "tool mask / env_mask instead)")
        if keep and inputs["advantages"].dim() != 1:
            raise ValueError("per-token advantages (B, T) are not supported: LongStraw's losses take one per "
                             "completion")
        return keep

    def _loss_options(self, kept: int, inputs: dict[str, Any]) -> dict[str, Any]:
        """The loss options that make one group's share of LongStraw's loss equal to its share of TRL's loss over
        an optimizer step of S = gradient_accumulation_steps micro-batches (docs/trl.md has the table).

        bnpo divides by the micro-batch's tokens: this micro-batch holds whole groups and TRL's holds shuffled rows,
        the same number of them (`config_refusals` requires per_device_train_batch_size to be a multiple of G), so
        the normaliser is the one TRL's shuffle would give had it kept the groups together."""
        kind = loss_kind(self.args)
        steps = self.current_gradient_accumulation_steps
        options = loss_parameters(self.args)
        if self.args.loss_type == "bnpo":
            loss_mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)  # TRL's: tool results excluded
            options["token_normalizer"] = max(float(loss_mask.sum()), 1.0) * steps
        elif kind in ("dapo", "cispo", "vespo"):
            # TRL's: the generation batch's completion tokens over all processes, per process and micro-batch
            tokens = max(float(inputs["num_items_in_batch"]), 1.0) / self.accelerator.num_processes
            options["token_normalizer"] = tokens * steps / steps_per_generation(self.args)
        else:
            options["loss_scale"] = kept / (self.args.per_device_train_batch_size * steps)
        if kind == "dr_grpo":
            options["max_tokens"] = self.max_completion_length
        return options


def _rows(batch: dict[str, Any], rows: list[int], total: int) -> dict[str, Any]:
    """The given rows of every per-row tensor of a generation batch; other entries (num_items_in_batch) as they are."""
    index = torch.tensor(rows, dtype=torch.long)
    return {key: value[index.to(value.device)]
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == total else value
            for key, value in batch.items()}

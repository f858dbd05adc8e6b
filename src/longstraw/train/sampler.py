"""What the trainer samples from the policy, scored by the task (sampling itself: `engine/sampling.py`): a step's
groups (`Sampler.step_groups`), each prompt's rollout (`rollout`; `rollout_tree` with --rollout tree) with its
rewards, advantages and, with beta > 0, the frozen reference model's log-probs, and the held-out evaluation
(`evaluate`: greedy, on prompts from a seed stream training never draws from)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from longstraw.engine.group import Group
from longstraw.engine.loss.advantages import UnnormalisableRewards, compute_advantages
from longstraw.engine.precision import accumulation_dtype
from longstraw.engine.sampling import SamplingConfig, sample_group, score_responses
from longstraw.engine.tree.build import Tree
from longstraw.engine.tree.rollout import TreeConfig, sample_tree, tree_advantages
from longstraw.train.data import RewardError, derive_seed

if TYPE_CHECKING:
    from longstraw.distributed.runtime import Parallel
    from longstraw.engine.state.prompt import PromptState
    from longstraw.tasks import Example
    from longstraw.train.config import TrainConfig
    from longstraw.train.data import TaskData
    from longstraw.train.reporting import Progress, StepLog


def group_advantages(rewards: torch.Tensor, advantage: str, loss_dtype: torch.dtype, where: str) -> torch.Tensor:
    """`compute_advantages` of one group's rewards, bounded for the loss dtype; rewards too large to normalise (their
    advantages overflow, or exceed what `backward_group` accepts in `loss_dtype`) are the reward function's scale,
    refused as a RewardError naming `where`."""
    try:
        return compute_advantages(rewards, advantage, loss_dtype=loss_dtype)
    except UnnormalisableRewards as err:
        raise RewardError(err.describe(where)) from None


@dataclass
class ScoredGroup:
    """One prompt's sampled and rewarded group, ready for the gradient passes."""

    prompt: torch.Tensor
    group: Group
    state: PromptState | None  # the captured prompt state, reusable while the weights are unchanged
    rewards: torch.Tensor
    turns: int = 0  # model turns over the group's responses (an agent task's; one per response otherwise)
    tool_calls: int = 0  # the environment's calls over the group's responses


@dataclass
class ScoredTree:
    """One prompt's sampled and rewarded tree, ready for `backward_tree`: the prefix tree of its leaves' trajectories
    (one group), the leaf rewards, and the rollout's own counts (`TreeRollout.stats`)."""

    prompt: torch.Tensor
    tree: Tree
    rewards: torch.Tensor
    rollout_stats: dict[str, int]
    turns: int = 0
    tool_calls: int = 0

    @property
    def lengths(self) -> list[int]:
        return [t.length - t.loss_start for t in self.tree.trajectories]

    @property
    def loss_masks(self) -> list[torch.Tensor]:
        return [t.in_loss() for t in self.tree.trajectories]


class Sampler:
    """Samples the policy (the `model` passed to each call) on the task of `data`; `reference`: the frozen initial
    policy (beta > 0) or None."""

    def __init__(self, cfg: TrainConfig, data: TaskData, stop_ids: tuple[int, ...], reference: torch.nn.Module | None,
                 par: Parallel) -> None:
        self.cfg, self.data, self.reference, self.par = cfg, data, reference, par
        # An agent task's responses are turns: a tool call's closing tokens hand the response to the environment.
        self.call_end = data.call_end
        self.max_turns = cfg.task.max_turns if self.call_end else 1
        r = cfg.rollout
        self.sampling = SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                       top_k=r.top_k, stop_ids=stop_ids, call_end=self.call_end,
                                       max_turns=self.max_turns)
        # An agent task's last held-out evaluation: the share of prompts whose greedy response made a tool call.
        self.eval_tool_call_rate = float("nan")
        self.loss_dtype = accumulation_dtype(getattr(torch, cfg.model.dtype))  # the dtype advantages are bounded for

    def _rewards(self, responses: list[torch.Tensor], example: Example, step: int) -> torch.Tensor:
        """The task's reward of each decoded response, (G,) float64."""
        return torch.tensor([self.data.reward(self.data.decode(r), example, f"step {step + 1}") for r in responses],
                            dtype=torch.float64)

    def step_groups(self, model: torch.nn.Module, step: int, progress: Progress,
                    log: StepLog) -> list[ScoredGroup | ScoredTree]:
        """This rank's prompts of 0-based `step` (all in one process), sampled and scored, each counted in `log`; the
        groups (trees with --rollout tree) to train on (dynamic sampling drops groups of equal rewards)."""
        examples = self.data.examples(step)
        mine = self.par.share(len(examples))  # this rank's prompts
        kept: list[ScoredGroup | ScoredTree] = []
        with self.par.compute(model, reduce=False):
            for j in mine:
                progress.update(step, "rollout", j - mine.start, len(mine))
                r: ScoredGroup | ScoredTree
                masks: list[torch.Tensor] | None
                if self.cfg.rollout.rollout == "tree":
                    r = self.rollout_tree(model, step, j, examples[j])
                    lengths, masks = r.lengths, r.loss_masks
                else:
                    r = self.rollout(model, step, j, examples[j])
                    lengths, masks = r.group.lengths, r.group.loss_masks
                drop = self.cfg.rollout.dynamic_sampling and bool((r.rewards == r.rewards[0]).all())  # no signal in it
                log.rollout(r.rewards, lengths, int(r.prompt.numel()), dropped=drop, turns=r.turns,
                            tool_calls=r.tool_calls,
                            observation_tokens=0 if masks is None else sum(int((~m).sum()) for m in masks))
                if not drop:
                    kept.append(r)
                    if isinstance(r, ScoredTree):
                        log.tree(r.tree.stats(), r.rollout_stats)
        log.rollouts_done()
        return kept

    def rollout(self, model: torch.nn.Module, step: int, j: int, example: Example) -> ScoredGroup:
        """Prompt j of 0-based `step`: captured once, G responses sampled from that state (its own seed), rewarded, with
        their advantages and, with beta > 0, the reference's log-probs (from the reference's own prompt capture)."""
        cfg, data = self.cfg, self.data
        prompt = data.encode(example)
        cp = self.par.context_shards  # None unless ranks share prompts (--cp)
        # The exact plan reuses this state and needs the recurrent state at every chunk boundary; detach does not.
        out = sample_group(model, prompt, cfg.rollout.group_size, self.sampling,
                           seed=derive_seed(cfg.run.seed, step, j, 1), chunk_size=cfg.plan.chunk_size,
                           keep_boundaries=cfg.plan.plan.needs_chunk_boundaries, context_shards=cp,
                           environment=data.environment(example))
        rewards = self._rewards(out.responses, example, step)
        advantages = group_advantages(rewards, cfg.plan.advantage, self.loss_dtype,
                                      f"step {step + 1}: rewards of group {j + 1}")
        ref = None if self.reference is None else score_responses(
            self.reference, prompt, out.responses, cfg.plan.chunk_size, cfg.plan.micro_batch, context_shards=cp)
        # loss_masks: an agent task's observation tokens are context, not the policy's actions
        group = Group(prompt, out.responses, advantages, old_logprobs=out.logprobs, ref_logprobs=ref,
                      loss_masks=out.loss_masks)
        return ScoredGroup(prompt=prompt, group=group, state=out.state, rewards=rewards,
                           turns=sum(out.turns) if out.turns is not None else len(out.responses),
                           tool_calls=sum(out.tool_calls) if out.tool_calls is not None else 0)

    def rollout_tree(self, model: torch.nn.Module, step: int, j: int, example: Example) -> ScoredTree:
        """Prompt j of 0-based `step` as a tree (its own seed): trunks that fork at tool calls or every k tokens, every
        leaf rewarded, the leaves' advantages over the tree or against their siblings, and the prefix tree of the
        leaves' trajectories that `backward_tree` trains on."""
        cfg, data = self.cfg, self.data
        prompt = data.encode(example)
        r = cfg.rollout
        shape = TreeConfig(trunks=r.tree_trunks, branching=r.tree_branching, depth=r.tree_depth, leaves=r.tree_leaves,
                           trigger=r.tree_trigger, every=r.tree_every)
        out = sample_tree(model, prompt, shape, self.sampling, seed=derive_seed(cfg.run.seed, step, j, 1),
                          chunk_size=cfg.plan.chunk_size, environment=data.environment(example))
        rewards = self._rewards(out.responses, example, step)
        try:
            advantages = tree_advantages(rewards, out, cfg.rollout.tree_advantage, cfg.plan.advantage,
                                         loss_dtype=self.loss_dtype)
        except UnnormalisableRewards as err:
            raise RewardError(err.describe(f"step {step + 1}: rewards of tree {j + 1}")) from None
        ref = None if self.reference is None else score_responses(  # each leaf on its own (no gradient)
            self.reference, prompt, out.responses, cfg.plan.chunk_size, cfg.plan.micro_batch)
        return ScoredTree(prompt=prompt, tree=out.tree(advantages, ref_logprobs=ref), rewards=rewards,
                          rollout_stats=out.stats, turns=sum(out.turns), tool_calls=sum(out.tool_calls))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, when: str) -> float:
        """Mean greedy reward on held-out prompts (NaN with eval_prompts 0). It can take minutes on a CPU, so rank 0
        says what it is doing and counts the prompts (in place on a terminal)."""
        cfg, data, par = self.cfg, self.data, self.par
        if cfg.run.eval_prompts == 0:
            return float("nan")
        greedy = SamplingConfig(max_new_tokens=cfg.rollout.max_new_tokens, top_k=1, stop_ids=self.sampling.stop_ids,
                                call_end=self.call_end, max_turns=self.max_turns)
        examples = data.held_out()
        mine = examples[par.dp_rank :: par.dp_size]  # blocks of ranks split the prompts
        talk = par.is_main
        if talk:
            print(f"held-out evaluation {when}: {len(examples)} prompts, greedy ...", flush=True)
        tty = sys.stdout.isatty()
        total, calling = 0.0, 0
        with par.compute(model, reduce=False):
            for i, example in enumerate(mine):
                out = sample_group(model, data.encode(example), 1, greedy, chunk_size=cfg.plan.chunk_size,
                                   context_shards=par.context_shards, environment=data.environment(example))
                total += data.reward(data.decode(out.responses[0]), example, "held-out evaluation")
                calling += int(bool(out.tool_calls and out.tool_calls[0]))
                if talk and tty:
                    print(f"\r  prompt {i + 1}/{len(mine)}   ", end="", flush=True)
        if talk and tty:
            print("\r", end="", flush=True)
        if self.call_end:
            self.eval_tool_call_rate = par.sum(calling) / par.block_size / len(examples)
        return par.sum(total) / par.block_size / len(examples)  # a block's ranks all add the same

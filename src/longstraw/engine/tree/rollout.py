"""Tree rollouts: sampling that branches, every fork continuing its parent's state in place (docs/trees.md).

From one capture of the prompt, `trunks` sequences decode as one batch in `sampling.Decoder` (a group is a tree of
depth 1); this module gives it the fork rule (`TreeConfig.forks`). A live sequence forks into `branching`
continuations at a trigger: the end of a tool call's observation (`trigger="tool_call"`: the children start with the
model's next action, as Tree-GRPO's nodes are whole agent steps), or every `every` tokens of a segment
(`trigger="tokens"`). A path holds at most `depth` segments (the trunk is the first), and a fork is granted only
while the tree's leaves stay within `leaves` (each fork adds branching − 1); otherwise the sequence continues.

Sharing. The children of a node decode as one batch over one `PromptState` (batch 1, never expanded or copied): the
prompt's chunks (the capture's own tensors) plus one chunk per ancestor segment, a view of the row of its group's
`ResponseState` that decoded it (`ResponseState.continued`: K/V or MLA latents and DSA indexer keys of its
positions, its conv window and recurrent state at its end). A fork copies nothing; the cost is that a group's
response buffers stay allocated while a descendant decodes (groups run depth first: one root-to-leaf path's).

Positions follow `tree.build`'s convention: a node's state holds its tokens but the last, and its children start by
feeding that last token, as the trunks start by feeding the prompt's last token. Log-probs are the policy's own, as
`sample_group` records them (`old_logprobs`); observation tokens are in the responses with loss_mask False.

Advantages (`tree_advantages`): ``grpo`` compares every leaf of the prompt's tree (`compute_advantages` over the leaf
rewards: the tree is one GRPO group); ``siblings`` compares a leaf with the leaves below its parent node:
A_i = r_i − mean{r_j : leaf j under parent(i)} (a trunk that never forked: its parent is the prompt, so every leaf).
That is the intra-tree comparison of Tree-GRPO (Ji et al., "Tree Search for LLM Agent Reinforcement Learning",
arXiv 2509.21240): leaves that share a prefix differ only after their fork, so their reward difference credits the
steps after it, a step-level signal from an outcome reward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.choices import int_at_least
from longstraw.engine.environment import Environment
from longstraw.engine.loss.advantages import compute_advantages
from longstraw.engine.sampling import Decoder, RolloutNode, SamplingConfig, check_inputs
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.prompt import PromptState
from longstraw.engine.state.response import ResponseState
from longstraw.engine.tree.build import Trajectory, Tree, build_tree

TRIGGERS = ("tool_call", "tokens")
TREE_ADVANTAGES = ("grpo", "siblings")


@dataclass(frozen=True)
class TreeConfig:
    """The shape of a tree rollout. trunks: sequences sampled from the prompt (N). branching: continuations per
    fork (B >= 2). depth: segments on a root-to-leaf path at most (1: no fork). leaves: the leaf budget (>= trunks).
    trigger: ``tool_call`` (fork once a call's observation is fed) or ``tokens`` (every `every` tokens of a segment)."""

    trunks: int = 2
    branching: int = 2
    depth: int = 2
    leaves: int = 8
    trigger: str = "tool_call"
    every: int = 0

    def __post_init__(self) -> None:
        for name, low in (("trunks", 1), ("branching", 2), ("depth", 1), ("leaves", 1)):
            int_at_least(f"tree {name}", getattr(self, name), low)
        if self.leaves < self.trunks:
            raise ValueError(f"the leaf budget ({self.leaves}) is below the trunks ({self.trunks}): every trunk is a "
                             "leaf until it forks; raise the leaves or lower the trunks")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"tree trigger must be one of {', '.join(TRIGGERS)}, got {self.trigger!r}")
        if self.trigger == "tokens":
            int_at_least("every", self.every, 1, " (trigger 'tokens' forks every `every` tokens)")
        if self.trigger == "tool_call" and self.every:
            raise ValueError(f"every={self.every} applies to trigger 'tokens'; trigger 'tool_call' forks at tool "
                             "calls: drop every or set trigger='tokens'")

    def forks(self, depth: int, segment: int, observed: bool, leaves: int) -> int:
        """The children a live sequence at `depth` forks into now (`sampling.ForkRule`; 0: it continues): at its
        trigger (an observation's last token fed, or `every` tokens of its segment), below the depth and within the
        leaf budget with the tree's `leaves` so far."""
        hit = observed if self.trigger == "tool_call" else segment % self.every == 0
        return self.branching if hit and depth < self.depth and leaves + self.branching - 1 <= self.leaves else 0


@dataclass
class TreeRollout:
    """A sampled tree. nodes: every segment (parents before children); leaves: the leaf nodes' indices in
    trajectory order. responses / logprobs / loss_masks (R_i,): each leaf's whole response (its path's segments),
    its old log-probs and its loss mask (False on observation tokens). state: the prompt's capture (prompt[:-1]).
    stats: forks, decoding groups, positions the decoder ran (a group's finished rows run until the group ends),
    tokens sampled or fed (each node's once) and tokens in the leaves' responses (each shared token once per leaf).
    With keep_states: states[n] / buffers[n] as `Decoder` keeps them (for inspection: they hold memory)."""

    prompt: torch.Tensor
    nodes: list[RolloutNode]
    leaves: list[int]
    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    state: PromptState
    stats: dict[str, int]
    states: dict[int, PromptState] = field(default_factory=dict)
    buffers: dict[int, ResponseState] = field(default_factory=dict)

    @property
    def turns(self) -> list[int]:
        return [self.nodes[n].turns for n in self.leaves]

    @property
    def tool_calls(self) -> list[int]:
        return [self.nodes[n].tool_calls for n in self.leaves]

    def path(self, leaf: int) -> list[int]:
        """Node indices from the trunk down to `leaf`."""
        out = [leaf]
        while (parent := self.nodes[out[-1]].parent) is not None:
            out.append(parent)
        return out[::-1]

    def trajectories(self, advantages: torch.Tensor | list[float], group: int = 0,
                     ref_logprobs: list[torch.Tensor] | None = None) -> list[Trajectory]:
        """One `Trajectory` per leaf: ids = prompt + response, loss from the response's first token, observation
        tokens masked, old log-probs; `advantages` (L,) one per leaf (`tree_advantages`), `group` the normalisers'
        group, ref_logprobs (R_i,) per leaf if any."""
        adv = torch.as_tensor(advantages, dtype=torch.float64).flatten()
        if adv.numel() != len(self.leaves):
            raise ValueError(f"advantages has {adv.numel()} values for {len(self.leaves)} leaves: one per leaf")
        if ref_logprobs is not None and len(ref_logprobs) != len(self.leaves):
            raise ValueError(f"ref_logprobs has {len(ref_logprobs)} tensors for {len(self.leaves)} leaves")
        prompt = self.prompt.cpu()
        return [Trajectory(ids=torch.cat([prompt, r.cpu()]), loss_start=prompt.numel(), advantage=float(a),
                           loss_mask=m.cpu(), old_logprobs=lp.cpu(),
                           ref_logprobs=None if ref_logprobs is None else ref_logprobs[i].cpu(), group=group)
                for i, (r, m, lp, a) in enumerate(zip(self.responses, self.loss_masks, self.logprobs, adv))]

    def tree(self, advantages: torch.Tensor | list[float], group: int = 0,
             ref_logprobs: list[torch.Tensor] | None = None) -> Tree:
        """`build_tree` of `trajectories(...)`: the trie `backward_tree` trains on."""
        return build_tree(self.trajectories(advantages, group, ref_logprobs))


def tree_advantages(rewards: torch.Tensor, rollout: TreeRollout, mode: str = "grpo", estimator: str = "grpo",
                    loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Advantages (L,) of the leaves from their rewards (L,) (module docstring). mode ``grpo``: `compute_advantages`
    with `estimator` over every leaf; ``siblings``: each leaf's reward minus the mean of the leaves below its parent."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if rewards.numel() != len(rollout.leaves):
        raise ValueError(f"rewards has {rewards.numel()} values for {len(rollout.leaves)} leaves: one per leaf")
    if mode == "grpo":
        return compute_advantages(rewards, estimator, loss_dtype=loss_dtype)
    if mode != "siblings":
        raise ValueError(f"tree advantage must be one of {', '.join(TREE_ADVANTAGES)}, got {mode!r}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf: fix the reward function before computing advantages")
    position = {leaf: i for i, leaf in enumerate(rollout.leaves)}
    below: dict[int | None, list[int]] = {}  # node (None: the prompt) -> the leaves under it
    for leaf in rollout.leaves:
        below.setdefault(None, []).append(position[leaf])
        for node in rollout.path(leaf):
            below.setdefault(node, []).append(position[leaf])
    out = torch.empty_like(rewards)
    for leaf in rollout.leaves:
        peers = below[rollout.nodes[leaf].parent]
        out[position[leaf]] = rewards[position[leaf]] - rewards[peers].mean()
    return out


@torch.no_grad()
def sample_tree(model: torch.nn.Module, prompt: torch.Tensor, tree: TreeConfig, sampling: SamplingConfig, seed: int = 0,
                chunk_size: int = 2048, state: PromptState | None = None, environment: Environment | None = None,
                keep_states: bool = False) -> TreeRollout:
    """Sample a tree of responses to `prompt` (P,) from one prompt capture (module docstring): `sampling.Decoder`
    with the tree's fork rule. Deterministic for a seed. sampling: as `sample_group` (max_new_tokens bounds every
    root-to-leaf response, observations included; max_turns every path's model turns). environment: as
    `sample_group`'s; trigger ``tool_call`` needs one."""
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__}")
    if state is not None and state.context_shards is not None:
        raise ValueError("tree rollouts do not run under context parallelism: capture the prompt without it")
    if tree.trigger == "tool_call" and tree.depth > 1 and environment is None:
        raise ValueError("trigger 'tool_call' forks at tool calls, which need an environment (and "
                         "SamplingConfig.call_end); without one use trigger='tokens' with every=k")
    prompt = check_inputs(model, prompt, state, "sample_tree", sampling, environment)
    if state is None:
        state = capture_prompt(model, prompt[:-1], chunk_size, keep_boundaries=False)
    run = Decoder(model, sampling, environment, seed, tree.forks, keep_states)
    run.run(state, prompt, tree.trunks)
    rollout = TreeRollout(prompt=prompt, nodes=run.nodes, leaves=[i for i, n in enumerate(run.nodes) if not n.children],
                          responses=[], logprobs=[], loss_masks=[], state=state, stats={}, states=run.states,
                          buffers=run.buffers)
    for leaf in rollout.leaves:
        path = [run.nodes[n] for n in rollout.path(leaf)]
        rollout.responses.append(torch.cat([n.tokens for n in path]))
        rollout.logprobs.append(torch.cat([n.logprobs for n in path]))
        rollout.loss_masks.append(~torch.cat([n.observed for n in path]))
    rollout.stats = {"rollout_forks": run.forks, "rollout_groups": run.groups, "rollout_positions_run": run.positions,
                     "rollout_tokens_sampled": sum(n.tokens.numel() for n in run.nodes),
                     "rollout_tokens_flattened": sum(r.numel() for r in rollout.responses)}
    return rollout

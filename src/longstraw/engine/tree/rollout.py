"""Tree rollouts: sampling that branches, every fork continuing its parent's state in place (docs/trees.md).

From one capture of the prompt, `trunks` sequences decode as one batch (as `sampling.sample_group` does). A live
sequence forks into `branching` continuations at a trigger: the end of a tool call's observation (`trigger=
"tool_call"`: the environment's answer is fed into the parent, and the children start with the model's next action,
as Tree-GRPO's nodes are whole agent steps), or every `every` tokens of a segment (`trigger="tokens"`). A path holds
at most `depth` segments (the trunk is the first), and a fork is granted only while the tree's leaves stay within
`leaves` (each fork adds branching − 1). A sequence that is not allowed to fork simply continues.

Sharing. The B children of a node decode as one batch over one `PromptState` (batch 1, read by every child, never
expanded or copied): the prompt's chunks (the very tensors of the capture: the state is a new list over them) plus one
chunk per ancestor segment. A segment's chunk is a view of the row of its group's `ResponseState` that decoded it —
K/V (or MLA latents) and DSA indexer keys of its positions, its conv window and recurrent state at its end — so a
fork copies nothing: the kernels read the parent's generated K/V where the parent wrote them. The cost is that a
group's response buffers stay allocated while a descendant decodes; groups run depth first, so those are the groups
on one root-to-leaf path.

Positions follow `tree.build`'s convention: a node's state holds its tokens but the last, and its children start by
feeding that last token, as the trunks start by feeding the prompt's last token.

Log-probs are the policy's own (temperature 1, no truncation), as `sample_group` records them: they are what a
training step recomputes (`old_logprobs`). Observation tokens are in the responses with loss_mask False.

Advantages (`tree_advantages`): ``grpo`` compares every leaf of the prompt's tree (`compute_advantages` over the leaf
rewards: the tree is one GRPO group); ``siblings`` compares a leaf with the leaves below its parent node:
A_i = r_i − mean{r_j : leaf j under parent(i)} (a trunk that never forked: its parent is the prompt, so every leaf).
That is the intra-tree comparison of Tree-GRPO (Ji et al., "Tree Search for LLM Agent Reinforcement Learning",
arXiv 2509.21240): leaves that share a prefix differ only after their fork, so their reward difference credits the
steps after it, a step-level signal from an outcome reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.engine.hf.segment import run_segment
from longstraw.engine.logprobs import accumulated_logits
from longstraw.engine.loss.advantages import compute_advantages
from longstraw.engine.sampling import (
    Environment,
    SamplingConfig,
    _check_environment,
    _check_inputs,
    _filter_logits,
    _name,
    _observation_ids,
)
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.prompt import PARTS, PromptState
from longstraw.engine.state.response import ResponseState
from longstraw.engine.tree.build import Trajectory, Tree, build_tree
from longstraw.models.architecture import hf, logit_scale, logit_softcap

TRIGGERS = ("tool_call", "tokens")
TREE_ADVANTAGES = ("grpo", "siblings")


@dataclass(frozen=True)
class TreeConfig:
    """The shape of a tree rollout. trunks: sequences sampled from the prompt (N). branching: continuations per
    fork (B >= 2). depth: segments on a root-to-leaf path at most (1: no fork). leaves: the leaf budget (>= trunks).
    trigger: ``tool_call`` (fork once a call's observation is fed) or ``tokens`` (every `every` tokens of a
    segment)."""

    trunks: int = 2
    branching: int = 2
    depth: int = 2
    leaves: int = 8
    trigger: str = "tool_call"
    every: int = 0

    def __post_init__(self) -> None:
        for name, low in (("trunks", 1), ("branching", 2), ("depth", 1), ("leaves", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"tree {name} must be an integer >= {low}, got {value!r}")
        if self.leaves < self.trunks:
            raise ValueError(f"the leaf budget ({self.leaves}) is below the trunks ({self.trunks}): every trunk is a "
                             "leaf until it forks; raise the leaves or lower the trunks")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"tree trigger must be one of {', '.join(TRIGGERS)}, got {self.trigger!r}")
        if self.trigger == "tokens" and (isinstance(self.every, bool) or not isinstance(self.every, int)
                                         or self.every < 1):
            raise ValueError(f"trigger 'tokens' forks every `every` tokens: every must be an integer >= 1, got "
                             f"{self.every!r}")
        if self.trigger == "tool_call" and self.every:
            raise ValueError(f"every={self.every} applies to trigger 'tokens'; trigger 'tool_call' forks at tool "
                             "calls: drop every or set trigger='tokens'")


@dataclass
class RolloutNode:
    """One segment of the sampled tree. parent: the node it continues (None: a trunk, continuing the prompt).
    tokens / logprobs / observed (n,): its ids, their policy log-probs and whether each was an observation token.
    children: the nodes that continue it (empty: a leaf). ended: why it ended ("fork", "stop", "call", "budget":
    the token budget, "turns": a call past max_turns, "episode": the environment ended it)."""

    parent: int | None
    depth: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    observed: torch.Tensor
    ended: str
    children: list[int] = field(default_factory=list)
    turns: int = 1  # model turns along the path up to and including this node
    tool_calls: int = 0  # the environment's calls along the path


@dataclass
class TreeRollout:
    """A sampled tree. nodes: every segment (parents before children); leaves: the leaf nodes' indices in
    trajectory order. responses / logprobs / loss_masks (R_i,): each leaf's whole response (its path's segments),
    its old log-probs and its loss mask (False on observation tokens). state: the prompt's capture (prompt[:-1]).
    stats: forks, decoding groups (batches of siblings), positions the decoder ran (a group's finished rows run
    until the group ends), tokens sampled or fed (each node's once) and tokens in the leaves' responses (every
    shared token counted once per leaf: what sampling every leaf on its own would decode).
    With keep_states: states[n] is the `PromptState` node n's children decode over, buffers[n] the `ResponseState`
    its own group decoded into (for inspection: they hold memory)."""

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
    with `estimator` over every leaf; ``siblings``: each leaf's reward minus the mean over the leaves below its
    parent node (Tree-GRPO's intra-tree comparison)."""
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


@dataclass
class _Sequence:
    """A sequence a group decodes: its node, what its path already holds (response ids, turns, calls) and what it
    has produced in this group."""

    node: int
    before: list[int]  # the path's response ids before this segment
    before_observed: list[bool]  # and which of them were observation tokens
    turns: int
    calls: int
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    observed: list[bool] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # observation ids still to feed
    ended: str = ""


@dataclass
class _Group:
    """Siblings decoding as one batch: over `state` (positions [0, start)), first feeding `first` at `start`."""

    state: PromptState
    start: int
    first: int
    depth: int
    seqs: list[_Sequence]


def branch_state(state: PromptState, buffer: ResponseState, row: int, start: int, end: int) -> PromptState:
    """`state` (positions [0, start)) continued by row `row` of `buffer` over [start, end): a new list of the same
    chunks plus one whose parts are views of the buffer (K/V, latents, indexer keys of those positions; the conv
    window and recurrent state the row holds now, i.e. after position end − 1). Nothing is copied."""
    if state.context_shards is not None:
        raise ValueError("tree rollouts do not run under context parallelism")
    n = end - start
    if buffer.length != n:
        raise RuntimeError(f"the group's buffer holds {buffer.length} positions, the fork needs {n}")
    out = state.branch()  # new lists over the same tensors, read chunk by chunk past the prompt's slab
    for layer in range(state.num_layers):
        parts: dict[str, torch.Tensor | None] = dict.fromkeys(PARTS)
        if layer in buffer.kv:
            keys, values = buffer.kv[layer]
            parts["key"], parts["value"] = keys[row : row + 1, :, :n], values[row : row + 1, :, :n]
        if layer in buffer.index:
            parts["index"] = buffer.index[layer][row : row + 1, :n]
        for part in ("conv", "recurrent"):
            if buffer.has(part, layer):
                parts[part] = buffer.get(part, layer)[row : row + 1]
        for name in PARTS:
            out.parts[name][layer].append(parts[name])
    out.bounds.append((start, end))
    return out


@torch.no_grad()
def sample_tree(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    tree: TreeConfig,
    sampling: SamplingConfig,
    seed: int = 0,
    chunk_size: int = 2048,
    state: PromptState | None = None,
    environment: Environment | None = None,
    keep_states: bool = False,
) -> TreeRollout:
    """Sample a tree of responses to `prompt` (P,) from one prompt capture (module docstring). Deterministic for a
    seed. sampling: as `sample_group` (max_new_tokens bounds every root-to-leaf response, observations included;
    max_turns every path's model turns). environment: as `sample_group`'s; trigger ``tool_call`` needs one."""
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__}")
    _check_inputs(model, prompt, state, "sample_tree")
    if state is not None and state.context_shards is not None:
        raise ValueError("tree rollouts do not run under context parallelism: capture the prompt without it")
    embeddings = hf(model).get_input_embeddings()
    head = hf(model).get_output_embeddings()
    vocab = min(embeddings.num_embeddings, head.weight.shape[0])
    if tree.trigger == "tool_call" and tree.depth > 1 and environment is None:
        raise ValueError("trigger 'tool_call' forks at tool calls, which need an environment (and "
                         "SamplingConfig.call_end); without one use trigger='tokens' with every=k")
    if environment is not None:
        _check_environment(environment, sampling, vocab)
    device = embeddings.weight.device
    prompt = prompt.to(device=device, dtype=torch.long)
    if state is None:
        state = capture_prompt(model, prompt[:-1], chunk_size, keep_boundaries=False)
    run = _Run(model, tree, sampling, environment, vocab, seed, keep_states)
    trunks = [_Sequence(node=run.new_node(None, 1), before=[], before_observed=[], turns=1, calls=0)
              for _ in range(tree.trunks)]
    pending = [_Group(state, prompt.numel() - 1, int(prompt[-1]), 1, trunks)]
    while pending:  # depth first: the last group made (a fork's children) runs next
        pending.extend(reversed(run.decode(pending.pop())))
    leaves = [i for i, n in enumerate(run.nodes) if not n.children]
    responses, logprobs, masks = [], [], []
    for leaf in leaves:
        path = []
        node: int | None = leaf
        while node is not None:
            path.append(run.nodes[node])
            node = run.nodes[node].parent
        path.reverse()
        responses.append(torch.cat([n.tokens for n in path]))
        logprobs.append(torch.cat([n.logprobs for n in path]))
        masks.append(~torch.cat([n.observed for n in path]))
    stats = {"rollout_forks": run.forks, "rollout_groups": run.groups, "rollout_positions_run": run.positions,
             "rollout_tokens_sampled": sum(n.tokens.numel() for n in run.nodes),
             "rollout_tokens_flattened": sum(r.numel() for r in responses)}
    return TreeRollout(prompt=prompt, nodes=run.nodes, leaves=leaves, responses=responses, logprobs=logprobs,
                       loss_masks=masks, state=state, stats=stats, states=run.states, buffers=run.buffers)


class _Run:
    """The bookkeeping of one `sample_tree`: the nodes made so far, the leaf budget, the counters."""

    def __init__(self, model: torch.nn.Module, tree: TreeConfig, sampling: SamplingConfig,
                 environment: Environment | None, vocab: int, seed: int, keep_states: bool) -> None:
        self.model, self.tree, self.sampling, self.environment = model, tree, sampling, environment
        self.vocab, self.seed, self.keep_states = vocab, seed, keep_states
        self.nodes: list[RolloutNode] = []
        self.leaf_count = tree.trunks
        self.forks = self.groups = self.positions = 0
        self.states: dict[int, PromptState] = {}
        self.buffers: dict[int, ResponseState] = {}
        head = hf(model).get_output_embeddings()
        self.weight, self.bias = head.weight, getattr(head, "bias", None)
        self.scale, self.softcap = logit_scale(model), logit_softcap(model)

    def new_node(self, parent: int | None, depth: int) -> int:
        empty = torch.empty(0)
        self.nodes.append(RolloutNode(parent=parent, depth=depth, tokens=empty.long(), logprobs=empty,
                                      observed=empty.bool(), ended=""))
        if parent is not None:
            self.nodes[parent].children.append(len(self.nodes) - 1)
        return len(self.nodes) - 1

    def _may_fork(self, depth: int, length: int) -> bool:
        """A sequence at `depth` whose path response is `length` tokens may fork now: below the depth, within the
        leaf budget, and with room for its children to sample at least one token."""
        return (depth < self.tree.depth and self.leaf_count + self.tree.branching - 1 <= self.tree.leaves
                and length < self.sampling.max_new_tokens)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of the last position, as the model's forward computes them (`sample_group`'s)."""
        logits = accumulated_logits(hidden[:, -1], self.weight, self.bias)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _ends_call(self, seq: _Sequence) -> bool:
        """Whether the sequence's last token, its model's own, ends a tool call (`sampling`'s rule)."""
        call = self.sampling.call_end
        ids = seq.before + seq.tokens
        if callable(call):
            said = call(torch.tensor(ids, dtype=torch.long))
            if not isinstance(said, bool):
                raise ValueError(f"call_end {_name(call)} returned {said!r} ({type(said).__name__}) for node "
                                 f"{seq.node}: it must return True (the response's last token ends a tool call) or "
                                 "False")
            return said
        n = len(call)
        if not n or len(ids) < n or tuple(ids[-n:]) != tuple(call):
            return False
        return not any((seq.before_observed + seq.observed)[-n:])  # the call's tokens are the model's own

    def decode(self, group: _Group) -> list[_Group]:
        """Decode one group to its end; returns the groups of the forks it made, in order."""
        cfg, b = self.sampling, len(group.seqs)
        used = len(group.seqs[0].before)  # siblings share their path
        room = cfg.max_new_tokens - used
        device = self.weight.device
        buffer = ResponseState(b, room)
        gen = torch.Generator(device=device).manual_seed((self.seed * 1_000_003 + group.seqs[0].node) % 2**63)
        self.groups += 1
        token = torch.full((b, 1), group.first, dtype=torch.long, device=device)
        children: list[_Group] = []
        for step in range(room):
            hidden = run_segment(self.model, token, group.start + step, group.state, generated=buffer)
            assert hidden is not None
            self.positions += b  # every row runs, a finished one too (its result unused)
            logits = self._logits(hidden)
            policy = torch.log_softmax(logits, dim=-1)
            probs = torch.softmax(_filter_logits(logits / cfg.temperature, cfg.top_k, cfg.top_p), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            forced = [bool(seq.pending) for seq in group.seqs]
            for i, seq in enumerate(group.seqs):
                if forced[i]:
                    nxt[i] = seq.pending.pop(0)  # an observation token replaces the sample
            ids, logps = nxt.tolist(), policy.gather(1, nxt[:, None]).squeeze(1).tolist()  # one copy per step
            for i, seq in enumerate(group.seqs):
                if seq.ended:
                    continue
                t = ids[i]
                seq.tokens.append(t)
                seq.logps.append(logps[i])
                seq.observed.append(forced[i])
                length = used + len(seq.tokens)
                if forced[i]:
                    if not seq.pending and self.tree.trigger == "tool_call" and self._may_fork(group.depth, length):
                        children.append(self._fork(group, buffer, i, step))
                elif t in cfg.stop_ids:
                    seq.ended = "stop"
                elif self.environment is not None and self._ends_call(seq):
                    self._call(seq, length)
                if (not seq.ended and not seq.pending and self.tree.trigger == "tokens"
                        and len(seq.tokens) % self.tree.every == 0 and self._may_fork(group.depth, length)):
                    children.append(self._fork(group, buffer, i, step))
                if not seq.ended and length >= cfg.max_new_tokens:
                    seq.ended = "budget"
            if all(s.ended for s in group.seqs):
                break
            token = nxt[:, None]
        for seq in group.seqs:
            node = self.nodes[seq.node]
            node.tokens = torch.tensor(seq.tokens, dtype=torch.long)
            node.logprobs = torch.tensor(seq.logps, dtype=torch.float64 if self.weight.dtype == torch.float64
                                         else torch.float32)
            node.observed = torch.tensor(seq.observed, dtype=torch.bool)
            node.ended = seq.ended or "budget"
            node.turns, node.tool_calls = seq.turns, seq.calls
            if self.keep_states:
                self.buffers[seq.node] = buffer
        return children

    def _call(self, seq: _Sequence, length: int) -> None:
        """The sequence's last token ends a tool call: the environment's observation becomes its pending ids, or
        the episode ends (past max_turns, None or empty, or no room for the observation and a reply)."""
        if seq.turns >= self.sampling.max_turns:
            seq.ended = "turns"
            return
        assert self.environment is not None  # only called with one
        ids = torch.tensor(seq.before + seq.tokens, dtype=torch.long)
        observation = _observation_ids(self.environment(seq.node, ids), self.environment, seq.node, seq.turns,
                                       self.vocab)
        seq.calls += 1
        if not observation or len(observation) >= self.sampling.max_new_tokens - length:
            seq.ended = "episode" if not observation else "budget"
            return
        seq.pending = list(observation)
        seq.turns += 1

    def _fork(self, group: _Group, buffer: ResponseState, i: int, step: int) -> _Group:
        """Sequence i ends its segment at this step's token and forks: its children's group continues a state
        holding its positions but the last token, which they feed first."""
        seq = group.seqs[i]
        seq.ended = "fork"
        self.forks += 1
        self.leaf_count += self.tree.branching - 1
        end = group.start + step + 1
        state = branch_state(group.state, buffer, i, group.start, end)
        if self.keep_states:
            self.states[seq.node] = state
        kids = [_Sequence(node=self.new_node(seq.node, group.depth + 1), before=seq.before + seq.tokens,
                          before_observed=seq.before_observed + seq.observed, turns=seq.turns, calls=seq.calls)
                for _ in range(self.tree.branching)]
        return _Group(state, end, seq.tokens[-1], group.depth + 1, kids)


"""Sampling from ONE prefill of the shared prompt: the one decode loop, for a group and for a tree.

The prompt is captured once (`capture_prompt`, the same state the training step consumes); sequences then decode as
one batch, each step attending to the shared prompt state (never copied or expanded) and to its own generated tokens
(`ResponseState`). Like the training replay, decoding starts from the last prompt token, so the state holds
prompt[:-1] and can be handed straight to `backward_group`.

`Decoder` is that loop: `sample_group` runs it on G trunks that never fork, `sample_tree` (`tree/rollout.py`) with a
fork rule (a fork's children continue its state in place: `ResponseState.continued`, docs/trees.md). Each batch of
siblings has its own generator: the trunks' from the seed, a fork's children's from the seed and their first node.

Recorded log-probs are the policy's own (temperature 1, no top-k/top-p), whatever the sampling temperature: what the
training step recomputes, so they serve as `old_logprobs`. Multi-turn rollouts (`environment.py`): a sequence whose
generated tokens end a tool call hands its response so far to the environment, which returns the observation's ids
(None: the episode ends). They are fed into that sequence's own state one per decode step, in place of a sample and in
lockstep with the other sequences, so the prompt state is never re-encoded or copied; they are in the response with
`loss_masks` False. Up to `max_turns` model turns; `max_new_tokens` counts generated and observation tokens. Under
context parallelism the ranks compare their environments' observations at every step (`environment.agree`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from longstraw.choices import MIN_TEMPERATURE, int_at_least
from longstraw.engine.environment import CallEnd, Environment, agree, check_environment, ends_call, observation_ids
from longstraw.engine.hf.segment import run_segment
from longstraw.engine.logits import scaled_logits
from longstraw.engine.logprobs import DEFAULT_TOKEN_CHUNK, accumulated_logits, chunked_logprobs
from longstraw.engine.pad import pad
from longstraw.engine.precision import accumulation_dtype
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.checks import check_materialised, check_prompt_state
from longstraw.engine.state.prompt import PromptState
from longstraw.engine.state.response import ResponseState
from longstraw.engine.state.sharding import ContextShards
from longstraw.models.architecture import hf, logit_scale, logit_softcap


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are drawn. top_k = 0 and top_p = 1.0 disable those filters."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()  # EOS and other stop tokens; the stop token is kept in the response
    # Multi-turn (with an `environment`): what ends a tool call, and the most model turns. call_end is the closing
    # token ids, or a callable (the response so far, 1-D ids) -> bool, True when its last token ends a call.
    call_end: tuple[int, ...] | CallEnd = ()
    max_turns: int = 1

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_turns"):
            int_at_least(name, getattr(self, name), 1)
        if not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(f"temperature must be >= {MIN_TEMPERATURE}, got {self.temperature}: below it sampling is "
                             "already greedy in all but name, and logits / temperature can overflow to inf; for greedy "
                             "sampling use top_k=1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        int_at_least("top_k", self.top_k, 0, " (0 disables it)")
        if callable(self.call_end):
            return
        if not isinstance(self.call_end, tuple):
            raise ValueError(f"call_end must be a tuple of non-negative int token ids or a callable (the response so "
                             f"far) -> bool, got {self.call_end!r}")
        for t in self.call_end:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"call_end must hold non-negative int token ids, got {self.call_end!r}")


def check_inputs(model: torch.nn.Module, prompt: torch.Tensor, state: PromptState | None, caller: str,
                 sampling: SamplingConfig | None = None, environment: Environment | None = None) -> torch.Tensor:
    """Before any forward: a non-empty 1-D prompt, a model with weights, a reused state captured for this prompt by
    this model with its current weights (`state.checks`), and an environment and call_end a rollout can use
    (`environment.check_environment`). Returns the prompt (P,) as long ids on the model's device."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError("prompt must be a non-empty 1-D tensor of token ids")
    check_materialised(model, caller)
    if state is not None:
        check_prompt_state(model, state, prompt)
    if environment is not None and sampling is not None:
        check_environment(environment, sampling.call_end, sampling.stop_ids, _vocab(model))
    return prompt.to(device=hf(model).get_input_embeddings().weight.device, dtype=torch.long)


def _vocab(model: torch.nn.Module) -> int:
    """The ids the model can both read and sample."""
    return min(hf(model).get_input_embeddings().num_embeddings, hf(model).get_output_embeddings().weight.shape[0])


@dataclass
class Rollout:
    """responses: (R_i,) ids each; logprobs: (R_i,) policy log-probs; state: the captured prompt[:-1].
    loss_masks (multi-turn): (R_i,) bool, False on observation tokens; None without an environment. turns: the
    model turns of each response (1 without an environment); tool_calls: the environment's calls per response."""

    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    state: PromptState
    loss_masks: list[torch.Tensor] | None = None
    turns: list[int] | None = None
    tool_calls: list[int] | None = None


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits (B, V) outside the top-k set and outside the smallest set with probability >= top_p."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass of the tokens strictly before it already reaches top_p.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def sample_group(model: torch.nn.Module, prompt: torch.Tensor, group_size: int, sampling: SamplingConfig, seed: int = 0,
                 chunk_size: int = 2048, state: PromptState | None = None, keep_boundaries: bool = True,
                 context_shards: ContextShards | None = None, environment: Environment | None = None) -> Rollout:
    """Draw `group_size` responses to `prompt` (P,) with one prompt prefill (`Decoder` on that many trunks that never
    fork). Deterministic for a given seed.

    keep_boundaries: capture the recurrent state at every chunk boundary, so the exact plan can reuse the rollout's
    state (detach-only training can save that memory with False). context_shards: the prompt state is sharded over
    that group's ranks, which all call this with the same arguments and get the same samples. environment:
    multi-turn rollouts (module docstring), deterministic for the ranks of a context-parallel group to agree."""
    int_at_least("group_size", group_size, 1)
    prompt = check_inputs(model, prompt, state, "sample_group", sampling, environment)
    if state is None:
        state = capture_prompt(model, prompt[:-1], chunk_size, keep_boundaries=keep_boundaries,
                               context_shards=context_shards)
    nodes = Decoder(model, sampling, environment, seed).run(state, prompt, group_size)
    responses = [n.tokens.to(prompt.device) for n in nodes]
    logprobs = [n.logprobs.to(prompt.device) for n in nodes]  # in the accumulation dtype: fp32 for bf16
    if environment is None:
        return Rollout(responses=responses, logprobs=logprobs, state=state)
    return Rollout(responses=responses, logprobs=logprobs, state=state, loss_masks=[~n.observed for n in nodes],
                   turns=[n.turns for n in nodes], tool_calls=[n.tool_calls for n in nodes])


@dataclass
class RolloutNode:
    """One segment a `Decoder` sampled. parent: the node it continues (None: a trunk, continuing the prompt).
    tokens / logprobs / observed (n,): its ids, their policy log-probs and whether each was an observation token.
    children: the nodes that continue it (empty: a leaf). ended: why it ended ("fork", "stop", "budget", "turns":
    a call past max_turns, "episode": the environment ended it)."""

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
class _Sequence:
    """A sequence a group decodes: its node, its path's response so far (ids[:start] its ancestors' segments, then
    this segment's), the turns and calls along the path, and what it has produced in this group."""

    node: int
    ids: list[int]
    observed: list[bool]  # which of `ids` were observation tokens
    turns: int = 1
    calls: int = 0
    start: int = 0
    logps: list[float] = field(default_factory=list)
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


# fork_rule(depth, segment, observed, leaves) -> how many children a live sequence at `depth` forks into now (0: it
# continues); segment: its tokens in this segment, observed: its last token ended an observation, leaves: the tree's.
ForkRule = Callable[[int, int, bool, int], int]


class Decoder:
    """The decode loop: trunks from the prompt's state, and (with a fork rule) the groups of their forks, depth first.
    nodes: every segment made (parents before children); with keep_states, states[n] / buffers[n]: the state node
    n's children decode over and the buffer n decoded into."""

    def __init__(self, model: torch.nn.Module, sampling: SamplingConfig, environment: Environment | None, seed: int,
                 fork_rule: ForkRule | None = None, keep_states: bool = False) -> None:
        self.model, self.sampling, self.environment, self.seed = model, sampling, environment, seed
        self.fork_rule, self.keep_states, self.vocab = fork_rule, keep_states, _vocab(model)
        self.nodes: list[RolloutNode] = []
        self.leaves = self.forks = self.groups = self.positions = 0
        self.states: dict[int, PromptState] = {}
        self.buffers: dict[int, ResponseState] = {}
        head = hf(model).get_output_embeddings()
        self.weight, self.bias = head.weight, getattr(head, "bias", None)  # (V, d), (V,) or None
        # the model's own logit factor (Cohere, Granite) and soft-cap (Gemma-2); the temperature divides after both
        self.scale, self.softcap = logit_scale(model), logit_softcap(model)

    def run(self, state: PromptState, prompt: torch.Tensor, trunks: int) -> list[RolloutNode]:
        """Decode `trunks` sequences from `state` (prompt[:-1]) and every fork they make; the nodes."""
        self.leaves = trunks
        seqs = [_Sequence(self.new_node(None, 1), [], []) for _ in range(trunks)]
        pending = [_Group(state, prompt.numel() - 1, int(prompt[-1]), 1, seqs)]
        while pending:  # depth first: the last group made (a fork's children) runs next
            pending.extend(reversed(self.decode(pending.pop())))
        return self.nodes

    def new_node(self, parent: int | None, depth: int) -> int:
        empty = torch.empty(0)
        self.nodes.append(RolloutNode(parent=parent, depth=depth, tokens=empty.long(), logprobs=empty,
                                      observed=empty.bool(), ended=""))
        if parent is not None:
            self.nodes[parent].children.append(len(self.nodes) - 1)
        return len(self.nodes) - 1

    def decode(self, group: _Group) -> list[_Group]:
        """Decode one group to its end; returns the groups of the forks it made, in order."""
        cfg, b, env = self.sampling, len(group.seqs), self.environment
        used = group.seqs[0].start  # siblings share their path
        buffer = ResponseState(b, cfg.max_new_tokens - used)
        node = group.seqs[0].node
        gen = torch.Generator(device=self.weight.device).manual_seed(
            self.seed if node == 0 else (self.seed * 1_000_003 + node) % 2**63)
        self.groups += 1
        token = torch.full((b, 1), group.first, dtype=torch.long, device=self.weight.device)
        children: list[_Group] = []
        for step in range(buffer.max_len):
            hidden = run_segment(self.model, token, group.start + step, group.state, generated=buffer)  # (B, 1, d)
            assert hidden is not None  # None only with kv_only
            self.positions += b  # every row runs, a finished one too (its result unused)
            logits = scaled_logits(accumulated_logits(hidden[:, -1], self.weight, self.bias), self.scale, 1.0,
                                   self.softcap)  # (B, V) as the model's forward computes them, >= fp32 (precision.py)
            policy = torch.log_softmax(logits, dim=-1)
            probs = torch.softmax(_filter_logits(logits / cfg.temperature, cfg.top_k, cfg.top_p), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)  # (B,)
            forced = [bool(seq.pending) for seq in group.seqs]
            for i, seq in enumerate(group.seqs):
                if forced[i]:
                    nxt[i] = seq.pending.pop(0)  # an observation token replaces the sample
            ids, logps = nxt.tolist(), policy.gather(1, nxt[:, None]).squeeze(1).tolist()  # one copy per step
            length, calls = used + step + 1, []  # every live sequence's response length so far
            for i, seq in enumerate(group.seqs):
                if seq.ended:
                    continue
                seq.ids.append(ids[i])
                seq.logps.append(logps[i])
                seq.observed.append(forced[i])
                if forced[i]:
                    continue
                if ids[i] in cfg.stop_ids:
                    seq.ended = "stop"
                elif env is not None and ends_call(cfg.call_end, seq.ids, seq.observed, seq.node):
                    calls.append(i)
            if env is not None:
                self._answer(group, calls, length)
            for i, seq in enumerate(group.seqs):
                if seq.ended:
                    continue
                n = 0 if self.fork_rule is None or seq.pending or length >= cfg.max_new_tokens else \
                    self.fork_rule(group.depth, length - used, forced[i], self.leaves)
                if n:
                    children.append(self._fork(group, buffer, i, n))
                elif length >= cfg.max_new_tokens:
                    seq.ended = "budget"
            if all(s.ended for s in group.seqs):
                break
            token = nxt[:, None]
        self._finish(group, buffer)
        return children

    def _answer(self, group: _Group, calls: list[int], length: int) -> None:
        """The environment's answers to this step's calls (rows `calls` of the group, each response `length` ids):
        an observation becomes its sequence's pending ids, or the episode ends (a call past max_turns, None or empty,
        or no room for the observation and a reply). Under context parallelism the ranks agree on them first."""
        env, shards = self.environment, group.state.context_shards
        assert env is not None  # only called with one
        answers: dict[int, list[int] | None] = {}  # this step's observations, by row
        failure: Exception | None = None
        for i in calls:
            seq = group.seqs[i]
            if seq.turns >= self.sampling.max_turns:
                seq.ended = "turns"
                continue
            try:
                answers[i] = observation_ids(env(seq.node, torch.tensor(seq.ids, dtype=torch.long)),
                                             env, seq.node, seq.turns, self.vocab)
            except Exception as err:  # under context parallelism, raised once the other ranks know
                if shards is None:
                    raise
                failure = err
                break
            seq.calls += 1
        if shards is not None:
            agree(shards, env, [(s.node, s.turns) for s in group.seqs], answers, failure, self.weight.device)
        for i, observation in answers.items():
            seq = group.seqs[i]
            if not observation or len(observation) >= self.sampling.max_new_tokens - length:
                seq.ended = "episode" if not observation else "budget"
                continue
            seq.pending = list(observation)
            seq.turns += 1

    def _fork(self, group: _Group, buffer: ResponseState, i: int, n: int) -> _Group:
        """Sequence i ends its segment at this step's token and forks into n: their group continues a state holding
        its positions but the last token, which they feed first."""
        seq = group.seqs[i]
        seq.ended = "fork"
        self.forks += 1
        self.leaves += n - 1
        state = buffer.continued(group.state, i, group.start)
        if self.keep_states:
            self.states[seq.node] = state
        kids = [_Sequence(self.new_node(seq.node, group.depth + 1), list(seq.ids), list(seq.observed), seq.turns,
                          seq.calls, len(seq.ids)) for _ in range(n)]
        return _Group(state, group.start + buffer.length, seq.ids[-1], group.depth + 1, kids)

    def _finish(self, group: _Group, buffer: ResponseState) -> None:
        """Write what the group's sequences produced into their nodes."""
        dtype = accumulation_dtype(self.weight.dtype)  # fp32 for bf16: old log-probs rounded to bf16 add noise
        for seq in group.seqs:
            node = self.nodes[seq.node]
            node.tokens = torch.tensor(seq.ids[seq.start :], dtype=torch.long)
            node.logprobs = torch.tensor(seq.logps, dtype=dtype)
            node.observed = torch.tensor(seq.observed[seq.start :], dtype=torch.bool)
            node.ended = seq.ended or "budget"
            node.turns, node.tool_calls = seq.turns, seq.calls
            if self.keep_states:
                self.buffers[seq.node] = buffer


@torch.no_grad()
def score_responses(model: torch.nn.Module, prompt: torch.Tensor, responses: list[torch.Tensor], chunk_size: int = 2048,
                    micro_batch: int = 1, state: PromptState | None = None,
                    context_shards: ContextShards | None = None) -> list[torch.Tensor]:
    """Per-token log-probs (R_i,) of each response under `model`, from one prompt capture (e.g. the frozen
    reference model's log-probs for the KL term). Same replay path as training, without backward."""
    prompt = check_inputs(model, prompt, state, "score_responses")
    if state is None:
        state = capture_prompt(model, prompt[:-1], chunk_size, keep_boundaries=False, context_shards=context_shards)
    responses = [r.to(device=prompt.device, dtype=torch.long) for r in responses]
    head = hf(model).get_output_embeddings()
    logprobs: list[torch.Tensor] = []
    for first in range(0, len(responses), micro_batch):
        batch = responses[first:first + micro_batch]
        inputs, _ = pad([torch.cat([prompt[-1:], r[:-1]]) for r in batch])  # (k, R_max): x[-1], then o_i but its last
        targets, _ = pad(batch)  # (k, R_max)
        hidden = run_segment(model, inputs, prompt.numel() - 1, state.fork())  # (k, R_max, d)
        assert hidden is not None
        logp = chunked_logprobs(hidden, head.weight, targets, DEFAULT_TOKEN_CHUNK, 1.0, logit_scale(model),
                                softcap=logit_softcap(model), bias=getattr(head, "bias", None))  # (k, R_max)
        logprobs.extend(logp[row, : r.numel()] for row, r in enumerate(batch))
    return logprobs


def stop_ids_of(model: torch.nn.Module, tokenizer: object | None = None) -> tuple[int, ...]:
    """EOS ids from the model's generation config (falling back to the tokenizer's)."""
    ids: Sequence[int] | int | None = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return ()
    return (ids,) if isinstance(ids, int) else tuple(ids)

"""Sampling G responses from ONE prefill of the shared prompt.

The prompt is captured once (`capture_prompt`, the same state the training step consumes); the G samples
then decode as one batch, each step attending to the shared prompt state (never copied or expanded) and
to its own generated tokens (`ResponseState`). Like the training replay, decoding starts from the last
prompt token, so the state holds prompt[:-1] and can be handed straight to `backward_group`.

Recorded log-probs are the policy's own (temperature 1, no top-k/top-p truncation), whatever the sampling
temperature: they are what the training step recomputes, so they serve as `old_logprobs`.

Multi-turn rollouts (an agent calling tools): with an `environment`, a sequence whose generated tokens end a tool call
hands its response so far to the environment, which returns the observation's token ids (or None: the episode ends).
`SamplingConfig.call_end` says what ends a call: the closing tokens' ids (the response's last ids equal them), or a
callable `call_end(response_so_far) -> bool` that the task builds from its tokenizer, which can look at the decoded
text (a BPE tokenizer splits a closing tag such as `</lookup>` differently after a space, a digit or before a
punctuation mark, so one tuple of ids misses most of the calls a model writes). The observation is fed into that
sequence's own state, one token per decode step in lockstep with the other sequences' decoding (a forced token instead
of a sampled one), so the shared prompt state is never re-encoded or copied; its tokens are in the response with
`loss_masks` False. Up to `max_turns` model turns; the response budget (`max_new_tokens`) counts generated and
observation tokens.

What is checked, and when. When the rollout starts: the environment is callable, every `call_end` id is a token the
model can sample (in its vocabulary), and no `call_end` id is also a stop id (a response stops at a stop id, so a
call ending in one, or passing through one, would never reach the environment: refused rather than ignored). A
`call_end` callable must answer True or False (anything else is one ValueError naming it and the sequence). At each
call: the observation is None (the episode ends; an empty observation ends it too) or 1-D integer token ids within
the vocabulary, as a torch integer tensor or a list/tuple of Python ints; anything else (text, floats, bools, a 2-D
tensor, a NumPy array, an id outside the vocabulary) is one ValueError naming the environment, the sequence and the
turn. Under context parallelism the ranks of the group compare, at every decode step, a 64-bit hash of what their
environments returned (`ContextShards.all_gather`): observations that differ between ranks, or an environment that
raised on some ranks only, are one error on every rank instead of rollouts that silently diverge or a collective that
waits out its timeout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from longstraw.choices import MIN_TEMPERATURE
from longstraw.engine.hf.segment import run_segment
from longstraw.engine.logprobs import DEFAULT_TOKEN_CHUNK, accumulated_logits, chunked_logprobs
from longstraw.engine.pad import pad
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.checks import check_materialised, check_prompt_state
from longstraw.engine.state.prompt import PromptState
from longstraw.engine.state.response import ResponseState
from longstraw.engine.state.sharding import ContextShards
from longstraw.models.architecture import hf, logit_scale, logit_softcap

# call_end(response_so_far) -> True when the response's last token ends a tool call (1-D ids, its model and
# observation tokens so far); built by a task from its tokenizer, so the engine needs none.
CallEnd = Callable[[torch.Tensor], bool]


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
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(f"temperature must be >= {MIN_TEMPERATURE}, got {self.temperature}: below it sampling is "
                             "already greedy in all but name, and logits / temperature can overflow to inf; for greedy "
                             "sampling use top_k=1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if callable(self.call_end):
            return
        if not isinstance(self.call_end, tuple):
            raise ValueError(f"call_end must be a tuple of non-negative int token ids or a callable (the response so "
                             f"far) -> bool, got {self.call_end!r}")
        for t in self.call_end:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"call_end must hold non-negative int token ids, got {self.call_end!r}")


def _check_inputs(model: torch.nn.Module, prompt: torch.Tensor, state: PromptState | None, caller: str) -> None:
    """Before any forward: a non-empty 1-D prompt, a model with weights, and a reused state captured for this prompt
    by this model with its current weights (`state.checks`)."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError("prompt must be a non-empty 1-D tensor of token ids")
    check_materialised(model, caller)
    if state is not None:
        check_prompt_state(model, state, prompt)


# environment(i, response_so_far) -> the observation's token ids (a 1-D integer tensor or a list of ints), or None
# to end sequence i's episode.
Environment = Callable[[int, torch.Tensor], "torch.Tensor | Sequence[int] | None"]


def _name(environment: object) -> str:
    """The environment as error messages name it: its repr, shortened."""
    text = repr(environment)
    return text if len(text) <= 160 else text[:157] + "..."


def _check_environment(environment: object, sampling: SamplingConfig, vocab: int) -> None:
    """At the start of a rollout: a callable environment and call_end ids the model can sample that no stop id
    pre-empts."""
    if not callable(environment):
        raise TypeError(f"environment must be callable as environment(i, response_so_far) -> the observation's token "
                        f"ids or None, got {_name(environment)} ({type(environment).__name__})")
    if callable(sampling.call_end):
        return
    if not sampling.call_end:
        raise ValueError("an environment needs SamplingConfig.call_end: the token ids that end a tool call, or a "
                         "callable (the response so far) -> bool")
    outside = [t for t in sampling.call_end if t >= vocab]
    if outside:
        raise ValueError(f"call_end id {outside[0]} is outside the model's vocabulary [0, {vocab}): the model can "
                         f"never sample it, so the environment {_name(environment)} would never be called; pass the "
                         "tokenizer's ids of the tool call's closing text")
    stops = [t for t in sampling.call_end if t in sampling.stop_ids]
    if stops:
        raise ValueError(f"call_end id {stops[0]} is also a stop id (SamplingConfig.stop_ids {sampling.stop_ids}): a "
                         "response ends at a stop id, so a tool call holding it would end the response instead of "
                         "reaching the environment; remove it from stop_ids or end tool calls with other tokens")


def _observation_ids(observation: object, environment: object, i: int, turn: int, vocab: int) -> list[int] | None:
    """The environment's answer to sequence i's call ending model turn `turn` as a list of ids (None: the episode
    ends); ValueError saying what to return instead for anything but None or 1-D integer ids within the vocabulary."""
    if observation is None:
        return None
    ids: list[int] | None = None
    if isinstance(observation, torch.Tensor):
        if observation.dtype == torch.bool or observation.is_floating_point() or observation.is_complex():
            bad = f"a {observation.dtype} tensor (token ids are integers; floats are not rounded)"
        elif observation.dim() != 1:
            bad = f"a tensor of shape {tuple(observation.shape)} (one sequence of ids is 1-D)"
        else:
            ids = [int(t) for t in observation.tolist()]
    elif isinstance(observation, (list, tuple)):
        odd = [t for t in observation if isinstance(t, bool) or not isinstance(t, int)]
        if odd:
            bad = f"a {type(observation).__name__} holding {type(odd[0]).__name__} {odd[0]!r}"
        else:
            ids = list(observation)
    elif isinstance(observation, str):
        bad = f"text ({observation[:40]!r}): encode it with the tokenizer"
    else:
        bad = f"a {type(observation).__module__}.{type(observation).__name__}"
    if ids is not None:
        outside = [t for t in ids if not 0 <= t < vocab]
        if not outside:
            return ids
        bad = f"token id {outside[0]}, outside the model's vocabulary [0, {vocab})"
    raise ValueError(
        f"environment {_name(environment)} returned {bad} for sequence {i} at the tool call ending its turn {turn}: "
        "return the observation's token ids as a 1-D integer torch.Tensor (e.g. torch.tensor(tokenizer.encode(text), "
        f"dtype=torch.long)) or a list of ints, each in [0, {vocab}), or None to end the episode"
    )


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
def sample_group(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    group_size: int,
    sampling: SamplingConfig,
    seed: int = 0,
    chunk_size: int = 2048,
    state: PromptState | None = None,
    keep_boundaries: bool = True,
    context_shards: ContextShards | None = None,
    environment: Environment | None = None,
) -> Rollout:
    """Draw `group_size` responses to `prompt` (P,) with one prompt prefill. Deterministic for a given seed.

    keep_boundaries: capture the recurrent state at every chunk boundary, so the exact plan can reuse the
    rollout's state (detach-only training can save that memory with False). context_shards: the prompt
    state is sharded over that group's ranks, which all call this with the same arguments and get the same
    samples. environment: multi-turn rollouts (module docstring); it must be deterministic for the ranks of a
    context-parallel group to stay in step (the ranks compare its observations: module docstring)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    _check_inputs(model, prompt, state, "sample_group")
    embeddings = hf(model).get_input_embeddings()
    if environment is not None:
        _check_environment(environment, sampling, min(embeddings.num_embeddings,
                                                      hf(model).get_output_embeddings().weight.shape[0]))
    device = embeddings.weight.device
    prompt = prompt.to(device=device, dtype=torch.long)
    if state is None:
        state = capture_prompt(model, prompt[:-1], chunk_size, keep_boundaries=keep_boundaries,
                               context_shards=context_shards)
    head = hf(model).get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)  # (V, d), (V,) or None
    scale = logit_scale(model)  # the factor the model's own forward applies to the projection (Cohere, Granite)
    softcap = logit_softcap(model)  # and its final-logit soft-cap after that factor (Gemma-2)
    generated = ResponseState(group_size, sampling.max_new_tokens)
    gen = torch.Generator(device=device).manual_seed(seed)
    stop = torch.tensor(sampling.stop_ids, dtype=torch.long, device=device)

    p = prompt.numel()
    token = prompt[-1:].expand(group_size).unsqueeze(1)  # (G, 1): every sample starts from the last prompt token
    tokens, logps = [], []
    done = torch.zeros(group_size, dtype=torch.bool, device=device)
    lengths = torch.full((group_size,), sampling.max_new_tokens, dtype=torch.long, device=device)
    turns = _Turns(group_size, sampling, environment, embeddings.num_embeddings, state.context_shards)
    for step in range(sampling.max_new_tokens):
        hidden = run_segment(model, token, p - 1 + step, state, generated=generated)  # (G, 1, d)
        assert hidden is not None  # None only with kv_only
        logits = accumulated_logits(hidden[:, -1], weight, bias)  # (G, V): sample and score in >= fp32 (precision.py)
        if scale != 1.0:
            logits = logits * scale
        if softcap is not None:  # as transformers' forward: / cap, tanh, * cap; the temperature divides after
            logits = torch.tanh(logits / softcap) * softcap
        policy_logp = torch.log_softmax(logits, dim=-1)
        filtered = _filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
        probs = torch.softmax(filtered, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)  # (G,)
        forced = turns.forced(nxt)  # observation tokens replace the samples of sequences in an observation
        tokens.append(nxt)
        logps.append(policy_logp.gather(1, nxt[:, None]).squeeze(1))
        is_stop = (torch.isin(nxt, stop) & ~forced) | turns.after(step, nxt, forced, tokens, done)
        is_stop &= ~done
        lengths = torch.where(is_stop, torch.full_like(lengths, step + 1), lengths)
        done |= is_stop
        if bool(done.all()):
            break
        token = nxt[:, None]
    ids = torch.stack(tokens, dim=1)  # (G, steps)
    lp = torch.stack(logps, dim=1)  # (G, steps), in the accumulation dtype: fp32 for bf16 (precision.py)
    responses = [ids[i, : int(lengths[i])].clone() for i in range(group_size)]
    logprobs = [lp[i, : int(lengths[i])].clone() for i in range(group_size)]
    if environment is None:
        return Rollout(responses=responses, logprobs=logprobs, state=state)
    masks = turns.loss_masks([int(n) for n in lengths])
    return Rollout(responses=responses, logprobs=logprobs, state=state, loss_masks=masks, turns=turns.turns,
                   tool_calls=turns.calls)


class _Turns:
    """The multi-turn bookkeeping of `sample_group`: each sequence's pending observation tokens, which steps were
    observation tokens (the loss masks), and how many model turns it has had. Without an environment it forces
    nothing and ends nothing."""

    def __init__(self, group_size: int, sampling: SamplingConfig, environment: Environment | None, vocab: int,
                 context_shards: ContextShards | None) -> None:
        self.sampling, self.environment, self.vocab = sampling, environment, vocab
        self.context_shards = context_shards if environment is not None else None
        self.pending: list[list[int]] = [[] for _ in range(group_size)]
        self.observed: list[list[bool]] = [[] for _ in range(group_size)]  # per step: an observation token
        self.turns = [1] * group_size
        self.calls = [0] * group_size  # the environment's calls

    def forced(self, nxt: torch.Tensor) -> torch.Tensor:
        """Put each observing sequence's next observation token into `nxt` (G,) in place; which were forced."""
        forced = torch.zeros(nxt.shape, dtype=torch.bool, device=nxt.device)
        for i, queue in enumerate(self.pending):
            if queue:
                nxt[i] = queue.pop(0)
                forced[i] = True
            self.observed[i].append(bool(forced[i]))
        return forced

    def after(self, step: int, nxt: torch.Tensor, forced: torch.Tensor, tokens: list[torch.Tensor],
              done: torch.Tensor) -> torch.Tensor:
        """Sequences whose episode ends at this step: a tool call past `max_turns`, an environment that returns None
        or an observation that does not fit the budget. Calls the environment for the others' tool calls."""
        ends = torch.zeros(nxt.shape, dtype=torch.bool, device=nxt.device)
        if self.environment is None:
            return ends
        answers: dict[int, list[int] | None] = {}  # this step's observations, by sequence
        failure: Exception | None = None
        ids = torch.stack(tokens, dim=1)  # (G, step + 1): each response so far
        for i in self._calls(ids, forced, done):
            if self.turns[i] >= self.sampling.max_turns:
                ends[i] = True
                continue
            try:
                answers[i] = _observation_ids(self.environment(i, ids[i].clone()), self.environment, i,
                                              self.turns[i], self.vocab)
            except Exception as err:  # under context parallelism, raised once the other ranks know
                if self.context_shards is None:
                    raise
                failure = err
                break
            self.calls[i] += 1
        if self.context_shards is not None:
            self._agree(nxt, answers, failure)
        room = self.sampling.max_new_tokens - (step + 1)
        for i, observation in answers.items():
            if observation is None or len(observation) == 0 or len(observation) >= room:
                ends[i] = True  # the episode is over, or its observation (and a reply) would not fit
                continue
            self.pending[i] = observation
            self.turns[i] += 1
        return ends

    def _calls(self, ids: torch.Tensor, forced: torch.Tensor, done: torch.Tensor) -> list[int]:
        """The sequences whose last token (the model's own, not an observation's) ends a tool call: their last ids
        equal `call_end`'s, all the model's own, or the `call_end` callable says True of the response so far."""
        call = self.sampling.call_end
        live = (~forced & ~done).nonzero().flatten().tolist()
        if callable(call):
            found = []
            for i in live:
                said = call(ids[i])
                if not isinstance(said, bool):
                    raise ValueError(f"call_end {_name(call)} returned {said!r} ({type(said).__name__}) for sequence "
                                     f"{i}: it must return True (the response's last token ends a tool call) or "
                                     "False")
                if said:
                    found.append(i)
            return found
        n = len(call)
        if ids.shape[1] < n:
            return []
        ends = (ids[:, -n:] == torch.tensor(call, device=ids.device)).all(1)
        return [i for i in live if bool(ends[i]) and not any(self.observed[i][-n:])]  # the call's tokens: the model's

    def _agree(self, nxt: torch.Tensor, answers: dict[int, list[int] | None], failure: Exception | None) -> None:
        """Context parallelism: every rank of the group gathers each rank's (hash, length) of this step's
        observation per sequence and a failure flag, so that observations differing between ranks, or an environment
        that raised on some ranks only, raise on every rank (the ranks would otherwise decode different tokens, or
        wait in the next collective for a rank that has left)."""
        assert self.context_shards is not None
        g = len(self.pending)
        mine = torch.zeros((g + 1, 2), dtype=torch.long, device=nxt.device)
        mine[:g, 1] = -2  # no call this step
        for i, observation in answers.items():
            data = b"none" if observation is None else b"ids:" + b",".join(str(t).encode() for t in observation)
            mine[i, 0] = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
            mine[i, 1] = -1 if observation is None else len(observation)
        mine[g, 0] = int(failure is not None)
        every = self.context_shards.all_gather(mine).cpu()  # (C, G + 1, 2)
        failed = every[:, g, 0].nonzero().flatten().tolist()
        if failed:
            if failure is not None:
                raise failure
            raise RuntimeError(f"the environment {_name(self.environment)} raised on rank(s) {failed} of the "
                               "context-parallel group (their error is in their own output); this rank stops with "
                               "them")
        differ = (every[:, :g] != every[:1, :g]).any(2).any(0).nonzero().flatten().tolist()
        if differ:
            i = differ[0]

            def what(r: int) -> str:
                n, digest = int(every[r, i, 1]), int(every[r, i, 0]) & (2**64 - 1)
                return "None (the episode ends)" if n == -1 else "no call" if n == -2 else \
                    f"{n} token ids, hash {digest:016x}"

            per_rank = "; ".join(f"rank {r}: {what(r)}" for r in range(every.shape[0]))
            raise RuntimeError(
                f"the environment {_name(self.environment)} returned different observations on the ranks of the "
                f"context-parallel group for sequence {i} at the tool call ending its turn {self.turns[i]} "
                f"({per_rank}): "
                "ranks that share a prompt must get the same observations, or their rollouts diverge; make the "
                "environment a deterministic function of (i, response) (no per-rank state, clock or unseeded "
                "randomness)"
            )

    def loss_masks(self, lengths: list[int]) -> list[torch.Tensor]:
        return [~torch.tensor(self.observed[i][:n], dtype=torch.bool) for i, n in enumerate(lengths)]


@torch.no_grad()
def score_responses(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    responses: list[torch.Tensor],
    chunk_size: int = 2048,
    micro_batch: int = 1,
    state: PromptState | None = None,
    context_shards: ContextShards | None = None,
) -> list[torch.Tensor]:
    """Per-token log-probs (R_i,) of each response under `model`, from one prompt capture (e.g. the frozen
    reference model's log-probs for the KL term). Same replay path as training, without backward."""
    _check_inputs(model, prompt, state, "score_responses")
    device = hf(model).get_input_embeddings().weight.device
    prompt = prompt.to(device=device, dtype=torch.long)
    if state is None:
        state = capture_prompt(model, prompt[:-1], chunk_size, keep_boundaries=False, context_shards=context_shards)
    responses = [r.to(device=device, dtype=torch.long) for r in responses]
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

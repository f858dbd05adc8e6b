"""The environment of a multi-turn rollout (an agent calling tools; `sampling.py` feeds observations in); its checks.

What ends a tool call (`SamplingConfig.call_end`): the closing tokens' ids (the response's last ids equal them, all
the model's own), or a callable `call_end(response_so_far) -> bool` that the task builds from its tokenizer, which can
look at the decoded text (a BPE tokenizer splits a closing tag such as `</lookup>` differently after a space, a digit
or before a punctuation mark, so one tuple of ids misses most of the calls a model writes).

What is checked: when the rollout starts, the environment and `call_end` (`check_environment`); at each call, what
`call_end` and the environment answered (`ends_call`, `observation_ids`): anything off is one ValueError naming the
environment, the sequence and the turn. Under context parallelism the ranks of the group compare, at every decode
step, a 64-bit hash of what their environments returned (`agree`): observations that differ between ranks, or an
environment that raised on some ranks only, are one error on every rank instead of rollouts that silently diverge or
a collective that waits out its timeout."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from longstraw.engine.state.sharding import ContextShards

# environment(i, response_so_far) -> the observation's token ids (a 1-D integer tensor or a list of ints), or None
# to end sequence i's episode. The response so far: 1-D long ids on the CPU, as is call_end's.
Environment = Callable[[int, torch.Tensor], "torch.Tensor | Sequence[int] | None"]
# call_end(response_so_far) -> True when the response's last token ends a tool call (1-D ids, its model and observation
# tokens so far; asked at the model's own tokens but stop ids); a task builds it (the engine has no tokenizer).
CallEnd = Callable[[torch.Tensor], bool]


def describe(environment: object) -> str:
    """The environment (or call_end) as error messages name it: its repr, shortened."""
    text = repr(environment)
    return text if len(text) <= 160 else text[:157] + "..."


def check_environment(environment: object, call_end: tuple[int, ...] | CallEnd, stop_ids: tuple[int, ...],
                      vocab: int) -> None:
    """At the start of a rollout: a callable environment; call_end ids the model can sample, no stop id pre-empting."""
    if not callable(environment):
        raise TypeError(f"environment must be callable as environment(i, response_so_far) -> the observation's token "
                        f"ids or None, got {describe(environment)} ({type(environment).__name__})")
    if callable(call_end):
        return
    if not call_end:
        raise ValueError("an environment needs SamplingConfig.call_end: the token ids that end a tool call, or a "
                         "callable (the response so far) -> bool")
    outside = [t for t in call_end if t >= vocab]
    if outside:
        raise ValueError(f"call_end id {outside[0]} is outside the model's vocabulary [0, {vocab}): the model can "
                         f"never sample it, so the environment {describe(environment)} would never be called; pass "
                         "the tokenizer's ids of the tool call's closing text")
    stops = [t for t in call_end if t in stop_ids]
    if stops:
        raise ValueError(f"call_end id {stops[0]} is also a stop id (SamplingConfig.stop_ids {stop_ids}): a response "
                         "ends at a stop id, so a tool call holding it would end the response instead of reaching the "
                         "environment; remove it from stop_ids or end tool calls with other tokens")


def ends_call(call_end: tuple[int, ...] | CallEnd, ids: list[int], observed: list[bool], i: int) -> bool:
    """Whether sequence i's response so far, `ids` (its last token the model's own; `observed` flags observations),
    ends a tool call: its last ids are `call_end`'s, all the model's own, or the callable `call_end` says so."""
    if callable(call_end):
        said = call_end(torch.tensor(ids, dtype=torch.long))
        if not isinstance(said, bool):
            raise ValueError(f"call_end {describe(call_end)} returned {said!r} ({type(said).__name__}) for sequence "
                             f"{i}: it must return True (the response's last token ends a tool call) or False")
        return said
    n = len(call_end)
    return bool(n) and len(ids) >= n and tuple(ids[-n:]) == tuple(call_end) and not any(observed[-n:])


def observation_ids(observation: object, environment: object, i: int, turn: int, vocab: int) -> list[int] | None:
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
    raise ValueError(f"environment {describe(environment)} returned {bad} for sequence {i} at the tool call ending its "
                     f"turn {turn}: return the observation's token ids as a 1-D integer torch.Tensor (e.g. "
                     "torch.tensor(tokenizer.encode(text), dtype=torch.long)) or a list of ints, each in "
                     f"[0, {vocab}), or None to end the episode")


def agree(shards: ContextShards, environment: object, sequences: list[tuple[int, int]],
          answers: dict[int, list[int] | None], failure: Exception | None, device: torch.device) -> None:
    """Context parallelism: every rank of the group gathers each rank's (hash, length) of this step's observation per
    sequence and a failure flag, so that observations differing between ranks, or an environment that raised on some
    ranks only, raise on every rank (the ranks would otherwise decode different tokens, or wait in the next
    collective for a rank that has left). sequences: (index, turn) of each row of the batch; answers: this step's
    observations by row (a row without a call is absent); failure: what this rank's environment raised, if it did."""
    g = len(sequences)
    mine = torch.zeros((g + 1, 2), dtype=torch.long, device=device)
    mine[:g, 1] = -2  # no call this step
    for row, observation in answers.items():
        data = b"none" if observation is None else b"ids:" + b",".join(str(t).encode() for t in observation)
        mine[row, 0] = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
        mine[row, 1] = -1 if observation is None else len(observation)
    mine[g, 0] = int(failure is not None)
    every = shards.all_gather(mine).cpu()  # (C, G + 1, 2)
    failed = every[:, g, 0].nonzero().flatten().tolist()
    if failed:
        if failure is not None:
            raise failure
        raise RuntimeError(f"the environment {describe(environment)} raised on rank(s) {failed} of the "
                           "context-parallel group (their error is in their own output); this rank stops with them")
    differ = (every[:, :g] != every[:1, :g]).any(2).any(0).nonzero().flatten().tolist()
    if differ:
        row = differ[0]
        i, turn = sequences[row]

        def what(r: int) -> str:
            n, digest = int(every[r, row, 1]), int(every[r, row, 0]) & (2**64 - 1)
            return "None (the episode ends)" if n == -1 else "no call" if n == -2 else \
                f"{n} token ids, hash {digest:016x}"

        per_rank = "; ".join(f"rank {r}: {what(r)}" for r in range(every.shape[0]))
        raise RuntimeError(f"the environment {describe(environment)} returned different observations on the ranks of "
                           f"the context-parallel group for sequence {i} at the tool call ending its turn {turn} "
                           f"({per_rank}): ranks that share a prompt must get the same observations, or their rollouts "
                           "diverge; make the environment a deterministic function of (i, response) (no per-rank "
                           "state, clock or unseeded randomness)")

"""The synthetic agent mini-batch of `python -m benchmarks tree` (`planner.tree.TreeShape`: S, K, C, G, T, r, o, B) as
`Trajectory` lists, and the same batch as one `Group` per task (`task_groups`: what `backward_group` runs today).

Token ids are random and deterministic in the seed; branches are made to differ at their first token (siblings'
first ids are distinct), so the prefix tree is exactly the shape's (`planner.tree.counts`)."""

from __future__ import annotations

import torch

from longstraw.engine.group import Group
from longstraw.engine.tree import Trajectory
from longstraw.planner.tree import TreeShape


def _distinct_first(tokens: torch.Tensor, sibling: int, base: int, vocab_size: int) -> torch.Tensor:
    """`tokens` with its first id set to base + sibling (mod V): siblings of one parent start differently."""
    tokens[0] = (base + sibling) % vocab_size
    return tokens


def turn_mask(shape: TreeShape) -> torch.Tensor:
    """(r + o,) bool: one turn's loss mask, True on the r response tokens, False on the o observation tokens."""
    return torch.cat([torch.ones(shape.response_tokens, dtype=torch.bool),
                      torch.zeros(shape.observation_tokens, dtype=torch.bool)])


def make_trajectories(shape: TreeShape, vocab_size: int, seed: int = 0) -> list[Trajectory]:
    """K · G trajectories (task k's are k·G … k·G + G − 1, `group` = k), each (N,) = S + C + T (r + o) ids with
    loss_start = S + C, its loss mask True on every turn's r response tokens, and an advantage ~ N(0, 1).

    Task k's trajectories share its first T − m turns; at each of the last m turns every live sequence forks into
    B continuations (m = log_B G)."""
    if vocab_size < max(shape.tasks, shape.branching) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for {shape.tasks} tasks of distinct first tokens")
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab_size, (n,), generator=gen)

    def base() -> int:
        return int(torch.randint(0, vocab_size, (1,), generator=gen))

    s, g, b, m = shape.system_tokens, shape.group_size, shape.branching, shape.branch_turns
    system = ids(s)
    task_base = base()
    mask = turn_mask(shape).repeat(shape.turns)
    out: list[Trajectory] = []
    for k in range(shape.tasks):
        task = _distinct_first(ids(shape.task_tokens), k, task_base, vocab_size)
        trunk = ids((shape.turns - m) * shape.turn_tokens)
        # level j (1..m): B^j turn segments; segment q's parent is q // B at level j − 1
        levels = []
        for j in range(1, m + 1):
            level_base = base()
            levels.append([_distinct_first(ids(shape.turn_tokens), q % b, level_base, vocab_size)
                           for q in range(b ** j)])
        advantages = torch.randn(g, generator=gen)
        for leaf in range(g):
            path = [levels[j - 1][leaf // b ** (m - j)] for j in range(1, m + 1)]
            out.append(Trajectory(ids=torch.cat([system, task, trunk, *path]), loss_start=shape.prompt_tokens,
                                  advantage=float(advantages[leaf]), loss_mask=mask.clone(), group=k))
    return out


def task_groups(trajectories: list[Trajectory]) -> list[Group]:
    """One `Group` per task: its shared S + C tokens as the prompt (every trajectory's ids before loss_start), each
    trajectory's remaining tokens as a response with its loss mask and advantage."""
    by_group: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        by_group.setdefault(t.group, []).append(t)
    groups = []
    for members in by_group.values():
        start = members[0].loss_start
        prompt = members[0].ids[:start]
        if any(t.loss_start != start or not torch.equal(t.ids[:start], prompt) for t in members):
            raise ValueError("the trajectories of one group must share their ids before one loss_start")
        groups.append(Group(prompt=prompt, responses=[t.ids[start:] for t in members],
                            advantages=torch.tensor([t.advantage for t in members]),
                            loss_masks=[t.in_loss() for t in members]))
    return groups

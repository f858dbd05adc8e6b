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

    Task k's trajectories share its first turns (`TreeShape.trunk_turns`); then at each branching level
    (`TreeShape.levels`) every live sequence forks into that level's fan-out of continuations of its turns: B of
    one turn at each of the last log_B G turns (fork "last"), G whole conversations of T turns (fork "first")."""
    fan_outs = [level.fan_out for level in shape.levels]
    if vocab_size < max([shape.tasks, *fan_outs]) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for {shape.tasks} tasks and {max(fan_outs, default=1)} "
                         f"siblings of distinct first tokens")
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab_size, (n,), generator=gen)

    def base() -> int:
        return int(torch.randint(0, vocab_size, (1,), generator=gen))

    s, g = shape.system_tokens, shape.group_size
    system = ids(s)
    task_base = base()
    mask = turn_mask(shape).repeat(shape.turns)
    out: list[Trajectory] = []
    for k in range(shape.tasks):
        task = _distinct_first(ids(shape.task_tokens), k, task_base, vocab_size)
        trunk = ids(shape.trunk_turns * shape.turn_tokens)
        # per level: (the fan-outs so far) segments of its turns; segment q's parent is q // fan_out a level up,
        # and a leaf's segment at a level is the leaf's index over the fan-outs of the levels below it
        levels, width = [], 1
        for level in shape.levels:
            width *= level.fan_out
            level_base = base()
            levels.append([_distinct_first(ids(level.turns * shape.turn_tokens), q % level.fan_out, level_base,
                                           vocab_size) for q in range(width)])
        below = [g // len(segments) for segments in levels]  # leaves under one segment of each level
        advantages = torch.randn(g, generator=gen)
        for leaf in range(g):
            path = [segments[leaf // n] for segments, n in zip(levels, below)]
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

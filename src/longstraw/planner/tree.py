"""A prefix-tree step from shape flags (`TreeShape`): a synthetic agent mini-batch — a system prompt and tools shared by
every trajectory (S tokens), K tasks (C tokens each), G trajectories per task of T turns (each turn r response tokens in
the loss, then o observation tokens masked out of it). Where a task's G trajectories branch is the shape's `fork`:
"last", shaped like tau^2-bench, they share their first turns and branch B ways at each of the last log_B(G) turns;
"first", shaped like TRL's GRPO batches (G completions sampled per prompt, each its own conversation), they fork G ways
at the first response and share nothing after the task. From it: the tree's token counts (`TreeCounts`, equal to
`Tree.stats()` of the batch `benchmarks.tree_batch` builds), the token-pass floor of each way of running the step
(`token_passes`), and the forecast of a step's peak memory for the tree `exact` plan and for the flattened plan (every
trajectory through the unmodified model, one at a time: `forecast`), which `longstraw plan --tree` prints.

Token passes: tokens run through the model's body, a backward counted as two forwards (the output projection and
attention's quadratic part are not counted): `FLOOR_FORMULAS` per way of running the step, derived in docs/trees.md.

Torch-free, like the rest of the planner."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, NamedTuple

from longstraw.choices import int_at_least
from longstraw.plan import EXACT, STANDARD
from longstraw.planner.estimator import PlanEstimate, PlanInputs, estimate
from longstraw.planner.parsing import parse_size, positive_int
from longstraw.planner.spec import ModelSpec

Fork = Literal["last", "first"]
FORKS: tuple[Fork, ...] = ("last", "first")


class Level(NamedTuple):
    """One branching level of a task's subtree: each node of the level above has `fan_out` children of `turns` turns."""

    fan_out: int
    turns: int


@dataclass(frozen=True)
class TreeShape:
    """One synthetic agent mini-batch (module docstring). A trajectory is S + C + T (r + o) tokens; its loss starts
    after the task (S + C) and covers each turn's r response tokens.

    fork "last": group_size (G) must be a power of branching (B), G = B^m with m <= T: the G trajectories of a task
    share their first T − m turns and branch B ways at the start of each of the last m turns (so every leaf is one
    turn and every turn node has the same length). fork "first": any G; the task's G trajectories fork G ways at
    the start of the first turn, each leaf a whole conversation of T turns (B is not used)."""

    system_tokens: int  # S
    tasks: int  # K
    task_tokens: int  # C
    group_size: int  # G
    turns: int  # T
    response_tokens: int  # r, in the loss
    observation_tokens: int = 0  # o, masked out of the loss
    branching: int = 2  # B
    fork: Fork = "last"  # where a task's trajectories branch: the last log_B(G) turns, or G ways at the first

    def __post_init__(self) -> None:
        for name in ("system_tokens", "tasks", "task_tokens", "group_size", "turns", "response_tokens"):
            int_at_least(name, getattr(self, name), 1)
        int_at_least("observation_tokens", self.observation_tokens, 0)
        int_at_least("branching", self.branching, 2)
        if self.fork not in FORKS:
            raise ValueError(f"fork must be one of {', '.join(FORKS)}, got {self.fork!r}")
        if self.fork == "first":  # a G-way fork fits any G and any T
            return
        m = round(math.log(self.group_size, self.branching))
        if self.branching ** m != self.group_size:
            raise ValueError(f"group_size {self.group_size} is not a power of branching {self.branching}: trajectories "
                             f"branch {self.branching} ways at each branching turn, so G must be one of "
                             f"{', '.join(str(self.branching ** k) for k in range(5))}, ...")
        if m > self.turns:
            raise ValueError(f"group_size {self.group_size} needs {m} branching turns of {self.branching} ways, but a "
                             f"trajectory has {self.turns} turns: raise --turns to {m} or lower the group size")

    @property
    def levels(self) -> tuple[Level, ...]:
        """A task's branching levels, first to last (`Level`): the last is its leaves; none when G = 1."""
        return () if self.group_size == 1 else _LEVELS[self.fork](self)

    @property
    def branch_turns(self) -> int:
        """Turns at whose start trajectories branch: the last log_B(G) (fork "last") or the first; 0 when G = 1."""
        return len(self.levels)

    @property
    def trunk_turns(self) -> int:
        """The turns a task's trajectories share before their first branch (T when G = 1)."""
        return self.turns - sum(level.turns for level in self.levels)

    @property
    def turn_tokens(self) -> int:
        return self.response_tokens + self.observation_tokens

    @property
    def prompt_tokens(self) -> int:
        """S + C: where every trajectory's loss starts (the group prompt of `backward_group`)."""
        return self.system_tokens + self.task_tokens

    @property
    def trajectory_tokens(self) -> int:
        """N = S + C + T (r + o)."""
        return self.prompt_tokens + self.turns * self.turn_tokens

    @property
    def trajectories(self) -> int:
        return self.tasks * self.group_size

    def describe(self) -> str:
        where = {"last": f"B={self.branching}", "first": "fork=first"}[self.fork]
        return (f"S={self.system_tokens} K={self.tasks} C={self.task_tokens} G={self.group_size} T={self.turns} "
                f"r={self.response_tokens} o={self.observation_tokens} {where}")


# fork -> a task's branching levels when G > 1: B ways at each of the last log_B(G) turns (one turn a level), or G
# ways at the first turn (every leaf the whole conversation)
_LEVELS: dict[str, Callable[[TreeShape], tuple[Level, ...]]] = {
    "last": lambda shape: (Level(shape.branching, 1),) * round(math.log(shape.group_size, shape.branching)),
    "first": lambda shape: (Level(shape.group_size, shape.turns),),
}


@dataclass(frozen=True)
class TreeCounts:
    """Token counts of a `TreeShape`'s prefix tree (`Tree.stats()`'s names where they exist).

    nodes, leaves, depth: as `Tree.stats()`. tokens_encoded: every node's input (E). tokens_flattened: Σ (N_i − 1).
    inner_inputs / leaf_inputs: E split between inner nodes and leaves. inner_loss_inputs: the inner nodes' inputs
    that predict tokens of the loss region (positions from S + C on). leaf_tokens: one leaf's tokens (ℓ);
    path_prefix: the positions before a leaf (N − ℓ)."""

    nodes: int
    leaves: int
    depth: int
    trajectories: int
    tokens_encoded: int
    tokens_flattened: int
    inner_inputs: int
    inner_loss_inputs: int
    leaf_inputs: int
    leaf_tokens: int
    path_prefix: int


def counts(shape: TreeShape) -> TreeCounts:
    """The prefix tree of `shape`: a root of S tokens when K > 1 (of S + C + the shared turns when K = 1), a node per
    task of C + shared turns (K > 1), then per branching level (`TreeShape.levels`) K · (fan-outs so far) nodes of its
    turns (fork "last": K · B^j one-turn nodes at the j-th branching turn; "first": K · G leaves of T turns)."""
    s, k, g, m = shape.system_tokens, shape.tasks, shape.group_size, shape.branch_turns
    shared_turns = shape.trunk_turns * shape.turn_tokens
    trunk = shape.task_tokens + shared_turns  # a task's tokens before its first branch
    # per level: (nodes, tokens of each, of them the inputs that predict loss-region tokens, whether leaves)
    levels = [(1, s + trunk, shared_turns, m == 0)] if k == 1 else [(1, s, 0, False), (k, trunk, shared_turns, m == 0)]
    nodes = k
    for j, level in enumerate(shape.levels, start=1):
        nodes *= level.fan_out
        tokens = level.turns * shape.turn_tokens
        levels.append((nodes, tokens, tokens, j == m))
    inner = inner_loss = leaf = 0
    for i, (count, tokens, loss, is_leaf) in enumerate(levels):
        inputs = count * tokens - (1 if i == 0 else 0)  # the root's first token is no input
        if is_leaf:
            leaf += inputs
        else:
            inner += inputs
            inner_loss += count * loss
    leaf_tokens = levels[-1][1]
    return TreeCounts(
        nodes=sum(c for c, *_ in levels), leaves=k * g, depth=len(levels), trajectories=k * g,
        tokens_encoded=inner + leaf, tokens_flattened=k * g * (shape.trajectory_tokens - 1), inner_inputs=inner,
        inner_loss_inputs=inner_loss, leaf_inputs=leaf, leaf_tokens=leaf_tokens,
        path_prefix=shape.trajectory_tokens - leaf_tokens,
    )


# The ways of running a tree step the bench measures, in its table's order: flattened (what TRL and verl do),
# per group (`backward_group` per task), the packed tree with an ancestor mask (the peers' approach), the tree plans.
ROWS = ("flattened", "group", "packed", "tree_exact", "tree_detach")


_PASSES: dict[str, Callable[[TreeShape, TreeCounts], int]] = {  # row -> its token passes (`FLOOR_FORMULAS`)
    "flattened": lambda s, c: 3 * c.tokens_flattened,
    "group": lambda s, c: s.tasks * (4 * (s.prompt_tokens - 1) + 3 * s.group_size * s.turns * s.turn_tokens),
    "packed": lambda s, c: 3 * c.tokens_encoded,
    "tree_exact": lambda s, c: 4 * c.inner_inputs + 3 * c.leaf_inputs,
    "tree_detach": lambda s, c: (c.inner_inputs - c.inner_loss_inputs) + 3 * (c.inner_loss_inputs + c.leaf_inputs),
}


def token_passes(shape: TreeShape, row: str) -> int:
    """Tokens `row` runs through the model's body, a backward counted as two forwards (`FLOOR_FORMULAS`)."""
    if row not in _PASSES:
        raise ValueError(f"unknown row {row!r}: one of {', '.join(ROWS)}")
    return _PASSES[row](shape, counts(shape))


FLOOR_FORMULAS = {
    "flattened": "3 * sum_i (N_i - 1)", "group": "K * (4 * (S + C - 1) + 3 * G * T * (r + o))", "packed": "3 * E",
    "tree_exact": "4 * I + 3 * L", "tree_detach": "(I - I_loss) + 3 * (I_loss + L)",
}


@dataclass(frozen=True)
class TreeForecast:
    """A tree step's predicted peak memory for one plan: `estimate`'s answer for the equivalent one-level step (see
    `forecast`) with the question it answered."""

    plan: str
    estimate: PlanEstimate
    inputs: PlanInputs

    @property
    def step_bytes(self) -> int:
        return self.estimate.step_bytes


def inner_loss_rows(shape: TreeShape, chunk: int) -> int:
    """The most loss tokens one capture chunk of an inner node holds (its recompute scores them): a task's trunk (its C
    tokens, then the shared turns) and the nodes of every branching level but the last, each chunked from its own start.
    0 when no inner node has loss tokens (G = 1: every task a leaf; fork "first": the trunk is the task's C tokens)."""
    turn = [True] * shape.response_tokens + [False] * shape.observation_tokens
    levels = shape.levels
    layouts = [[False] * shape.task_tokens + turn * shape.trunk_turns] if levels else []
    layouts += [turn * level.turns for level in levels[:-1]]
    return max((sum(layout[i:i + chunk]) for layout in layouts for i in range(0, len(layout), chunk)), default=0)


def forecast(spec: ModelSpec, shape: TreeShape, base: PlanInputs) -> dict[str, TreeForecast]:
    """Peak memory of one tree step, for the flattened plan and tree `exact` (`base`: dtype, device, chunk and token
    chunk, optimizer, GPU memory; its P, R and G are replaced).

    flattened: every trajectory of N tokens through the unmodified model, one at a time with gradient accumulation:
    the `standard` plan of a group of K · G responses of T (r + o) tokens after an S + C prompt.

    tree exact: depth first, one root-to-leaf path in memory. Its largest phase is that of one leaf: the path's
    state (N − ℓ positions, as gradient leaves) with its gradient, and the leaf's ℓ tokens replayed with grad, or
    the recompute of one chunk of an inner node with its loss tokens' log-prob (`inner_loss_rows`). That is the
    `exact` plan of a group whose prompt is a leaf's path (P = N − ℓ) and whose responses are single leaves
    (R = ℓ), every micro-batch after the first (gradients resident), so it does not grow with the number of leaves,
    tasks or branches. base.micro_batch: sibling leaves replayed at once, at most a node's leaf children (B; G at a
    first-turn fork; K when the tasks are the leaves); flattened runs one trajectory at a time."""
    c = counts(shape)
    flat_in = replace(base, prompt_tokens=shape.prompt_tokens, response_tokens=shape.turns * shape.turn_tokens,
                      observation_tokens=shape.turns * shape.observation_tokens, group_size=shape.trajectories,
                      micro_batch=1)
    levels = shape.levels
    siblings = levels[-1].fan_out if levels else shape.tasks
    k = max(1, min(base.micro_batch, siblings))
    tree_in = replace(base, prompt_tokens=c.path_prefix, response_tokens=c.leaf_tokens,
                      observation_tokens=levels[-1].turns * shape.observation_tokens if levels else 0,
                      group_size=max(2 * k, c.leaves), micro_batch=k,
                      prompt_loss_tokens=inner_loss_rows(shape, base.chunk_size))
    return {
        "flattened": TreeForecast("flattened", estimate(spec, flat_in, STANDARD), flat_in),
        "tree_exact": TreeForecast("tree_exact", estimate(spec, tree_in, EXACT), tree_in),
    }


def forecast_document(spec: ModelSpec, shape: TreeShape, base: PlanInputs) -> dict[str, Any]:
    """`longstraw plan --tree --json`'s document: the shape, its counts, floors, and each forecast."""
    plans = forecast(spec, shape, base)
    return {
        "model": {"name": spec.name, "model_type": spec.model_type, "params": spec.params},
        "shape": asdict(shape),
        "counts": asdict(counts(shape)),
        "token_passes": {row: token_passes(shape, row) for row in ROWS},
        "token_pass_formulas": FLOOR_FORMULAS,
        "plans": {name: {"step_bytes": f.step_bytes, "total_bytes": f.estimate.total_bytes,
                         "peak_phase": f.estimate.peak_phase, "fits": f.estimate.fits,
                         "components": f.estimate.components, "as_group": asdict(f.inputs)}
                  for name, f in plans.items()},
    }


TREE_ONLY = ("tasks", "task_tokens", "turns", "branching", "fork")  # options that mean nothing without --tree


def add_tree_arguments(parser: Any) -> None:
    """`longstraw plan`'s tree form: --tree with the shape's K, C, T, B and fork; --prompt-tokens is then S,
    --response-tokens and --observation-tokens one turn's r and o, --group-size the trajectories per task G."""
    tree = parser.add_argument_group(
        "prefix tree", "--tree forecasts a step of K tasks sharing a system prompt of --prompt-tokens (S) tokens, "
                       "each with --group-size (G) trajectories of --turns turns of --response-tokens (r, in the "
                       "loss) + --observation-tokens (o, masked) tokens, branching --branching ways at the last "
                       "log_B(G) turns (or, with --fork first, G ways at the first): peak memory of LongStraw's tree "
                       "exact plan and of every trajectory flattened")
    tree.add_argument("--tree", action="store_true", help="forecast a prefix-tree step (docs/trees.md)")
    tree.add_argument("--tasks", type=positive_int, metavar="K", help="tasks (groups) per step (default 1)")
    tree.add_argument("--task-tokens", type=positive_int, metavar="C", help="each task's tokens (required)")
    tree.add_argument("--turns", type=positive_int, metavar="T", help="turns per trajectory (required)")
    tree.add_argument("--branching", type=positive_int, metavar="B",
                      help="ways a trajectory forks at each branching turn (default 2); G must be a power of it")
    tree.add_argument("--fork", choices=FORKS,
                      help="where a task's trajectories branch: last (default), B ways at each of the last log_B(G) "
                           "turns; first, G ways at the first response (TRL's G completions per prompt, each its own "
                           "conversation)")


def shape_from_args(args: Any) -> TreeShape:
    """The `TreeShape` of `longstraw plan --tree`'s options; ValueError saying what to change."""
    missing = [f"--{name.replace('_', '-')}" for name in ("task_tokens", "turns") if getattr(args, name) is None]
    if missing:
        raise ValueError(f"--tree needs {' and '.join(missing)}")
    refused = [flag for flag, on in (("--gpus", args.gpus > 1), ("--cp", args.cp > 1), ("--tp", args.tp > 1),
                                     ("--checkpoint-layers", args.checkpoint_layers),
                                     ("--offload-state", args.offload_state),
                                     ("--keep-prompt-graph", bool(args.keep_prompt_graph))) if on]
    if refused:
        raise ValueError(f"--tree forecasts one device without memory levers: drop {', '.join(refused)}")
    return TreeShape(system_tokens=args.prompt_tokens, tasks=args.tasks or 1, task_tokens=args.task_tokens,
                     group_size=args.group_size, turns=args.turns, response_tokens=args.response_tokens,
                     observation_tokens=args.observation_tokens, branching=args.branching or 2,
                     fork=args.fork or "last")


def format_forecast(document: dict[str, Any]) -> str:
    """`longstraw plan --tree`'s table: the shape, its tree, token passes, then per plan the step's peak above the
    weights (what a bench measures), the total with weights and optimizer, its phase and whether it fits."""
    c, model = document["counts"], document["model"]
    shape = TreeShape(**document["shape"])
    lines = [f"{model['name']} ({model['model_type']}, {model['params'] / 1e9:.3f}B params); tree {shape.describe()}",
             f"{c['trajectories']} trajectories of {shape.trajectory_tokens} tokens, {c['nodes']} nodes, depth "
             f"{c['depth']}: {c['tokens_encoded']:,} tokens encoded of {c['tokens_flattened']:,} flattened",
             "token passes (a backward = two forwards): " + ", ".join(
                 f"{row} {n:,}" for row, n in document["token_passes"].items()),
             f"{'plan':<12}{'step GB':>10}{'total GB':>10}  {'peak phase':<18}fits"]
    for name, plan in document["plans"].items():
        lines.append(f"{name:<12}{plan['step_bytes'] / 1e9:>10.3f}{plan['total_bytes'] / 1e9:>10.3f}  "
                     f"{plan['peak_phase']:<18}{'yes' if plan['fits'] else 'NO'}")
    lines.append("step: the step's peak above the loaded weights (no optimizer state), what "
                 "`python -m benchmarks tree` measures; total: with weights, optimizer and runtime reserve")
    return "\n".join(lines)


def run_from_args(args: Any) -> int:
    """`longstraw plan --tree`: the forecast's table (or JSON); bad input goes to the parser's error."""
    import json

    from longstraw.planner.families import spec_from_config
    from longstraw.planner.spec import load_config

    try:
        shape = shape_from_args(args)
        spec = spec_from_config(load_config(args.model), name=args.model)
        base = PlanInputs(prompt_tokens=2, response_tokens=1, group_size=1, dtype=args.dtype,
                          gpu_memory=parse_size(args.gpu_memory), chunk_size=args.chunk_size,
                          micro_batch=args.micro_batch, token_chunk=args.token_chunk, optimizer=args.optimizer,
                          device=args.device,
                          reserve=parse_size(args.reserve) if args.reserve else None)
        document = forecast_document(spec, shape, base)
    except ValueError as err:
        args.fail(str(err))
    print(json.dumps(document, indent=2) if args.json else format_forecast(document))
    return 0

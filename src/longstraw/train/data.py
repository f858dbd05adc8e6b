"""The trainer's data: the configured task, its prompts per step, their checks, decoding, and the reward.

Data is a pure function of (seed, step, prompt index), so resuming only needs the step number. The whole dataset
(every jsonl row, or one generated example) is checked against the model's positions before step 1.

Held-out prompts are never trained on. A generated task draws them from a seed stream training never draws from. A
jsonl file is split once (`split_rows`): `eval_prompts` distinct rows, chosen by a shuffle of the row indices with
a fixed seed (the same rows for every run seed, so seeds differ by their training only), are held out, and training
draws only from the other rows. A file too small to leave a row to train on is refused."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import torch

from longstraw.engine.environment import Environment
from longstraw.tasks import Example, JsonlTask, Task, format_prompt, make_task
from longstraw.tasks.base import encode
from longstraw.tasks.lookup import CallEnd, LookupTask

if TYPE_CHECKING:
    from longstraw.train.config import TrainConfig

EVAL_SEED_OFFSET = 1_000_003  # held-out prompts come from a seed stream training never draws from
HELD_OUT_SPLIT_SEED = 20_240_601  # the jsonl split's shuffle: fixed, so every run seed holds out the same rows


class RewardError(ValueError):
    """The task's reward function raised or returned a non-finite value (the message names it and the step)."""


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's hash() of ints is stable, but mixing keeps streams apart)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p + 0x632BE59BD9B4E019 + (x << 6) + (x >> 2))) & 0x7FFFFFFFFFFFFFFF
    return x


def build_task(cfg: TrainConfig, tokenizer: Any) -> Task:
    """The configured task; options that do not apply to it are not passed."""
    t = cfg.task
    if t.task == "jsonl":
        return make_task("jsonl", path=t.data, **({"reward_fn": t.reward_fn} if t.reward_fn else {}))
    options: dict[str, dict[str, Any]] = {
        "passkey": {"digits": t.digits}, "multikey": {"digits": t.digits, "n_keys": t.num_keys},
        "lookup": {"hops": t.hops, "format_reward": t.format_reward}}
    return make_task(t.task, tokenizer=tokenizer, prompt_tokens=t.prompt_tokens, **options.get(t.task, {}))


def split_rows(n_rows: int, held_out: int, where: str) -> tuple[list[int], list[int]]:
    """(training rows, held-out rows), disjoint, as sorted indices into a jsonl file's `n_rows` rows: `held_out` rows
    chosen by a fixed-seed shuffle are held out. ValueError naming `where` when no row would be left to train on."""
    if held_out == 0:
        return list(range(n_rows)), []
    if held_out >= n_rows:
        raise ValueError(f"{where} has {n_rows} row(s), too few to hold out eval_prompts = {held_out} for the held-out "
                         "evaluation (rows never trained on) and keep at least one to train on: lower --eval-prompts "
                         f"to at most {n_rows - 1}, or add rows to the file")
    order = list(range(n_rows))
    random.Random(HELD_OUT_SPLIT_SEED).shuffle(order)
    return sorted(order[held_out:]), sorted(order[:held_out])


def check_data(cfg: TrainConfig) -> None:
    """What can be checked of the data without the model, before anything is written: a jsonl file's rows (every
    line parsed and decoded), its reward function (imported) and its held-out split (ValueError naming the file)."""
    if cfg.task.task == "jsonl":
        task = build_task(cfg, tokenizer=None)
        assert isinstance(task, JsonlTask)
        split_rows(len(task.rows), cfg.run.eval_prompts, str(task.path))


# The tasks whose prompts `prompt_tokens` sizes (up to a chat template's few tokens): jsonl rows are checked one by
# one once the tokenizer is loaded.
SIZED_TASKS = ("passkey", "multikey", "kv", "lookup")


def check_model(cfg: TrainConfig) -> None:
    """What can be checked of the model without loading it, before anything is written: that its name is a model
    (a preset, a directory, a GGUF file or a hub id), and that --prompt-tokens + --max-new-tokens fit the positions its
    config declares (presets and local directories; a hub or GGUF model's prompts are checked once loaded)."""
    from longstraw.admission.loading import declared_max_positions

    try:
        positions = declared_max_positions(cfg.model.model)
    except ValueError as err:
        raise ValueError(f"--model: {err}") from None
    prompt, new = cfg.task.prompt_tokens, cfg.rollout.max_new_tokens
    if positions is not None and cfg.task.task in SIZED_TASKS and prompt + new > positions:
        raise ValueError(f"--prompt-tokens {prompt} + --max-new-tokens {new} exceed the {positions} positions of model "
                         f"{cfg.model.model!r}: lower --prompt-tokens or --max-new-tokens")


class TaskData:
    """The task of `cfg` with its tokenizer; checks every prompt (`validate`) when created."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any, max_positions: int | None) -> None:
        self.cfg, self.tokenizer, self.max_positions = cfg, tokenizer, max_positions
        self.task = build_task(cfg, tokenizer)
        # jsonl: the rows training draws from and the held-out rows, disjoint; None for generated tasks.
        self.train_rows: list[Example] | None = None
        self.held_out_rows: list[Example] | None = None
        if isinstance(self.task, JsonlTask):
            train, held = split_rows(len(self.task.rows), cfg.run.eval_prompts, str(self.task.path))
            self.train_rows = [self.task.rows[i] for i in train]
            self.held_out_rows = [self.task.rows[i] for i in held]
        self.validate()

    def encode(self, example: Example, where: str = "") -> torch.Tensor:
        ids = torch.tensor(format_prompt(self.tokenizer, example.prompt), dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError(f"{where or 'the task'}: empty prompt")
        if self.max_positions is not None and ids.numel() + self.cfg.rollout.max_new_tokens > self.max_positions:
            fix = "shorten it" if where else "lower --prompt-tokens"
            raise ValueError(f"{where + ': ' if where else ''}prompt of {ids.numel()} tokens + "
                             f"{self.cfg.rollout.max_new_tokens} new tokens exceeds the {self.max_positions} positions "
                             f"of model {self.cfg.model.model!r}: {fix} or lower --max-new-tokens")
        return ids

    def validate(self) -> None:
        """Before step 1: every row of a jsonl dataset (non-empty, fits the model's positions with the longest
        response), or one generated example (haystack/kv prompts land within a word/pair of --prompt-tokens)."""
        if isinstance(self.task, JsonlTask):
            for example in self.task.rows:
                self.encode(example, where=f"{self.task.path}:{example.meta['line']}")
        else:
            self.encode(self.examples(0)[0])

    def examples(self, step: int) -> list[Example]:
        """The prompts of 0-based `step`, each from its own seed (seed, step, index); a jsonl file's rows uniformly
        (with replacement) from its training rows."""
        seed = self.cfg.run.seed
        rngs = [random.Random(derive_seed(seed, step, j)) for j in range(self.cfg.rollout.prompts_per_step)]
        if self.train_rows is not None:
            return [self.train_rows[rng.randrange(len(self.train_rows))] for rng in rngs]
        return [self.task.sample(rng) for rng in rngs]

    def held_out(self) -> list[Example]:
        """The held-out evaluation's prompts: a jsonl file's held-out rows, or a generated task's from its own seeds."""
        if self.held_out_rows is not None:
            return list(self.held_out_rows)
        return self.task.examples(self.cfg.run.eval_prompts, seed=self.cfg.run.seed + EVAL_SEED_OFFSET)

    def decode(self, ids: torch.Tensor) -> str:
        return self.decode_ids(ids.tolist())

    @property
    def call_end(self) -> tuple[int, ...] | CallEnd:
        """What ends an agent task's tool call (`SamplingConfig.call_end`): the lookup task's `CallEnd`, which reads the
        decoded response, so any tokenizer split of the closing tag ends the call; () for single-turn tasks."""
        return CallEnd(self.decode_ids) if isinstance(self.task, LookupTask) else ()

    def decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def gold(self, example: Example, stop_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An agent task's gold response to `example` as (ids, loss mask): each piece of `task.gold` encoded on its
        own, as the sampler's rollouts put them together (the environment encodes its observation alone), False on
        the environment's pieces, then the first stop id (the policy learns to stop). None for tasks without one."""
        if not isinstance(self.task, LookupTask):
            return None
        ids: list[int] = []
        mask: list[bool] = []
        for text, policy in self.task.gold(example):
            piece = encode(self.tokenizer, text)
            ids += piece
            mask += [policy] * len(piece)
        if stop_ids:
            ids.append(stop_ids[0])
            mask.append(True)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)

    def environment(self, example: Example) -> Environment | None:
        """The agent task's environment for one prompt (`environment.Environment`): sequence i's response so far ->
        the observation's token ids, or None when its episode is over; None for single-turn tasks."""
        task = self.task
        if not isinstance(task, LookupTask):
            return None

        def observe(i: int, response: torch.Tensor) -> torch.Tensor | None:
            text = task.observe(self.decode(response), example)
            return None if text is None else torch.tensor(encode(self.tokenizer, text), dtype=torch.long)

        return observe

    def reward(self, completion: str, example: Example, where: str) -> float:
        """The task's reward of one completion; RewardError naming the function and `where` if it fails."""
        name = repr(self.cfg.task.reward_fn) if self.cfg.task.reward_fn else f"of task {self.cfg.task.task!r}"
        try:
            value = float(self.task.reward(completion, example))
        except Exception as err:
            if isinstance(err, ValueError) and name in str(err):  # the task's own check already names it
                raise RewardError(f"{where}: {err}") from err
            raise RewardError(f"{where}: the reward function {name} raised {type(err).__name__}: {err}") from err
        if not math.isfinite(value):
            raise RewardError(f"{where}: the reward function {name} returned {value}; a reward must be finite")
        return value

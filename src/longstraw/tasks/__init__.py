"""Long-context RL tasks with rewards: prompts whose length is set in tokens, and scorers for decoded completions.

    task = make_task("multikey", tokenizer=tok, prompt_tokens=1024, n_keys=4)
    ex = task.sample(random.Random(0))           # Example(prompt, answer, meta)
    ids = format_prompt(tok, ex.prompt)          # chat-formatted token ids
    r = task.reward(completion_text, ex)         # float in [0, 1]

Tasks: ``passkey`` and ``multikey`` (haystack.py), ``kv`` (kv.py), ``jsonl`` (jsonl.py), and the agent task
``lookup`` (lookup.py: answered with a tool whose results the environment appends). ``make_task`` builds one by
name; options are the task dataclass's fields."""

from __future__ import annotations

import dataclasses
from typing import Any

from longstraw.choices import TASKS
from longstraw.tasks.base import (
    Example,
    Task,
    count_tokens,
    digit_reward,
    first_number,
    format_prompt,
    positional_match,
)
from longstraw.tasks.haystack import MultikeyTask, PasskeyTask, build_haystack
from longstraw.tasks.jsonl import JsonlTask, load_reward_fn
from longstraw.tasks.kv import KVTask
from longstraw.tasks.lookup import LookupTask


def make_task(name: str, **options: Any) -> Task:
    """Build task ``name`` with ``options`` as its dataclass fields, e.g. ``make_task("passkey", tokenizer=tok)``."""
    classes: dict[str, type[PasskeyTask | MultikeyTask | KVTask | JsonlTask | LookupTask]] = {  # dataclasses
        "passkey": PasskeyTask, "multikey": MultikeyTask, "kv": KVTask, "jsonl": JsonlTask, "lookup": LookupTask}
    if name not in classes:
        raise ValueError(f"unknown task {name!r}; valid names: {', '.join(TASKS)}")
    cls = classes[name]
    # A misspelt option would otherwise surface as a TypeError from the generated __init__; name the valid ones.
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for task {name!r}; valid: {', '.join(valid)}")
    return cls(**options)


__all__ = [
    "TASKS", "Example", "JsonlTask", "KVTask", "LookupTask", "MultikeyTask", "PasskeyTask", "Task", "build_haystack",
    "count_tokens", "digit_reward", "first_number", "format_prompt", "load_reward_fn", "make_task",
    "positional_match",
]

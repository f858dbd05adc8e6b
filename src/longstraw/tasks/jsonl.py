"""``jsonl``: user data, one ``{"prompt": ..., "answer": ...}`` object per line, with a built-in or custom reward.

Rewards:

- default: exact match of ``completion.strip()`` with ``answer.strip()``, case-sensitive; 1.0 or 0.0.
- ``normalize=True``: both sides are case-folded, whitespace runs collapse to one space, and trailing ``.`` is
  dropped before comparing ("The Answer." matches "the  answer").
- ``reward_fn="module:function"`` (or ``"path/to/file.py:function"``): imported once, when the task is built, and called
  as ``fn(completion, answer) -> float``. Its value must be a finite real number; it need not lie in [0, 1] (GRPO
  only uses differences within a group). Anything else raises ValueError naming the function.

The whole file is read and checked when the task is built, so a bad line (invalid JSON, a missing or non-string
field, an empty prompt) fails before any training step. Blank lines are skipped; other keys of a line are kept in
``Example.meta`` (with ``line``, the 1-based line number)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from longstraw.tasks.base import Example, Task, check_reward

RewardFn = Callable[[str, str], float]


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``"module:function"`` (a dotted module on sys.path) or ``"path/to/file.py:function"``."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward must be 'module:function' or 'file.py:function', got {spec!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no such file: {path}")
            mod_spec = importlib.util.spec_from_file_location(f"_longstraw_reward_{path.stem}", path)
            assert mod_spec is not None and mod_spec.loader is not None
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_spec.name] = module  # dataclasses/pickling inside the file look themselves up here
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure is the user's module, not ours: say which one
        raise ValueError(f"cannot import reward module {module_name!r} from {spec!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward module {module_name!r} has no attribute {attr!r} (from {spec!r})")
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is a {type(fn).__name__}, not a callable")
    return fn


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold().rstrip(".").rstrip()


def load_rows(path: str | Path) -> list[Example]:
    """Every non-blank line of ``path`` as an Example; ValueError with the line number on the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"jsonl file not found: {path}")
    rows: list[Example] = []
    with path.open("rb") as f:  # bytes, decoded line by line, so an undecodable byte is reported with its line
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}): "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in ("prompt", "answer") if k not in obj]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}; each line needs "
                                 '{"prompt": ..., "answer": ...}')
            for k in ("prompt", "answer"):
                if not isinstance(obj[k], str):
                    raise ValueError(f"{path}:{lineno}: field {k!r} must be a string, got {type(obj[k]).__name__}")
                # JSON's \uXXXX escapes can spell half of a surrogate pair, which is no character: no tokenizer
                # can encode it, so it would fail later without saying where it came from.
                try:
                    obj[k].encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"{path}:{lineno}: field {k!r} holds a lone surrogate "
                                     f"({obj[k][e.start]!r} at character {e.start + 1}), which is not a character: "
                                     "fix the \\u escape (a pair needs both halves)") from None
            if not obj["prompt"].strip():
                raise ValueError(f"{path}:{lineno}: empty prompt; every line needs a non-empty \"prompt\"")
            meta = {k: v for k, v in obj.items() if k not in ("prompt", "answer")}
            meta.update(task="jsonl", line=lineno)
            rows.append(Example(obj["prompt"], obj["answer"], meta))
    if not rows:
        raise ValueError(f"jsonl file {path} has no examples")
    return rows


@dataclass
class JsonlTask(Task):
    """Examples read from ``path``; ``reward_fn`` is None (exact match) or a ``"module:function"`` spec."""

    path: str | Path
    reward_fn: str | None = None
    normalize: bool = False
    rows: list[Example] = field(init=False, repr=False)
    _fn: RewardFn | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.reward_fn is not None and self.normalize:
            raise ValueError("normalize applies to the built-in exact match; a custom reward_fn normalizes itself")
        self.rows = load_rows(self.path)
        self._fn = load_reward_fn(self.reward_fn) if self.reward_fn is not None else None

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, rng: random.Random) -> Example:
        """A uniformly random row (with replacement)."""
        return self.rows[rng.randrange(len(self.rows))]

    def reward(self, completion: str, example: Example) -> float:
        if self._fn is not None:
            return check_reward(self._fn(completion, example.answer), f"reward function {self.reward_fn!r}")
        if self.normalize:
            return float(_normalize(completion) == _normalize(example.answer))
        return float(completion.strip() == example.answer.strip())

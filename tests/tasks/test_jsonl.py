"""jsonl: loading, errors with line numbers, exact/normalized match, module:function rewards."""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

import pytest

from longstraw.tasks import JsonlTask, load_reward_fn, make_task


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    rows = [{"prompt": "2+2?", "answer": "4", "source": "math"}, {"prompt": "Capital of France?", "answer": "Paris"}]
    return _write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows[:1]] + [""] + [json.dumps(rows[1])])


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    """A fresh importable module (unique name: sys.modules caches by name) holding ``body``."""
    name = f"reward_mod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(body, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_jsonl_loads_and_samples(data: Path) -> None:
    task = make_task("jsonl", path=data)
    assert len(task) == 2
    assert task.rows[0].meta == {"source": "math", "task": "jsonl", "line": 1}
    assert task.rows[1].meta["line"] == 3            # the blank line is skipped but still counted
    assert task.examples(5, seed=0) == task.examples(5, seed=0)
    assert {e.answer for e in task.examples(20, seed=1)} == {"4", "Paris"}


def test_jsonl_exact_and_normalized(data: Path) -> None:
    exact, norm = JsonlTask(data), JsonlTask(data, normalize=True)
    ex = exact.rows[1]
    assert exact.reward("  Paris\n", ex) == 1.0
    assert exact.reward("paris", ex) == 0.0
    assert norm.reward("  PARIS. ", ex) == 1.0
    assert norm.reward("Paris, France", ex) == 0.0


@pytest.mark.parametrize("lines, match", [
    (['{"prompt": "a", "answer": "b"}', '{"prompt": "a", "answer": '], r"d\.jsonl:2: invalid JSON"),
    (['{"prompt": "a"}'], r"d\.jsonl:1: missing field\(s\) answer"),
    (['{"answer": "a"}'], r"missing field\(s\) prompt"),
    (['["prompt", "answer"]'], r"d\.jsonl:1: expected a JSON object"),
    (['{"prompt": "a", "answer": 4}'], r"field 'answer' must be a string"),
    ([""], "has no examples"),
])
def test_jsonl_bad_files(tmp_path: Path, lines: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        JsonlTask(_write(tmp_path / "d.jsonl", lines))


def test_jsonl_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="jsonl file not found"):
        JsonlTask(tmp_path / "nope.jsonl")


def test_module_function_reward(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = "def score(completion, answer):\n    return 0.5 if answer in completion else 0\n"
    name = _module(tmp_path, monkeypatch, body)
    task = JsonlTask(data, reward_fn=f"{name}:score")
    ex = task.rows[1]
    assert task.reward("It is Paris.", ex) == 0.5
    assert task.reward("Lyon", ex) == 0.0


def test_file_path_reward(data: Path, tmp_path: Path) -> None:
    f = tmp_path / "my_reward.py"
    f.write_text("def fn(c, a):\n    return float(c == a)\n", encoding="utf-8")
    task = JsonlTask(data, reward_fn=f"{f}:fn")
    assert task.reward("Paris", task.rows[1]) == 1.0


@pytest.mark.parametrize("spec, match", [
    ("no_colon", "must be 'module:function'"),
    (":fn", "must be 'module:function'"),
    ("mod:", "must be 'module:function'"),
    ("surely_not_a_module_xyz:fn", "cannot import reward module 'surely_not_a_module_xyz'"),
    ("json:no_such_function", "has no attribute 'no_such_function'"),
    ("json:__doc__", "not a callable"),
    ("/no/such/file.py:fn", "cannot import reward module.*no such file"),
])
def test_bad_reward_specs(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_reward_fn(spec)


def test_reward_module_that_fails_to_import(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _module(tmp_path, monkeypatch, "raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match=f"cannot import reward module '{name}'.*RuntimeError: boom"):
        JsonlTask(data, reward_fn=f"{name}:fn")


@pytest.mark.parametrize("value, match", [
    ("float('nan')", "must be finite"),
    ("float('inf')", "must be finite"),
    ("'1.0'", "must be a real number"),
    ("None", "must be a real number"),
    ("[1.0]", "must be a real number"),
])
def test_reward_function_bad_values(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str,
                                    match: str) -> None:
    name = _module(tmp_path, monkeypatch, f"def fn(c, a):\n    return {value}\n")
    task = JsonlTask(data, reward_fn=f"{name}:fn")
    with pytest.raises(ValueError, match=f"reward function '{name}:fn' returned.*{match}"):
        task.reward("x", task.rows[0])


def test_custom_reward_and_normalize_conflict(data: Path) -> None:
    with pytest.raises(ValueError, match="normalize"):
        JsonlTask(data, reward_fn="json:dumps", normalize=True)


def test_sample_uses_rng(data: Path) -> None:
    task = JsonlTask(data)
    assert task.sample(random.Random(0)) == task.sample(random.Random(0))


def test_undecodable_bytes_and_lone_surrogates_name_file_and_line(tmp_path: Path) -> None:
    """latin-1 bytes (not UTF-8) and a JSON escape of half a surrogate pair (no character; no tokenizer encodes
    it) are refused when the file is read, naming file, line and field, never as a bare codec error later."""
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "a", "answer": "b"}\n{"prompt": "caf\xe9", "answer": "b"}\n')
    with pytest.raises(ValueError, match=rf"{latin}:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        make_task("jsonl", path=latin)
    lone = _write(tmp_path / "lone.jsonl", ['{"prompt": "ok", "answer": "b"}', '{"prompt": "x", "answer": "a\\ud800"}'])
    with pytest.raises(ValueError, match=rf"{lone}:2: field 'answer' holds a lone surrogate .* at character 2"):
        make_task("jsonl", path=lone)
    pair = _write(tmp_path / "pair.jsonl", ['{"prompt": "\\ud83d\\ude00", "answer": "b"}'])
    assert make_task("jsonl", path=pair).rows[0].prompt == "\U0001f600"  # both halves: one character

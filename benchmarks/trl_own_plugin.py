"""The pytest plugin of `benchmarks.trl_own_tests` (step 3), loaded in its pytest processes with
`-p benchmarks.trl_own_plugin`: TRL's trainer swapped for LongStraw's (run `ours`), the Hub's datasets read from the
local stand-ins, missing availability checks answered, a time limit per test, and one JSON report line per test."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.trl_own_stand_ins import NO_STAND_IN, ORG

ENV_PREFIX = "TRL_OWN_TESTS_"

# --------------------------------------------------------------------------------------------------------------------
# 3. The pytest plugin (loaded in the test processes with -p benchmarks.trl_own_plugin)
# --------------------------------------------------------------------------------------------------------------------


def _env(name: str, default: str = "") -> str:
    return os.environ.get(ENV_PREFIX + name, default)


def _redirect_datasets() -> None:
    """`load_dataset("trl-internal-testing/zen", config, ...)` reads the local stand-in; other ids are refused."""
    import datasets

    original = datasets.load_dataset
    root = Path(_env("DATASETS"))

    def load_dataset(path: str, name: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(path, str) or not path.startswith(f"{ORG}/"):
            return original(path, name, *args, **kwargs)
        folder = root / (name or "")
        if path != f"{ORG}/zen" or not folder.is_dir():
            raise StandInMissing(f"{path} ({name}): {NO_STAND_IN}")
        files = {split: str(folder / f"{split}.jsonl") for split in ("train", "test")}
        return original("json", *args, data_files=files, **kwargs)

    datasets.load_dataset = load_dataset


class StandInMissing(RuntimeError):
    """A test asked for a Hub model or dataset that has no stand-in here."""


class TestTimeout(BaseException):
    """The test ran past the harness's limit (a BaseException, so that the test's own `except Exception` does not
    swallow it)."""

    __test__ = False


def _swap() -> None:
    """`trl.GRPOTrainer` / `trl.GRPOConfig` become LongStraw's, before the test module's `from trl import ...`."""
    import trl

    from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer

    setattr(trl, "GRPOTrainer", LongStrawGRPOTrainer)  # noqa: B010 (mypy: the names are types)
    setattr(trl, "GRPOConfig", LongStrawGRPOConfig)  # noqa: B010


def _availability_fallback() -> None:
    """`trl.import_utils.is_<package>_available` for the checks the test file's helpers import that the installed
    TRL does not define (the test file is from another release): whether the package is importable."""
    import importlib.util

    module = importlib.import_module("trl.import_utils")

    def fallback(name: str) -> Callable[[], bool]:
        match = re.fullmatch(r"is_(\w+)_available", name)
        if match is None:
            raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")
        return lambda: importlib.util.find_spec(match.group(1)) is not None

    module.__getattr__ = fallback  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    if not _env("RESULTS"):
        return  # imported, not running under the harness
    _availability_fallback()
    _redirect_datasets()
    if _env("SWAP") == "1":
        _swap()


def _missing_names(item: pytest.Item) -> list[str]:
    """The trl-internal-testing ids a test names (in its parameters or its body, decorators left out) that have no
    stand-in here."""
    import inspect

    built = set(_env("BUILT").split(",")) | {"zen"}
    texts = [str(v) for v in getattr(getattr(item, "callspec", None), "params", {}).values()]
    function = getattr(item, "function", None)
    if function is not None:
        with contextlib.suppress(OSError, TypeError):
            source = inspect.getsource(function)
            texts.append(source[source.find("def "):])
    names = {name for text in texts for name in re.findall(ORG + r"/([A-Za-z0-9_.\-]+)", text)}
    return sorted(names - built)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _env("RESULTS"):
        return
    for item in items:
        missing = _missing_names(item)
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"not runnable here: {', '.join(missing)}: {NO_STAND_IN}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    limit = int(_env("TIMEOUT", "0"))

    def expire(signum: int, frame: Any) -> None:
        raise TestTimeout(f"the test ran past {limit} s")

    previous = signal.signal(signal.SIGALRM, expire) if limit else None
    if limit:
        signal.alarm(limit)
    try:
        yield
    finally:
        if limit:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _exception_text(value: BaseException) -> str:
    """The exception and those chained to it, as `Type: message` lines."""
    out, seen, todo = [], set(), [value]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        out.append(f"{type(exc).__name__}: {exc}")
        todo.extend([exc.__cause__, exc.__context__])  # type: ignore[list-item]
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    path = _env("RESULTS")
    if not path:
        return
    report = outcome.get_result()
    record: dict[str, Any] = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                              "duration": round(report.duration, 2)}
    if hasattr(report, "wasxfail"):
        record["xfail"] = report.wasxfail
    if report.skipped and isinstance(report.longrepr, tuple):
        record["reason"] = str(report.longrepr[2])
    if call.excinfo is not None and not report.skipped:
        record["exception"] = _exception_text(call.excinfo.value)[:4000]
    if report.outcome != "passed" or report.when == "call":
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

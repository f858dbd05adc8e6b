"""The planner's argument types: memory sizes such as 96GB (`parse_size`) and integer bounds (`positive_int`,
`non_negative_int`), shared by `longstraw plan`, its `--tree` form and the benchmarks' command lines."""

from __future__ import annotations

import argparse
import re

from longstraw.planner.estimator import GIB, MIB

_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": MIB, "GIB": GIB, "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'96GB' (10^9), '24GiB' (2^30), '512MiB', '1.5TB' -> bytes. A unit is required."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(
            f"cannot read memory size {text!r}: write a number and a unit, e.g. 96GB, 80GiB, 512MiB "
            f"(units: {', '.join(u if u.endswith('B') and len(u) < 4 else u[:-2] + 'iB' for u in _UNITS)})"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value)


def _int_at_least(text: str, least: int) -> int:
    """argparse type body: an integer >= `least`, else ArgumentTypeError saying what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (shared by the planner's and the benchmarks' command lines)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (--keep-prompt-graph here, bench peers --neighbours, bench pareto)."""
    return _int_at_least(text, 0)

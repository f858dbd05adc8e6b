"""`longstraw.choices.int_at_least`: the one check of an integer count, and the refusals it gives its callers."""

from __future__ import annotations

import pytest

from longstraw.choices import int_at_least
from longstraw.engine.sampling import SamplingConfig


def test_an_integer_at_or_above_the_bound_is_returned() -> None:
    assert int_at_least("n", 3, 3) == 3
    assert int_at_least("n", 0, 0) == 0


@pytest.mark.parametrize("value", [True, False, 2.0, "2", None, 1])
def test_bools_floats_other_types_and_values_below_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match=rf"^n must be an integer >= 2 \(a count\), got {value!r}$"):
        int_at_least("n", value, 2, " (a count)")


def test_the_sampler_refuses_a_bool_count_and_a_negative_top_k() -> None:
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got True"):
        SamplingConfig(max_new_tokens=True)
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 0 \(0 disables it\), got -1"):
        SamplingConfig(top_k=-1)

"""Option values that would only fail later, inside a forward, are refused when the options are built."""

from __future__ import annotations

import pytest

from longstraw.choices import MIN_TEMPERATURE
from longstraw.engine.options import BackwardOptions
from longstraw.engine.sampling import SamplingConfig


@pytest.mark.parametrize("build", [SamplingConfig, BackwardOptions], ids=["SamplingConfig", "BackwardOptions"])
@pytest.mark.parametrize("temperature", [1e-45, 1e-4, 0.0, -1.0, float("nan")])
def test_a_temperature_below_the_floor_is_refused_when_built(build, temperature):
    """1e-45 turns every logit / temperature into inf (NaN probabilities, an inf log-prob error later): the same floor
    as `train --temperature`, one line saying what to pass."""
    with pytest.raises(ValueError, match=rf"temperature must be (a finite number )?>= {MIN_TEMPERATURE}, got"):
        build(temperature=temperature)


@pytest.mark.parametrize("build", [SamplingConfig, BackwardOptions], ids=["SamplingConfig", "BackwardOptions"])
def test_the_floor_itself_is_accepted(build):
    assert build(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE

"""Fixtures shared by every test; the helpers they use are in helpers.py."""

from __future__ import annotations

import pytest
import torch
from helpers import faithful_float64

from longstraw import load_model


@pytest.fixture(scope="session")
def tiny_llama64():
    return faithful_float64(load_model("tiny-llama", dtype="float64"))


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """Every test runs with one intra-op thread: the tiny models here spend more time in OpenMP's barriers than in
    arithmetic with two (100x slower steps when another process holds a core), and results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """Tiny models step ~100x faster with one intra-op thread on a busy 2-core host."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


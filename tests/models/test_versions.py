"""The transformers releases LongStraw runs on: the oldest it accepts at import, the later minimum of some model types
(refused before any state is built, saying what to install), and the name under which each model takes its cache.
Runs on the pinned transformers (`make test`) and on the oldest supported one (`make test-oldest`)."""

import re
import types

import pytest
import torch
import transformers
from packaging.version import Version

from longstraw import Group, backward_group
from longstraw.admission.admission import check_architecture
from longstraw.models.architecture import (
    CI_TRANSFORMERS,
    MIN_TRANSFORMERS,
    MIN_TRANSFORMERS_BY_MODEL_TYPE,
    SUPPORTED_MODEL_TYPES,
    TESTED_ON_OLDEST,
    cache_keyword,
    check_transformers,
    on_the_ci_list,
    transformers_too_old,
)


def test_an_older_transformers_is_refused_with_the_version_to_install():
    for old in ("5.5.2", "5.4.0", "4.57.6"):
        with pytest.raises(ImportError, match=r"transformers >= 5\.5\.3 \(found " + re.escape(old) + r"\).*pip "):
            check_transformers(old)
    for ok in ("5.5.3", "5.10.4", "5.24.0", "5.24.1.dev0", "6.0.0"):
        check_transformers(ok)
    assert MIN_TRANSFORMERS == (5, 5, 3)


def test_model_types_that_need_a_later_transformers_are_refused_below_it():
    """Every entry of the table: refused one release below its minimum, naming the model type, the minimum, the
    version found and the pip command; accepted from the minimum on. Only supported types are listed."""
    assert MIN_TRANSFORMERS_BY_MODEL_TYPE and set(MIN_TRANSFORMERS_BY_MODEL_TYPE) <= set(SUPPORTED_MODEL_TYPES)
    for model_type, ((major, minor, patch), _) in MIN_TRANSFORMERS_BY_MODEL_TYPE.items():
        need = f"{major}.{minor}" + (f".{patch}" if patch else "")
        below = f"{major}.{minor - 1}.9"
        why = transformers_too_old(model_type, below)
        assert why is not None and why.startswith(f"{model_type} needs transformers >= {need} for LongStraw")
        assert f"(found {below})" in why and f"pip install 'transformers>={need},<6'" in why
        assert transformers_too_old(model_type, need) is None and transformers_too_old(model_type, "5.24.0") is None
    assert transformers_too_old("llama", "5.5.3") is None


def _stub(model_type: str) -> torch.nn.Module:
    module = torch.nn.Module()
    module.config = types.SimpleNamespace(model_type=model_type)  # type: ignore[assignment]
    return module


def test_check_architecture_refuses_model_types_too_new_for_this_transformers():
    """On this transformers: each supported model type whose minimum is later is refused by check_architecture (the
    first check backward_group makes) with the table's message; the others pass that check (the stub then fails a
    later one, that it is no causal LM)."""
    for model_type in SUPPORTED_MODEL_TYPES:
        why = transformers_too_old(model_type)
        if why is None and not on_the_ci_list(model_type):
            continue  # off the CI list on this transformers: its config is checked (tests/models/test_verify.py)
        with pytest.raises(ValueError) as error:
            check_architecture(_stub(model_type), 10)
        if why is not None:
            assert str(error.value) == why
        else:
            assert "not a causal LM" in str(error.value)


def test_a_refused_model_type_is_refused_before_any_forward():
    """The b1-qwen3-next preset (Qwen3-Next needs a later transformers than 5.5.3): on a transformers too old for
    it, load_model raises the table's error (it admits the model once built, before any forward); on a recent one the
    step runs."""
    from longstraw import load_model

    why = transformers_too_old("qwen3_next")
    if why is not None:
        with pytest.raises(ValueError, match=re.escape(why)):
            load_model("b1-qwen3-next", dtype="float32")
        return
    model = load_model("b1-qwen3-next", dtype="float32")
    group = Group(prompt=torch.arange(40), responses=[torch.arange(5)], advantages=torch.tensor([1.0]))
    backward_group(model, group, plan="exact", chunk_size=16)


def test_the_cache_keyword_is_read_from_the_forward_signature():
    """`cache` from transformers 5.24, `past_key_values` before (Mamba2: `cache_params`); a forward that takes none
    of them is refused, naming the class and this transformers."""
    from longstraw import load_model

    llama = load_model("tiny-llama")
    name = cache_keyword(llama.model)
    assert name in ("cache", "past_key_values") and cache_keyword(llama) == name
    assert name == ("cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values")

    class NoCache(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids

    with pytest.raises(TypeError, match=r"NoCache\.forward takes no cache argument .* on transformers "
                                        + re.escape(transformers.__version__)):
        cache_keyword(NoCache())


def test_the_ci_list_is_the_pinned_transformers_and_the_oldest_tested_families():
    """The fast path: every supported type on the transformers constraints.txt pins; on another release only the
    types `make test-oldest` covers, the others being checked like any model."""
    from pathlib import Path

    pins = (Path(__file__).resolve().parents[2] / "constraints.txt").read_text()
    assert f"transformers=={CI_TRANSFORMERS}\n" in pins
    assert set(TESTED_ON_OLDEST) <= set(SUPPORTED_MODEL_TYPES)
    assert all(on_the_ci_list(t, CI_TRANSFORMERS) for t in SUPPORTED_MODEL_TYPES)
    assert on_the_ci_list("llama", "5.10.4") and not on_the_ci_list("diffllama", CI_TRANSFORMERS)
    assert all(not on_the_ci_list(t, "5.10.4") for t in SUPPORTED_MODEL_TYPES if t not in TESTED_ON_OLDEST)

"""Which layers reuse another layer's K/V (Gemma-4's `num_kv_shared_layers`) and whose prompt K/V they read; the end
to end parity of a model with shared layers is the `gemma4` family of test_architectures.py."""

from types import SimpleNamespace

import pytest

from longstraw.engine.state.sharing import kv_shared_layers, kv_source


def _config(shared: int) -> SimpleNamespace:
    kinds = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    first = len(kinds) - shared
    modes: list[str | None] = [None if i < first else "reuse" for i in range(len(kinds))]
    for kind in set(kinds):  # the last layer of each kind before the shared ones stores its K/V
        modes[max(i for i in range(first) if kinds[i] == kind)] = "store"
    return SimpleNamespace(model_type="gemma4_text", num_hidden_layers=len(kinds), num_kv_shared_layers=shared,
                           layer_types=kinds, kv_sharing_modes=modes)


def test_shared_layers_are_the_last_ones_and_read_their_kinds_store_layer():
    config = _config(3)
    assert kv_shared_layers(config) == frozenset({2, 3, 4})
    attention = [SimpleNamespace(config=config, is_kv_shared_layer=i >= 2) for i in range(5)]
    assert [kv_source(attention[i], i) for i in range(5)] == [0, 1, 0, 1, 0]
    assert kv_shared_layers(_config(0)) == frozenset()
    assert kv_shared_layers(SimpleNamespace(num_hidden_layers=4)) == frozenset()  # a family without sharing


def test_a_model_whose_every_layer_reuses_outside_kv_is_refused():
    with pytest.raises(ValueError, match="num_kv_shared_layers=5 of 5 layers reads every layer's K/V from another"):
        kv_shared_layers(SimpleNamespace(model_type="gemma4_text", num_hidden_layers=5, num_kv_shared_layers=5))

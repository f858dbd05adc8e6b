"""load_model: presets, local directories, errors."""

import pytest
import torch

from longstraw import load_model
from longstraw.models import PRESETS


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_presets_are_seeded_eval_and_trainable(name):
    a, b = load_model(name, seed=1), load_model(name, seed=1)
    c = load_model(name, seed=2)
    assert not a.training
    assert all(p.requires_grad for p in a.parameters())
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_dtype_and_local_directory_round_trip(tmp_path):
    model = load_model("tiny-llama", dtype="float64")
    assert next(model.parameters()).dtype == torch.float64
    model.save_pretrained(tmp_path)
    again = load_model(str(tmp_path), dtype=torch.float64)
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p, q)
    assert not again.training and all(p.requires_grad for p in again.parameters())


def test_b1_preset_matches_design():
    cfg = PRESETS["b1-llama"]()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (4, 256, 8, 2, 704, 32000)


def test_errors():
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("tiny-llama", dtype="float8")
    with pytest.raises(FileNotFoundError, match="GGUF"):
        load_model("/nonexistent/model.gguf")

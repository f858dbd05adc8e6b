"""load_model: presets, local directories, errors."""

import time

import pytest
import torch

from longstraw import load_model
from longstraw.models.presets import PRESETS


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


@pytest.mark.parametrize("name,match", [
    ("no-such-model", r"'no-such-model' is not a preset \(tiny-llama, tiny-qwen3"),
    ("./missing/model-dir", "no such directory exists either"),
    (__file__, "is a file: a local model is a directory"),
])
def test_unknown_model_fails_at_once_listing_the_presets(name, match):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        load_model(name)
    assert time.perf_counter() - t0 < 0.5  # no network, no retries


def test_uncached_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set.*tiny-llama"):
        load_model("longstraw-tests/no-such-model")
    assert time.perf_counter() - t0 < 2.0


def test_uncached_hub_id_online_fails_fast(monkeypatch):
    """Without network (this machine) the hub is unreachable; with network the id does not exist. Either way a
    ValueError within seconds, not transformers' ~30 s of retries and a traceback."""
    import longstraw.models.sources as models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(models, "HUB_TIMEOUT_S", 1.0)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="could not be reached within 1 s|was not found on the Hugging Face Hub"):
        load_model("longstraw-tests/no-such-model-3f9a1c")
    assert time.perf_counter() - t0 < 2.0

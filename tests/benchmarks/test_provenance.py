"""`python -m benchmarks provenance --smoke`: the provenance capture and check timed on a materialised model, table
and JSON written."""

import json

import pytest

from benchmarks.__main__ import main
from benchmarks.provenance import build_model


def test_bench_provenance_smoke(tmp_path, capsys):
    out = tmp_path / "provenance.json"
    assert main(["provenance", "--smoke", "--repeats", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    result = doc["result"]
    assert doc["bench"] == "provenance"
    for timed in ("capture", "check"):
        assert len(result[timed]["times_ms"]) == 3 and result[timed]["median_ms"] > 0
    assert result["tensors"] == 2 * 12 + 2  # per layer: q/k/v weight and bias, o, 3 MLP, 2 norms; embedding, norm
    assert result["buffers"] == 2  # the rotary embedding's inv_freq and original_inv_freq
    assert result["module_attributes"] > 0 and result["config_entries"] > 0
    assert "load average" in doc["uptime_before"] and "load average" in doc["uptime_after"]
    assert "| smoke | float32 | 0.00B | 26 + 2 buffers |" in capsys.readouterr().out


def test_the_measured_model_has_real_tied_weights():
    """Every parameter holds data (not meta, not empty), and the output projection stays tied to the embedding."""
    from benchmarks.provenance import SHAPES

    model = build_model(SHAPES["smoke"], "float32")
    assert all(not p.is_meta and float(p.abs().sum()) > 0 for p in model.parameters())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_repeats_below_one_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["provenance", "--smoke", "--repeats", "0", "--out", str(tmp_path / "p.json")])
    assert stop.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

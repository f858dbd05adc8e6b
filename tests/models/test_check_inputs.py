"""`longstraw check` on any input: a bad config, file or option is one line saying what to change (exit 2, no
traceback) before any check runs; a config of any depth is checked in seconds; a hub id that cannot be reached fails
at once."""

from __future__ import annotations

import json
import time

import pytest
import transformers

from longstraw import cli
from longstraw.admission.tiny import tiny_config

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path / "cache"))


def _refused(capsys, argv: list[str]) -> str:
    """The error line of a `longstraw` command refused before it ran (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    first = err.splitlines()[0]
    assert first.startswith("longstraw check: error: ") and len(err.splitlines()) == 2, err  # the line and usage
    return first


@pytest.mark.parametrize("values, message", [
    ({"hidden_size": 1e9}, "transformers refuses this config: Validation error for field 'hidden_size': TypeError: "
                           "Field 'hidden_size' expected int, got float"),
    ({"num_hidden_layers": "2"}, "Field 'num_hidden_layers' expected int, got str"),
    ({"model_type": "qwen3_next", "layer_types": ["full_attention"], "num_hidden_layers": 3},
     "`num_hidden_layers` (3) must be equal to the number of `layer_types` (1)"),
    ({"vocab_size": 0}, "vocab_size = 0; a model needs vocab_size >= 1"),
    ({"num_key_value_heads": 3}, "3 key-value heads do not divide 4 attention heads"),
    ({"rope_theta": float("nan")}, "rope_theta = nan; every number of a config must be finite"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps = -1e-06; a norm's epsilon must be >= 0"),
    ({"rope_theta": -1.0}, "rope_theta = -1.0; the rotary base must be > 0"),
    ({"model_type": "lama"}, "model_type 'lama' (did you mean llama"),
])
def test_a_bad_config_is_one_line_naming_the_field(tmp_path, capsys, values, message):
    """Transformers' strict validation, a zero vocabulary, heads that do not divide, a NaN or a negative epsilon:
    one line naming the file and the field, not a traceback, a tensor-size crash or a float64 overflow."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **values}))
    for model in (str(tmp_path), str(path)):  # the directory and the config.json itself
        line = _refused(capsys, ["check", model])
        assert message in line and str(path) in line, line
        assert len(line) < 600  # not transformers' list of every model type


def test_an_unreadable_config_or_a_missing_gguf_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").mkdir()  # exists, cannot be read as a file
    assert "config.json: cannot be read" in _refused(capsys, ["check", str(tmp_path)])
    assert "GGUF file" in _refused(capsys, ["check", str(tmp_path / "nothing.gguf")])


def test_options_are_checked_before_the_check_runs(tmp_path, capsys, monkeypatch):
    from longstraw.admission import verify

    monkeypatch.setattr(verify, "verify", lambda *a, **k: pytest.fail("the check ran"))
    line = _refused(capsys, ["check", "tiny-llama", "--out", str(tmp_path / "no" / "such" / "dir" / "v.json")])
    assert "--out" in line and "does not exist" in line
    assert "is a directory" in _refused(capsys, ["check", "tiny-llama", "--out", str(tmp_path)])
    assert "--markdown goes with --all" in _refused(capsys, ["check", "tiny-llama", "--markdown",
                                                             str(tmp_path / "t.md")])


def test_an_unreachable_hub_id_fails_at_once(capsys, monkeypatch):
    """A hub id not in the local cache: one line within seconds (offline, or no network), not ~30 s of retries."""
    started = time.perf_counter()
    line = _refused(capsys, ["check", "longstraw-tests/no-such-model-r48"])
    assert "no-such-model-r48" in line and time.perf_counter() - started < 15
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    assert "HF_HUB_OFFLINE is set" in _refused(capsys, ["check", "longstraw-tests/no-such-model-r48"])
    assert time.perf_counter() - started < 5


def test_a_config_of_any_depth_is_shrunk_in_seconds():
    """100,000 layers: the layer kinds are read from a short meta-device prefix, never the full depth."""
    values = {k: v for k, v in LLAMA.items() if k != "model_type"}
    deep = transformers.AutoConfig.for_model("llama", **{**values, "num_hidden_layers": 100_000})
    started = time.perf_counter()
    tiny, note = tiny_config(deep)
    assert time.perf_counter() - started < 10
    assert tiny.num_hidden_layers == 2 and note == "2 of 100000 layers (1 layer kinds)"
    gemma = transformers.AutoConfig.for_model("gemma3_text", num_hidden_layers=1000)  # 5 sliding, 1 full, repeated
    tiny, note = tiny_config(gemma)
    assert tiny.layer_types == gemma.layer_types[:6] and note.startswith("6 of 1000 layers")
    late = ["full_attention"] * 999 + ["sliding_attention"]  # a kind only the last layer has: cut, and said
    qwen = transformers.AutoConfig.for_model("qwen2", num_hidden_layers=1000, layer_types=late,
                                             use_sliding_window=True, sliding_window=64)
    tiny, note = tiny_config(qwen)
    assert note == "12 of 1000 layers: the layer-kind pattern (1 kinds) is cut" and tiny.num_hidden_layers == 12


def test_a_deep_config_is_checked_in_seconds(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 100_000}))
    started = time.perf_counter()
    assert cli.main(["check", str(tmp_path)]) == 0
    assert "2 of 100000 layers" in capsys.readouterr().out and time.perf_counter() - started < 30

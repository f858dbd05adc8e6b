"""`longstraw plan` on a bad config file: one line naming the file (and line), never a traceback."""

from __future__ import annotations

import json

import pytest

from longstraw import cli

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}


def _plan(model: str) -> list[str]:
    return ["plan", "--model", model, "--prompt-tokens", "100", "--response-tokens", "10", "--group-size", "2"]


@pytest.mark.parametrize("write, message", [
    (lambda p: p.write_text(json.dumps({**LLAMA, "num_attention_heads": 0})), "{}: num_attention_heads = 0; a model "
     "needs at least one head"),
    (lambda p: p.write_text(json.dumps({**LLAMA, "num_key_value_heads": 0})), "{}: num_key_value_heads = 0"),
    (lambda p: p.write_text(json.dumps({**LLAMA, "head_dim": 0})), "{}: head_dim = 0; a model needs head_dim >= 1"),
    (lambda p: p.write_text(json.dumps({**LLAMA, "hidden_size": 0})), "{}: hidden_size = 0; a model needs "
     "hidden_size >= 1"),
    (lambda p: p.write_text(json.dumps({**LLAMA, "num_hidden_layers": 0})), "{}: num_hidden_layers = 0; a model "
     "needs num_hidden_layers >= 1"),
    (lambda p: p.write_text('{"model_type": "llama",\n"hidden_size": 64,\n'), "{}:3: not valid JSON"),
    (lambda p: p.write_bytes(b'{"model_type": "llama",\n"name": "caf\xe9"}'), "{}:2: not UTF-8 (byte 0xe9)"),
])
def test_a_bad_config_json_is_one_line_naming_the_file(tmp_path, capsys, write, message):
    """Zero heads, head_dim, hidden_size or layers: one line naming the file and the field, never transformers' or
    the planner's ZeroDivisionError or ValueError traceback; a JSON error names the file and line."""
    path = tmp_path / "config.json"
    write(path)
    for model in (str(path), str(tmp_path)):  # a config.json file, and the directory holding it
        with pytest.raises(SystemExit) as exit_info:
            cli.main(_plan(model))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message.format(path) in err and "Traceback" not in err


def test_a_sound_config_json_still_plans(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    assert cli.main(_plan(str(path))) == 0
    assert "fits" in capsys.readouterr().out

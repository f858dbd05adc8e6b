"""A model's own Python code never runs: a config.json whose `auto_map` names classes for a model type transformers
does not implement is refused in one line by `check`, `plan`, `train` and `load_model`, without a prompt and without
importing the file, even with `y` on stdin; an `auto_map` beside a type transformers implements loads transformers'
classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longstraw import load_model
from longstraw.admission.loading import declared_max_positions
from longstraw.models.tokenizer import load_tokenizer
from longstraw.planner.spec import load_config

LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 100}


def _custom(folder: Path, model_type: str) -> Path:
    """A model folder whose config maps its classes to custom.py, which leaves a marker file when imported."""
    marker = folder / "IMPORTED"
    (folder / "custom.py").write_text(
        f"open({str(marker)!r}, 'w').write('custom code ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        f"class CustomConfig(LlamaConfig):\n    model_type = {model_type!r}\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    auto_map = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel",
                "AutoTokenizer": ["custom.CustomTokenizer", None]}
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "auto_map": auto_map, **LLAMA}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map["AutoTokenizer"]}))
    return marker


def test_custom_code_is_refused_in_one_line_and_never_imported(tmp_path):
    marker = _custom(tmp_path, "custom_llama")
    for load in (load_config, load_model, declared_max_positions):
        with pytest.raises(ValueError) as err:
            load(str(tmp_path))
        message = str(err.value)
        assert "needs custom code (config.json's auto_map: custom.CustomConfig" in message, message
        assert "LongStraw does not run" in message and "\n" not in message
    with pytest.raises(Exception):  # noqa: B017 (whatever transformers raises: it must not import the file)
        load_tokenizer(str(tmp_path))
    assert not marker.exists()


def test_an_auto_map_beside_a_known_type_loads_transformers_own_classes(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(tmp_path)
    marker = _custom(tmp_path, "llama")
    assert type(load_config(str(tmp_path))).__name__ == "LlamaConfig"
    assert type(load_model(str(tmp_path))).__name__ == "LlamaForCausalLM"
    assert not marker.exists()


@pytest.mark.parametrize("argv", [["check"], ["plan", "--prompt-tokens", "100", "--response-tokens", "10",
                                                            "--group-size", "2", "--model"],
                                  ["train", "--steps", "1", "--run-dir", "RUN", "--model"]])
def test_the_commands_refuse_custom_code_with_yes_on_stdin(tmp_path, argv):
    """The prompt transformers shows without `trust_remote_code=False` would read this `y` and import the file."""
    model = tmp_path / "model"
    model.mkdir()
    marker = _custom(model, "custom_llama")
    argv = [str(tmp_path / "run") if word == "RUN" else word for word in argv]
    out = subprocess.run([sys.executable, "-m", "longstraw.cli", *argv, str(model)], input="y\n", text=True,
                         capture_output=True, timeout=120,
                         env={**os.environ, "LONGSTRAW_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 2 and not marker.exists(), out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "needs custom code" in errors[0] and "Traceback" not in out.stderr, out.stderr
    assert "[y/N]" not in out.stdout + out.stderr
    assert not (tmp_path / "run").exists()

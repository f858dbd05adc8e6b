"""Sampling from one prompt prefill: log-probs equal a full forward, seeds reproduce, one capture only."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_model

import longstraw.engine.sampling as rollout
from longstraw import Group, backward_group
from longstraw.engine.sampling import SamplingConfig, _filter_logits, sample_group


def _full_logprobs(model, prompt, response):
    ids = torch.cat([prompt, response])[None]
    logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, response[:, None]).squeeze(1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sampled_logprobs_equal_full_forward(family):
    model = tiny_model(family)
    prompt = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(0))
    out = sample_group(model, prompt, 3, SamplingConfig(max_new_tokens=12), seed=1, chunk_size=16)
    assert len(out.responses) == 3
    for resp, lp in zip(out.responses, out.logprobs):
        assert resp.numel() == 12 and lp.shape == resp.shape
        with torch.no_grad():
            assert (lp - _full_logprobs(model, prompt, resp)).abs().max() < 1e-10


def test_seed_reproduces_and_changes_samples():
    model = tiny_model("llama", dtype=torch.float32)
    prompt = torch.arange(20)
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.5, top_k=50, top_p=0.9)
    a = sample_group(model, prompt, 4, cfg, seed=3)
    b = sample_group(model, prompt, 4, cfg, seed=3)
    c = sample_group(model, prompt, 4, cfg, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))
    assert not all(torch.equal(x, y) for x, y in zip(a.responses, c.responses))


def test_stop_ids_end_responses_and_prompt_is_captured_once(monkeypatch):
    model = tiny_model("llama", dtype=torch.float32)
    calls = []
    real = rollout.capture_prompt
    monkeypatch.setattr(rollout, "capture_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt = torch.arange(30)
    # Every token is a stop token: each response is exactly one token long.
    out = sample_group(model, prompt, 5, SamplingConfig(max_new_tokens=6, stop_ids=tuple(range(512))), seed=0)
    assert calls == [1]
    assert all(r.numel() == 1 for r in out.responses)


def test_rollout_state_feeds_the_training_step():
    """The sampler's captured state can be reused by backward_group: same gradient as capturing again."""
    model = tiny_model("llama")
    prompt = torch.randint(0, 512, (33,), generator=torch.Generator().manual_seed(5))
    out = sample_group(model, prompt, 3, SamplingConfig(max_new_tokens=5), seed=0, chunk_size=8)
    group = Group(prompt, out.responses, torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64),
                  old_logprobs=out.logprobs)
    model.zero_grad(set_to_none=True)
    backward_group(model, group, plan="exact", chunk_size=8)
    fresh = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    backward_group(model, group, plan="exact", chunk_size=8, prompt_state=out.state)
    for a, p in zip(fresh, model.parameters()):
        assert (a - p.grad).abs().max() < 1e-12
    model.zero_grad(set_to_none=True)


def test_filters_and_bad_config():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(_filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    probs = torch.softmax(logits, -1)[0]
    keep = _filter_logits(logits, 0, float(probs[0]) + 1e-6)  # needs the top two to reach top_p
    assert torch.isinf(keep).tolist() == [[False, False, True, True]]
    for bad in (dict(max_new_tokens=0), dict(temperature=0.0), dict(top_p=0.0), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_score_responses_equals_full_forward():
    model = tiny_model("qwen3")
    prompt = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(2))
    responses = [torch.tensor([5, 6, 7]), torch.tensor([9])]
    scored = rollout.score_responses(model, prompt, responses, chunk_size=8, micro_batch=2)
    with torch.no_grad():
        for lp, r in zip(scored, responses):
            assert (lp - _full_logprobs(model, prompt, r)).abs().max() < 1e-10


# ---------------------------------------------------------------------------------------- multi-turn rollouts

class _Lookup:
    """A deterministic environment: the observation for sequence i's k-th call is 5 + k tokens derived from i and
    k; the third call ends the episode. Records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, i: int, response: torch.Tensor) -> torch.Tensor | None:
        k = sum(1 for j, _ in self.calls if j == i)
        self.calls.append((i, response.numel()))
        if k == 2:
            return None
        return torch.tensor([(7 * i + 11 * k + t) % 500 for t in range(5 + k)])


def _call_token(model, prompt, cfg) -> int:
    """The token the model samples most often at this setting: a tool call's end that will occur."""
    free = sample_group(model, prompt, 6, cfg, seed=2, chunk_size=8)
    return int(torch.cat(free.responses).bincount().argmax())


def test_multi_turn_rollout_feeds_observations_into_each_sequences_state(monkeypatch):
    """Observation tokens appear verbatim after each tool call, masked; their sequences' later tokens were decoded
    from a state that holds them (the recorded log-probs equal a full forward over prompt + response); the prompt
    is captured once and its state does not grow with G."""
    model = tiny_model("llama")
    prompt = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(4))
    base = SamplingConfig(max_new_tokens=48, temperature=1.0, top_k=3)
    call = _call_token(model, prompt, base)
    cfg = SamplingConfig(max_new_tokens=48, temperature=1.0, top_k=3, call_end=(call,), max_turns=3)
    captures = []
    real = rollout.capture_prompt
    monkeypatch.setattr(rollout, "capture_prompt", lambda *a, **k: captures.append(1) or real(*a, **k))
    env = _Lookup()
    out = sample_group(model, prompt, 4, cfg, seed=1, chunk_size=8, environment=env)
    assert captures == [1] and env.calls, "no tool call happened: the test needs one"
    assert out.loss_masks is not None and out.turns is not None
    for i, (resp, mask, lp) in enumerate(zip(out.responses, out.loss_masks, out.logprobs)):
        assert mask.shape == resp.shape and bool(mask[0])
        observed = resp[~mask]
        calls = [n for j, n in env.calls if j == i]
        expected = [t for k in range(min(len(calls), 2)) for t in range(5 + k)]
        assert out.turns[i] == 1 + int((~mask).any()) + int(len(calls) > 1 and len(observed) > 5)
        for n in calls[:2]:
            assert int(resp[n - 1]) == call and bool(mask[n - 1])  # the call is the model's, in the loss
        assert observed.numel() <= len(expected)
        with torch.no_grad():
            assert (lp - _full_logprobs(model, prompt, resp)).abs().max() < 1e-10
    assert out.state.nbytes() == sample_group(model, prompt, 1, cfg, seed=1, chunk_size=8,
                                              environment=_Lookup()).state.nbytes()


def test_multi_turn_rollout_trains_with_its_masks():
    """The rollout's responses, log-probs and masks make a group: exact from the rollout's own state equals the
    standard plan with the same masks (float64)."""
    model = tiny_model("llama")
    prompt = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(4))
    base = SamplingConfig(max_new_tokens=40, temperature=1.0, top_k=3)
    cfg = SamplingConfig(max_new_tokens=40, temperature=1.0, top_k=3, call_end=(_call_token(model, prompt, base),),
                         max_turns=3)
    out = sample_group(model, prompt, 3, cfg, seed=1, chunk_size=8, environment=_Lookup())
    assert any(bool((~m).any()) for m in out.loss_masks)
    group = Group(prompt, out.responses, torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64),
                  old_logprobs=out.logprobs, loss_masks=out.loss_masks)
    model.zero_grad(set_to_none=True)
    backward_group(model, group, plan="exact", chunk_size=8, prompt_state=out.state)
    exact = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    backward_group(model, group, plan="standard")
    standard = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float((exact - standard).norm() / standard.norm()) < 1e-10


def test_an_environment_needs_a_call_end():
    with pytest.raises(ValueError, match="needs SamplingConfig.call_end"):
        sample_group(tiny_model("llama"), torch.arange(10), 2, SamplingConfig(), environment=_Lookup())
    with pytest.raises(ValueError, match="max_turns must be an integer >= 1"):
        SamplingConfig(max_turns=0)


@pytest.mark.slow
def test_multi_turn_rollout_peak_is_flat_in_group_size():
    """A multi-turn rollout at G = 2 and G = 16 from the same 32 MiB prompt state, each in a fresh process with
    glibc's mmap threshold fixed (as the benches run): the peak grows by less than half the state's size, far below
    the 14 copies of it that copying the prompt per sequence would add."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).resolve().parent / "sampling_peak_worker.py"
    out = {}
    for g in (2, 16):
        done = subprocess.run([sys.executable, str(worker), str(g)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        out[g] = json.loads(done.stdout.strip().splitlines()[-1])
    if not (out[2]["reset_ok"] and out[16]["reset_ok"]):
        pytest.skip("this kernel does not reset the peak RSS (/proc/self/clear_refs)")
    state = out[2]["state_bytes"]
    assert out[16]["state_bytes"] == state and out[16]["tool_calls"] >= 1
    growth = out[16]["peak_bytes"] - out[2]["peak_bytes"]
    print(f"rollout peak above the state: G=2 {out[2]['peak_bytes'] / 2**20:.1f} MiB, G=16 "
          f"{out[16]['peak_bytes'] / 2**20:.1f} MiB; state {state / 2**20:.1f} MiB")
    assert growth < 0.5 * state


def test_multi_turn_rollout_ends_on_the_token_budget():
    """max_new_tokens counts generated and observation tokens: a sequence with observations runs to exactly the
    budget (its last token the model's own), and a call whose observation (and a reply) would not fit ends the
    episode at the call, observation-free; a call whose observation could never fit ends its episode at once."""
    model = tiny_model("llama")
    prompt = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(4))
    budget, obs = 40, 5
    base = SamplingConfig(max_new_tokens=budget, temperature=1.0, top_k=3)
    call = _call_token(model, prompt, base)
    cfg = SamplingConfig(max_new_tokens=budget, temperature=1.0, top_k=3, call_end=(call,), max_turns=100)
    out = sample_group(model, prompt, 4, cfg, seed=1, chunk_size=8,
                       environment=lambda i, response: torch.full((obs,), 7 + i))
    reached = 0
    for resp, mask in zip(out.responses, out.loss_masks):
        assert resp.numel() <= budget and bool(mask[-1])
        if resp.numel() == budget:
            reached += bool((~mask).any())
        else:  # ended at a call whose observation would not fit in what was left
            assert int(resp[-1]) == call and resp.numel() + obs >= budget
    assert reached >= 1, "no sequence with an observation reached the budget: the test needs one"
    never = sample_group(model, prompt, 4, cfg, seed=1, chunk_size=8,
                         environment=lambda i, response: torch.full((budget,), 7))
    for resp, mask, calls, turns in zip(never.responses, never.loss_masks, never.tool_calls, never.turns):
        assert bool(mask.all()) and turns == 1 and calls <= 1
        if calls:
            assert int(resp[-1]) == call
    assert sum(never.tool_calls) >= 1


# ----------------------------------------------------------------- environments checked

PROMPT = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def greedy_call():
    """A float32 tiny model and the token it samples first at top_k=1: as call_end, a tool call at step 0."""
    model = tiny_model("llama", dtype=torch.float32)
    first = sample_group(model, PROMPT, 1, SamplingConfig(max_new_tokens=1, top_k=1)).responses[0]
    return model, int(first[0])


class _Named:
    """An environment with a recognisable repr that returns `value` at every call."""

    def __init__(self, value) -> None:
        self.value = value

    def __call__(self, i, response):
        return self.value

    def __repr__(self) -> str:
        return "<env Named-Env>"


@pytest.mark.parametrize("value,what", [
    ("<result>5</result>", r"text \('<result>5</result>'\): encode it with the tokenizer"),
    ([3.7, 5.2, 9.9], "a list holding float 3.7"),
    ([3, True], "a list holding bool True"),
    (torch.tensor([3.7, 5.2, 9.9]), "a torch.float32 tensor"),
    (torch.tensor([True, False]), "a torch.bool tensor"),
    (torch.ones(2, 2, dtype=torch.long), r"a tensor of shape \(2, 2\)"),
    (torch.tensor([5, 512]), r"token id 512, outside the model's vocabulary \[0, 512\)"),
    ([-1, 4], r"token id -1, outside"),
    (7, "a builtins.int"),
])
def test_a_bad_observation_is_one_error_naming_the_environment(greedy_call, value, what):
    model, call = greedy_call
    cfg = SamplingConfig(max_new_tokens=8, top_k=1, call_end=(call,), max_turns=3)
    with pytest.raises(ValueError, match=rf"environment <env Named-Env> returned {what}.* for sequence 0 at the tool "
                                         r"call ending its turn 1: return .* 1-D integer torch.Tensor"):
        sample_group(model, PROMPT, 2, cfg, environment=_Named(value))


def test_a_numpy_observation_is_refused_and_a_list_of_ints_or_an_int32_tensor_accepted(greedy_call):
    np = pytest.importorskip("numpy")
    model, call = greedy_call
    cfg = SamplingConfig(max_new_tokens=8, top_k=1, call_end=(call,), max_turns=2)
    with pytest.raises(ValueError, match="returned a numpy.ndarray for sequence 0"):
        sample_group(model, PROMPT, 1, cfg, environment=_Named(np.array([5, 6])))
    for value in ([5, 6, 7], (5, 6, 7), torch.tensor([5, 6, 7], dtype=torch.int32)):
        out = sample_group(model, PROMPT, 2, cfg, environment=_Named(value))
        for resp, mask in zip(out.responses, out.loss_masks):
            assert int(resp[0]) == call and resp[~mask].tolist() == [5, 6, 7]
        assert out.turns == [2, 2] and out.tool_calls == [1, 1]


def test_the_environment_and_call_end_are_checked_before_any_compute(greedy_call, monkeypatch):
    model, call = greedy_call
    captures = []
    real = rollout.capture_prompt
    monkeypatch.setattr(rollout, "capture_prompt", lambda *a, **k: captures.append(1) or real(*a, **k))
    cfg = SamplingConfig(max_new_tokens=8, call_end=(call,), max_turns=2)
    with pytest.raises(TypeError, match=r"environment must be callable .* got \[1, 2\] \(list\)"):
        sample_group(model, PROMPT, 2, cfg, environment=[1, 2])
    with pytest.raises(ValueError, match=r"call_end id 512 is outside the model's vocabulary \[0, 512\).*never"):
        sample_group(model, PROMPT, 2, SamplingConfig(call_end=(3, 512)), environment=_Named(None))
    with pytest.raises(ValueError, match=rf"call_end id {call} is also a stop id"):
        sample_group(model, PROMPT, 2, SamplingConfig(call_end=(call,), stop_ids=(0, call)), environment=_Named(None))
    assert captures == []
    for bad in ((-1,), (True,), (2.0,)):
        with pytest.raises(ValueError, match="call_end must hold non-negative int token ids"):
            SamplingConfig(call_end=bad)


def test_one_token_responses_report_one_turn(greedy_call):
    """Every token but the call's is a stop id: a response is a stop token alone (1 turn, no call) or calls, gets
    its observation and stops at its next own token (2 turns, 1 call)."""
    model, call = greedy_call
    cfg = SamplingConfig(max_new_tokens=10, top_k=2, stop_ids=tuple(t for t in range(512) if t != call),
                         call_end=(call,), max_turns=3)
    out = sample_group(model, PROMPT, 8, cfg, seed=0, environment=_Named(torch.tensor([call + 1, call + 2])))
    for mask, turns, calls in zip(out.loss_masks, out.turns, out.tool_calls):
        runs = int(((~mask[1:]) & mask[:-1]).sum())  # observation stretches
        assert turns == 1 + runs and calls == runs
    single = [(int(r[0]), t, c) for r, t, c in zip(out.responses, out.turns, out.tool_calls) if r.numel() == 1]
    assert single and all(token != call and (t, c) == (1, 0) for token, t, c in single), single
    assert any((t, c) == (2, 1) for r, t, c in zip(out.responses, out.turns, out.tool_calls) if r.numel() > 1)

"""Bad input gets a clear error before anything is computed; the model is left untouched."""

import pytest
import torch
from helpers import random_group, tiny_model

from longstraw import Group, backward_group
from longstraw.engine.loss.config import LossConfig

ADV = torch.zeros(2, dtype=torch.float64)


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    for p in m.parameters():  # pre-existing gradients that a rejected call must not touch
        p.grad = torch.full_like(p, 0.5)
    return m


def _snapshot(m):
    return [(p.detach().clone(), p.grad.clone()) for p in m.parameters()]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(prompt=torch.tensor([], dtype=torch.long)), ValueError, "prompt is empty"),
    (dict(responses=[torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)]), ValueError,
     r"responses\[1\] is empty"),
    (dict(responses=[], advantages=torch.zeros(0)), ValueError, "G = 0"),
    (dict(advantages=torch.zeros(3)), ValueError, r"advantages must have shape \(2,\)"),
    (dict(prompt=torch.tensor([1.0, 2.0])), TypeError, "integer token ids"),
    (dict(responses=[[1, 2], [3]]), TypeError, "LongTensor"),
    (dict(advantages=torch.tensor([1.0, float("nan")])), ValueError, "NaN or inf"),
    (dict(advantages=torch.tensor([float("inf"), 0.0])), ValueError, "NaN or inf"),
    (dict(advantages=[1.0, 2.0]), TypeError, "FloatTensor"),
    (dict(prompt=torch.tensor([[1, 2]])), ValueError, "1-D"),
    (dict(prompt=torch.tensor([-1, 2])), ValueError, "negative"),
    (dict(old_logprobs=[torch.zeros(2)]), ValueError, "list of 2 tensors"),
    (dict(ref_logprobs=[torch.zeros(2), torch.ones(1)]), ValueError, "positive"),
])
def test_group_rejects_bad_input(kwargs, error, match):
    base = dict(prompt=torch.tensor([1, 2, 3]), responses=[torch.tensor([4, 5]), torch.tensor([6])], advantages=ADV)
    with pytest.raises(error, match=match):
        Group(**{**base, **kwargs})


def _good():
    return random_group(10, [3, 2], seed=0)


@pytest.mark.parametrize("group_fn,kwargs,error,match", [
    (lambda: Group(torch.tensor([1, 600]), [torch.tensor([2])], torch.zeros(1)), {}, ValueError,
     "out of the model's vocab"),
    (lambda: Group(torch.tensor([1]), [torch.tensor([512])], torch.zeros(1)), {}, ValueError, "id 512 is out"),
    (lambda: random_group(1020, [5], seed=0), {}, ValueError, "max_position_embeddings"),
    (_good, dict(plan="fast"), ValueError, "unknown plan 'fast'"),
    (_good, dict(mode="exact"), TypeError, "unexpected keyword argument 'mode'"),  # the old name: refused
    (_good, dict(loss="ppo"), ValueError, "unknown loss 'ppo'"),
    (_good, dict(micro_batch=0), ValueError, "micro_batch must be an integer >= 1"),
    (_good, dict(micro_batch=1.5), ValueError, "micro_batch"),
    (_good, dict(chunk_size=0), ValueError, "chunk_size"),
    (_good, dict(gamma=0.9), TypeError, "unexpected keyword argument .gamma.; valid options: plan, loss"),
    (_good, dict(loss=LossConfig("grpo", beta=0.1)), ValueError, "ref_logprobs"),
    (_good, dict(beta=0.1), TypeError, r"beta is a parameter of the loss: pass loss=LossConfig"),
    (lambda: "not a group", {}, TypeError, "longstraw.Group"),
])
def test_backward_group_rejects_and_leaves_model_untouched(model, group_fn, kwargs, error, match):
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        backward_group(model, group_fn(), **kwargs)
    for (w, g), p in zip(before, model.parameters()):
        assert torch.equal(w, p.detach()) and torch.equal(g, p.grad)


def test_an_architecture_that_fails_its_check_is_refused_with_the_measured_difference(monkeypatch, tmp_path):
    """DiffLlama (differential attention: two softmaxes per head) is off the CI list; the check of its config measures
    the replay against transformers and refuses it, naming the difference and the first layer that differs."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    config = DiffLlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=100)
    model = DiffLlamaForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"'diffllama' is refused: a tiny float64 copy of this config does not match "
                                         r"transformers' own forward \(replayed log-probs off by .*first layer that "
                                         r"differs: layer 0 "):
        backward_group(model, Group(torch.tensor([1, 2]), [torch.tensor([3])], torch.zeros(1)))
    assert all(p.grad is None for p in model.parameters())


def test_train_mode_is_refused():
    model = tiny_model("llama").train()
    with pytest.raises(ValueError, match=r"eval\(\)"):
        backward_group(model, _good())


def test_a_submodule_in_train_mode_is_named():
    """The root in eval() mode does not make every submodule so: the first one in train() mode is named."""
    model = tiny_model("llama")
    model.model.layers[1].mlp.train()
    with pytest.raises(ValueError, match=r"submodule 'model.layers.1.mlp' \(LlamaMLP\) is in train\(\) mode.*eval\(\)"):
        backward_group(model, _good())
    model.eval()
    model.model.layers[0].self_attn.train()
    model.model.layers[0].self_attn.drop = torch.nn.Dropout(0.1)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn' .*dropout active: .*drop p=0.1"):
        backward_group(model, _good())
    assert all(p.grad is None for p in model.parameters())


def test_mixed_dtype_model_is_refused_naming_the_parameter():
    model = tiny_model("llama", dtype=torch.float32)
    model.model.layers[1].mlp.down_proj.to(torch.float64)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.weight' is float64 but the model's "
                                         r"embeddings are float32.*model.to\(torch.float32\)"):
        backward_group(model, random_group(10, [3, 2], seed=0, dtype=torch.float32), plan="exact")
    assert all(p.grad is None for p in model.parameters())


def test_a_refused_type_is_refused_with_the_reason_before_any_compute():
    """Zamba (v1) is refused for a known missing mechanism, at once, without a check."""
    from transformers import ZambaConfig, ZambaForCausalLM

    model = ZambaForCausalLM(ZambaConfig(hidden_size=32, num_hidden_layers=5, vocab_size=100, num_attention_heads=4,
                                         num_key_value_heads=4, attn_layer_period=2, attn_layer_offset=1,
                                         mamba_d_state=4, n_mamba_heads=2)).eval()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="'zamba' is refused: .*ignores the SSM state"):
        backward_group(model, Group(torch.tensor([1, 2, 3]), [torch.tensor([4])], torch.zeros(1)))
    assert all(p.grad is None and torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


PLANS_WITH_GRADIENT = ["exact", "detach", "standard"]


def _float32_model_with_grads():
    m = tiny_model("llama", dtype=torch.float32)
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.25)
    return m


@pytest.mark.parametrize("plan", PLANS_WITH_GRADIENT)
@pytest.mark.parametrize("change,match", [
    # exp(logp - old) with old = -100 overflows float32 (e^88.7): a NaN gradient, were it not refused.
    (dict(old_logprobs=[torch.full((3,), -1.0), torch.full((2,), -100.0)]), r"old_logprobs\[1\] reaches -100"),
    (dict(advantages=torch.tensor([1e300, -1e300], dtype=torch.float64)), r"advantages\[0\] = 1e\+300 is too large"),
    (dict(advantages=torch.tensor([3e19, -1.0], dtype=torch.float64)), r"advantages\[0\] = 3e\+19 is too large"),
    (dict(ref_logprobs=[torch.full((3,), -1.0), torch.full((2,), -1e300, dtype=torch.float64)]),
     r"ref_logprobs\[1\] reaches -1e\+300, which is -inf in the loss's dtype float32"),
])
def test_overflowing_finite_inputs_are_refused_before_any_gradient(plan, change, match):
    model = _float32_model_with_grads()
    base = random_group(10, [3, 2], seed=0, dtype=torch.float32)
    group = Group(**{"prompt": base.prompt, "responses": base.responses, "advantages": base.advantages, **change})
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match):
        backward_group(model, group, plan=plan, loss=LossConfig("grpo", beta=0.1 if "ref_logprobs" in change else 0.0))
    for (w, g), p in zip(before, model.parameters()):
        assert torch.equal(w, p.detach()) and torch.equal(g, p.grad)


def _overflowing_kl_group(model, bad_first: bool):
    """An output layer scaled x1000 puts the model's log-probs near -1000: the KL term exp(ref - logp) then
    overflows float32 for a response whose ref is 0, but not for one whose ref equals its own log-probs. The
    inputs are all in range; only the model's forward reveals the overflow."""
    from longstraw.engine.sampling import score_responses

    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1000.0)
    base = random_group(10, [3, 2], seed=0, dtype=torch.float32)
    own = score_responses(model, base.prompt, base.responses)
    assert all(float(lp.max()) < -50 for lp in own)
    ref = [torch.zeros_like(own[0]), own[1]] if bad_first else [own[0], torch.zeros_like(own[1])]
    return Group(base.prompt, base.responses, base.advantages, ref_logprobs=ref)


@pytest.mark.parametrize("plan", PLANS_WITH_GRADIENT)
def test_overflow_in_a_micro_batch_is_caught_before_its_backward(plan):
    # Bad micro-batch first: whatever the gradients held is left exactly as it was.
    model = _float32_model_with_grads()
    group = _overflowing_kl_group(model, bad_first=True)
    before = _snapshot(model)
    with pytest.raises(FloatingPointError, match=r"responses \[0\]: their share of the loss is inf.*as they were"):
        backward_group(model, group, plan=plan, loss=LossConfig("grpo", beta=0.1), micro_batch=1)
    for (w, g), p in zip(before, model.parameters()):
        assert torch.equal(w, p.detach()) and torch.equal(g, p.grad)

    # Bad micro-batch second, no gradients before: the first micro-batch's are dropped again (None).
    model = tiny_model("llama", dtype=torch.float32)
    group = _overflowing_kl_group(model, bad_first=False)
    with pytest.raises(FloatingPointError, match=r"responses \[1\]: their share.*as they were before this call"):
        backward_group(model, group, plan=plan, loss=LossConfig("grpo", beta=0.1), micro_batch=1)
    assert all(p.grad is None for p in model.parameters())
    # ... and with gradients before, the message says what they now hold.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(FloatingPointError, match=r"hold the \(finite\) contributions of this group's first 1"):
        backward_group(model, group, plan=plan, loss=LossConfig("grpo", beta=0.1), micro_batch=1)
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def test_a_state_of_another_prompt_of_the_same_length_is_refused(tiny_llama64):
    from longstraw.engine.state.capture import capture_prompt

    tiny_llama64.zero_grad(set_to_none=True)  # a fixture shared by every test: others leave gradients on it
    group = random_group(20, [3, 2], seed=0)
    other = random_group(20, [3, 2], seed=1)
    assert not torch.equal(group.prompt, other.prompt)
    state = capture_prompt(tiny_llama64, other.prompt[:-1], chunk_size=8)
    for plan in ("exact", "detach"):
        with pytest.raises(ValueError, match="captured for another prompt of the same length"):
            backward_group(tiny_llama64, group, plan=plan, chunk_size=8, prompt_state=state)
    assert state.prefix(1).fingerprint is None  # a prefix holds fewer ids
    state.fingerprint = None  # as in a state built by hand
    with pytest.raises(ValueError, match="records no prompt fingerprint"):
        backward_group(tiny_llama64, group, plan="detach", chunk_size=8, prompt_state=state)
    assert all(p.grad is None for p in tiny_llama64.parameters())
    own = capture_prompt(tiny_llama64, group.prompt[:-1].to(torch.int32), chunk_size=8)  # any integer dtype
    assert own.fork().fingerprint == own.offload(torch.device("cpu")).fingerprint == own.fingerprint
    backward_group(tiny_llama64, group, plan="exact", chunk_size=8, prompt_state=own)
    tiny_llama64.zero_grad(set_to_none=True)


def test_options_are_validated_once_and_keywords_apply_on_top():
    """A BackwardOptions refuses a bad combination when it is built; keywords given with it replace its fields."""
    from longstraw import BackwardOptions

    with pytest.raises(ValueError, match="offload_state moves the prompt state to host memory"):
        BackwardOptions(plan="standard", offload_state=True)
    with pytest.raises(ValueError, match="keep_prompt_graph keeps capture graphs for the exact plan"):
        BackwardOptions(plan="detach", keep_prompt_graph=1)
    with pytest.raises(ValueError, match="epsilon_low must be < 1"):
        BackwardOptions(loss=LossConfig("grpo", epsilon_low=1.5))
    base = BackwardOptions(plan="detach", chunk_size=8)
    with pytest.raises(ValueError, match="keep_prompt_graph keeps capture graphs"):  # replaced, then validated
        backward_group(tiny_model("llama"), random_group(10, [3, 2]), base, keep_prompt_graph=2)
    with pytest.raises(TypeError, match="options must be a longstraw.BackwardOptions"):
        backward_group(tiny_model("llama"), random_group(10, [3, 2]), "exact")


def _llama(seed: int = 0, **changes) -> torch.nn.Module:
    """tiny llama (float64) with config changes: another layer count or K/V-head count."""
    from helpers import _configs, faithful_float64
    from transformers import AutoModelForCausalLM

    config = _configs()["llama"]
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.float64).eval()
    faithful_float64(model)
    return model


@pytest.mark.parametrize("producer,match", [
    (lambda: _llama(seed=1), "captured with other weights"),
    (lambda: _llama(num_hidden_layers=3), "num_hidden_layers 3 \\(state\\) vs 2 \\(model\\)"),
    (lambda: _llama(num_key_value_heads=4), "num_key_value_heads 4 \\(state\\) vs 2 \\(model\\)"),
])
def test_a_state_another_model_captured_is_refused(producer, match):
    """Another model of the same shape, one with more layers, one with another K/V-head count (whose K/V would
    reach the kernel with the wrong head count): refused, naming what differs, before any gradient."""
    from longstraw.engine.state.capture import capture_prompt

    model, group = _llama(), random_group(20, [3, 2])
    state = capture_prompt(producer(), group.prompt[:-1], chunk_size=8)
    for plan in ("exact", "detach"):
        with pytest.raises(ValueError, match=f"does not belong to this model.*{match}"):
            backward_group(model, group, plan=plan, chunk_size=8, prompt_state=state)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("fused", [False, True])
def test_a_state_captured_before_an_optimizer_step_is_refused(fused):
    """The same model after an AdamW step (fused AdamW too, which PyTorch's version counters do not see): the state
    is stale and refused; captured again, it is accepted."""
    from longstraw.engine.state.capture import capture_prompt

    model, group = _llama(), random_group(20, [3, 2])
    state = capture_prompt(model, group.prompt[:-1], chunk_size=8)
    backward_group(model, group, plan="detach", chunk_size=8, prompt_state=state)  # its own weights: accepted
    torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused).step()
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="captured with other weights"):
        backward_group(model, group, plan="exact", chunk_size=8, prompt_state=state)
    assert all(p.grad is None for p in model.parameters())
    backward_group(model, group, plan="exact", chunk_size=8,
                   prompt_state=capture_prompt(model, group.prompt[:-1], chunk_size=8))


def test_no_trainable_parameter_is_a_clear_error():
    model = _llama().requires_grad_(False)
    for plan in ("standard", "detach", "exact"):
        with pytest.raises(ValueError, match="no parameter of the model requires grad"):
            backward_group(model, random_group(20, [3, 2]), plan=plan, chunk_size=8)

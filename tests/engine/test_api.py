"""Parity of the plans (docs/design.md §5): exact == standard gradient, detach logprobs == standard, and the
detach plan's bias, per supported family, in float64 (and one float32 case)."""

import pytest
import torch
from helpers import (
    BF16,
    EXACT_F64,
    FP32,
    SAME_ORDER_F64,
    assert_close,
    grads,
    random_group,
    rel_err,
    tiny_model,
    with_loss,
)

import longstraw.engine.tree.plans as exact_plan
from longstraw import BackwardOptions, Group, backward_group

LENGTHS = [5, 9, 1, 7]  # ragged, one single-token response


def _run(model, group, plan, **kw):
    model.zero_grad(set_to_none=True)
    result = backward_group(model, group, plan=plan, **with_loss(kw))
    return result, grads(model)


def _with_policy_logprobs(model, group, noise=0.3):
    """old/ref log-probs near the model's own, so PPO clipping and the KL term are both active."""
    result, _ = _run(model, group, "standard")
    gen = torch.Generator().manual_seed(7)
    near = lambda: [(lp + noise * torch.randn(lp.shape, generator=gen, dtype=lp.dtype)).clamp(max=0.0)  # noqa: E731
                    for lp in result.logprobs]
    return Group(group.prompt, group.responses, group.advantages, old_logprobs=near(), ref_logprobs=near())


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family_model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("prompt_len,chunk_size", [(1, 4), (17, 5), (300, 64)])
@pytest.mark.parametrize("micro_batch", [1, 3])
def test_exact_equals_standard_grpo(family_model, prompt_len, chunk_size, micro_batch):
    group = random_group(prompt_len, LENGTHS, seed=prompt_len)
    ref, g_ref = _run(family_model, group, "standard")
    out, g_out = _run(family_model, group, "exact", chunk_size=chunk_size, micro_batch=micro_batch)
    assert_close('g_out', g_ref, g_out, EXACT_F64)
    assert abs(out.loss - ref.loss) <= 1e-12
    for a, b in zip(out.logprobs, ref.logprobs):
        assert (a - b).abs().max() <= 1e-10


@pytest.mark.parametrize("loss,options", [
    ("grpo", dict(beta=0.05)),
    ("dr_grpo", dict(beta=0.05, max_tokens=12)),
    ("dapo", dict(beta=0.05)),
    ("gspo", dict(beta=0.05, epsilon_low=0.05, epsilon_high=0.1)),
])
@pytest.mark.parametrize("micro_batch", [1, 3])
def test_exact_equals_standard_every_loss(family_model, loss, options, micro_batch):
    group = _with_policy_logprobs(family_model, random_group(17, LENGTHS, seed=2))
    _, g_ref = _run(family_model, group, "standard", loss=loss, **options)
    _, g_out = _run(family_model, group, "exact", loss=loss, chunk_size=5, micro_batch=micro_batch, **options)
    assert_close('g_out', g_ref, g_out, EXACT_F64)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_exact_equals_standard_other_families(family):
    model = tiny_model(family)
    group = random_group(40, LENGTHS, seed=4)
    _, g_ref = _run(model, group, "standard")
    _, g_out = _run(model, group, "exact", chunk_size=13, micro_batch=2)
    assert_close('g_out', g_ref, g_out, EXACT_F64)


def test_standard_batched_equals_standard(family_model):
    group = _with_policy_logprobs(family_model, random_group(17, LENGTHS, seed=3))
    ref, g_ref = _run(family_model, group, "standard", loss="dapo", beta=0.1)
    out, g_out = _run(family_model, group, "standard_batched", loss="dapo", beta=0.1)
    assert_close('g_out', g_ref, g_out, EXACT_F64)
    assert abs(out.loss - ref.loss) <= 1e-12


def test_float32_exact_equals_standard():
    model = tiny_model("llama", dtype=torch.float32)
    group = random_group(120, LENGTHS, seed=5, dtype=torch.float32)
    _, g_ref = _run(model, group, "standard")
    _, g_out = _run(model, group, "exact", chunk_size=50, micro_batch=3)
    assert_close('g_out', g_ref, g_out, FP32)


def test_detach_logprobs_exact_but_gradient_biased(family_model):
    group = random_group(300, LENGTHS, seed=6)
    ref, g_ref = _run(family_model, group, "standard")
    out, g_out = _run(family_model, group, "detach", chunk_size=64, micro_batch=3)
    for a, b in zip(out.logprobs, ref.logprobs):
        assert (a - b).abs().max() <= 1e-10
    bias = rel_err(g_out, g_ref)
    print(f"detach-vs-standard relative gradient difference ({family_model.config.model_type}, P=300): {bias:.3g}")
    assert bias > 1e-3  # the prompt's own activations get no gradient in the paper's plan


def test_detach_and_exact_agree_with_one_token_prompt(family_model):
    """P = 1: nothing is captured, so detach is exact too."""
    group = random_group(1, LENGTHS, seed=8)
    _, g_ref = _run(family_model, group, "standard")
    _, g_det = _run(family_model, group, "detach")
    assert_close('g_det', g_ref, g_det, EXACT_F64)


def test_detach_equals_exact_before_prompt_backward(family_model, monkeypatch):
    group = random_group(60, LENGTHS, seed=9)
    _, g_detach = _run(family_model, group, "detach", chunk_size=16, micro_batch=2)
    monkeypatch.setattr(exact_plan, "prompt_backward", lambda *args, **kwargs: None)
    _, g_partial = _run(family_model, group, "exact", chunk_size=16, micro_batch=2)
    assert_close('g_partial', g_detach, g_partial, 1e-13)
    monkeypatch.undo()
    _, g_exact = _run(family_model, group, "exact", chunk_size=16, micro_batch=2)
    assert rel_err(g_exact, g_detach) > 1e-3  # the prompt backward phase adds the missing part


@pytest.mark.parametrize("plan", ["standard", "standard_batched", "detach", "exact"])
def test_first_response_token_carries_gradient(family_model, plan):
    """Only the first response token's log-prob is in the loss: its gradient must reach the weights."""
    group = random_group(30, [1, 1], seed=10)
    _, g = _run(family_model, group, plan, chunk_size=8)
    assert g.norm() > 0
    lm_head = family_model.get_output_embeddings().weight
    assert lm_head.grad is not None and lm_head.grad.norm() > 0


def test_gradients_accumulate_like_backward(family_model):
    """backward_group adds to existing .grad and never zeroes or steps."""
    group = random_group(20, [3, 4], seed=11)
    family_model.zero_grad(set_to_none=True)
    backward_group(family_model, group, plan="exact", chunk_size=6)
    once = grads(family_model).clone()
    backward_group(family_model, group, BackwardOptions(plan="exact", chunk_size=6))  # the options object
    assert_close('grads(family_model)', 2 * once, grads(family_model), SAME_ORDER_F64)


def test_stats_report_phases_and_state_size(family_model):
    group = random_group(50, [3, 4], seed=12)
    result = backward_group(family_model, group, chunk_size=16)  # the exact plan by default
    cfg = family_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert result.stats["prompt_state_bytes"] == 2 * cfg.num_key_value_heads * head_dim * 8 * 49 * 2
    for phase in ("capture_s", "replay_s", "prompt_backward_s"):  # the exact plan runs all three
        assert result.stats[phase] > 0, phase
    detach = backward_group(family_model, group, plan="detach", chunk_size=16).stats
    assert result.stats["plan"] == "exact" and detach["plan"] == "detach"
    assert detach["capture_s"] > 0 and detach["replay_s"] > 0 and detach["prompt_backward_s"] < detach["capture_s"]
    family_model.zero_grad(set_to_none=True)


def test_bfloat16_exact_tracks_float32_standard():
    """bf16 end to end (what GPU users run): the exact plan stays within bf16 noise of the fp32 reference, and
    its log-probs and loss come out in fp32 (precision.py), as accurate as the bf16 forward allows."""
    from longstraw import load_model

    group = random_group(200, LENGTHS, seed=13, dtype=torch.float32)
    ref_model = load_model("tiny-llama", dtype="float32")
    ref, g_ref = _run(ref_model, group, "standard")
    low = load_model("tiny-llama", dtype="bfloat16")
    result, g_low = _run(low, group, "exact", chunk_size=48, micro_batch=2)
    standard_low, _ = _run(low, group, "standard")
    assert all(lp.dtype == torch.float32 for lp in result.logprobs + standard_low.logprobs)
    assert_close('g_low.float()', g_ref, g_low.float(), BF16)
    for a, b in zip(result.logprobs, ref.logprobs):
        assert (a - b).abs().max() < 0.1  # the bf16 forward's noise, not bf16 rounding of log-probs ~ -6
    # Not rounded to bf16 on the way out: bf16 has 8 bits of mantissa, these keep more.
    assert any(bool((lp != lp.to(torch.bfloat16).float()).any()) for lp in result.logprobs)


@pytest.fixture(scope="module")
def llama32():
    return tiny_model("llama", dtype=torch.float32)


@pytest.mark.parametrize("plan", ["exact", "detach", "standard", "standard_batched"])
def test_zero_advantage_group_is_skipped_without_touching_gradients(llama32, plan):
    """Every advantage 0 and beta = 0: the gradient is exactly zero (tests/engine/test_loss.py), so no pass runs."""
    import time

    family_model = llama32
    base = random_group(60, LENGTHS, seed=5, dtype=torch.float32)
    old = [torch.full((n,), -2.0) for n in LENGTHS]
    zero = Group(base.prompt, base.responses, torch.zeros(len(LENGTHS)), old_logprobs=old)
    family_model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    result = backward_group(family_model, zero, plan=plan, loss="gspo", chunk_size=16)
    skipped_s = time.perf_counter() - t0
    assert result.skipped == "zero_advantage" and result.loss == 0.0 and result.logprobs == []
    assert result.stats["replay_s"] == result.stats["capture_s"] == result.stats["prompt_backward_s"] == 0.0
    assert result.stats["group_size"] == len(LENGTHS) and result.stats["prompt_tokens"] == 60
    assert all(p.grad is None for p in family_model.parameters())
    for p in family_model.parameters():  # existing gradients are left exactly as they were
        p.grad = torch.full_like(p, 0.5)
    backward_group(family_model, zero, plan=plan, chunk_size=16)
    assert all(bool((p.grad == 0.5).all()) for p in family_model.parameters())
    # The same group with nonzero advantages runs the whole pass; the skip costs a small fraction of it.
    t0 = time.perf_counter()
    ran = backward_group(family_model, Group(base.prompt, base.responses, base.advantages), plan=plan, chunk_size=16)
    assert ran.skipped is None and skipped_s < 0.2 * (time.perf_counter() - t0)
    family_model.zero_grad(set_to_none=True)


def test_zero_advantages_with_kl_are_not_skipped(llama32):
    """beta > 0: the KL term has a gradient even when every advantage is 0."""
    base = random_group(17, LENGTHS, seed=2, dtype=torch.float32)
    ref = [torch.full((n,), -3.0) for n in LENGTHS]
    zero = Group(base.prompt, base.responses, torch.zeros(len(LENGTHS)), ref_logprobs=ref)
    result, g = _run(llama32, zero, "exact", beta=0.05, chunk_size=5)
    assert result.skipped is None and result.loss != 0.0 and float(g.abs().max()) > 0
    llama32.zero_grad(set_to_none=True)


@pytest.mark.parametrize("plan", ["exact", "standard"])
def test_float16_backward_group_is_numerically_fine(plan):
    """float16 stays allowed in backward_group (the trainer refuses it: AdamW needs float32 master weights):
    the gradient is finite and within float16 noise of the float64 reference (measured ~8e-4; bfloat16 ~7e-3).
    It is computed without loss scaling, as a plain loss.backward() would be."""
    ref = tiny_model("llama", dtype=torch.float64)
    group = random_group(40, [5, 3, 4], seed=1)
    _, g_ref = _run(ref, group, "standard")
    half = tiny_model("llama", dtype=torch.float16)
    half.load_state_dict({k: v.to(torch.float16) for k, v in ref.state_dict().items()})
    _, g_half = _run(half, group, plan, chunk_size=16)
    assert bool(torch.isfinite(g_half).all()) and rel_err(g_half.double(), g_ref) < 5e-3


def test_temperature_scores_logits_over_t_in_every_plan(family_model):
    """temperature=T: log-probs of logits / T (TRL scores at its sampling temperature); exact == standard there."""
    group = _with_policy_logprobs(family_model, random_group(17, LENGTHS, seed=5))
    plain, _ = _run(family_model, group, "standard", beta=0.05)
    ref, g_ref = _run(family_model, group, "standard", beta=0.05, temperature=0.7)
    out, g_out = _run(family_model, group, "exact", chunk_size=5, beta=0.05, temperature=0.7)
    assert_close('g_out', g_ref, g_out, EXACT_F64)
    for a, b, c in zip(out.logprobs, ref.logprobs, plain.logprobs):
        assert (a - b).abs().max() <= 1e-10
        assert (a - c).abs().max() > 1e-3
    with pytest.raises(ValueError, match="temperature"):
        backward_group(family_model, group, temperature=0.0)


def test_allow_train_mode_runs_a_dropout_free_model_as_in_eval():
    """TRL trains in train() mode: allow_train_mode accepts it when no dropout is active, computes the eval()
    gradient, and leaves every module's mode as it was; active dropout is still refused, naming it."""
    model = tiny_model("llama")
    group = random_group(17, LENGTHS, seed=6)
    _, g_eval = _run(model, group, "exact", chunk_size=5)
    model.train()
    model.model.layers[1].eval()  # a mixed state, restored as it was
    with pytest.raises(ValueError, match="train\\(\\) mode"):
        _run(model, group, "exact", chunk_size=5)
    _, g_train = _run(model, group, "exact", chunk_size=5, allow_train_mode=True)
    assert rel_err(g_train, g_eval) == 0.0
    assert model.training and model.model.layers[0].training and not model.model.layers[1].training
    model.model.layers[0].self_attn.attention_dropout = 0.1
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="layers.0.self_attn.attention_dropout=0.1"):
        backward_group(model, group, allow_train_mode=True)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("model_type", ["opt", "biogpt"])
def test_functional_dropout_in_train_mode_is_refused(model_type):
    """OPT and BioGPT apply their config's dropout with nn.functional.dropout(p=self.dropout, training=...), no
    nn.Dropout module: in train() mode their forward is random, which allow_train_mode must refuse (naming the rate),
    not replace by the eval() forward; with the released config's rates at 0 train() and eval() agree and it runs."""
    from longstraw.admission.released import sweep_config
    from longstraw.admission.tiny import build_tiny_model, tiny_config

    config = tiny_config(sweep_config(model_type))[0]
    model = build_tiny_model(config).train()
    group = random_group(13, [3, 5], seed=2, vocab=60)
    with pytest.raises(ValueError, match=r"layers\.0\.dropout=0\.1"):
        backward_group(model, group, allow_train_mode=True)
    assert all(p.grad is None for p in model.parameters())
    for key in ("dropout", "hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout"):
        if getattr(config, key, None):
            setattr(config, key, 0.0)
    quiet = build_tiny_model(config).train()
    ids = torch.randint(3, 60, (1, 9))
    assert torch.equal(quiet(ids).logits, quiet(ids).logits)
    backward_group(quiet, group, allow_train_mode=True)
    assert any(p.grad is not None for p in quiet.parameters())


def test_a_head_kept_in_float32(tmp_path):
    """Hunyuan-V4 keeps its lm_head in float32 whatever the load dtype (`_keep_in_fp32_modules_strict`) and casts the
    hidden states to it before the head: exact's log-prob pass does too, and equals the standard plan (transformers'
    forward) within float32's rounding of the head, on a float64 load."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from longstraw.admission.released import sweep_config
    from longstraw.admission.tiny import build_tiny_model, tiny_config

    if "hy_v4" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no Hunyuan-V4 (hy_v4)")
    build_tiny_model(tiny_config(sweep_config("hy_v4"))[0]).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, experts_implementation="eager").eval()
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float64
    group = random_group(17, [3, 5], seed=1, vocab=60)
    ref, got = _run(model, group, "standard")[1], _run(model, group, "exact", chunk_size=5)[1]
    assert rel_err(got, ref) <= 1e-6

"""Per-token loss masks (`Group.loss_masks`): masked tokens run through the model but add no loss, and every
normaliser counts only unmasked tokens. The reference is a plain restatement over transformers' full-sequence
forward (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import EXACT_F64, assert_close, gradient_tolerance, grads, random_group, tiny_model

from longstraw import Group, backward_group
from longstraw.engine import logits as logits_module
from longstraw.engine.linear_loss import linear_loss
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.sampling import SamplingConfig, sample_group
from longstraw.engine.tree import plans as exact_plan
from longstraw.engine.tree import plans as replay

LENGTHS = [6, 9, 4]


def _masks(lengths: list[int]) -> list[torch.Tensor]:
    """Response i: a stretch of 'observation' tokens in the middle is masked (as a tool output would be)."""
    out = []
    for i, n in enumerate(lengths):
        m = torch.ones(n, dtype=torch.bool)
        m[1 + i % 2: 1 + i % 2 + n // 3] = False
        out.append(m)
    return out


def _group(prompt_len: int = 20, seed: int = 0, beta: bool = False, **extra) -> Group:
    g = random_group(prompt_len, LENGTHS, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    olds = [-torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 0.5 for n in LENGTHS]
    refs = [-torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 0.5 for n in LENGTHS] if beta else None
    return Group(prompt=g.prompt, responses=g.responses, advantages=g.advantages, old_logprobs=olds,
                 ref_logprobs=refs, loss_masks=_masks(LENGTHS), **extra)


def _reference_loss(model, group: Group, loss: str, beta: float, eps=(0.2, 0.2), l_max: int | None = None):
    """TRL's definitions with `completion_mask * tool_mask`, over a plain forward of each prompt + response."""
    terms, masks, lens = [], [], []
    for i, r in enumerate(group.responses):
        ids = torch.cat([group.prompt, r])[None]
        logits = model(ids).logits[0, group.prompt.numel() - 1: -1]  # (R, V): the logits that predict r
        logp = torch.log_softmax(logits, -1).gather(-1, r[:, None]).squeeze(-1)
        m = group.loss_masks[i].to(logp.dtype)
        log_ratio = logp - group.old_logprobs[i]
        a = group.advantages[i]
        if loss == "gspo":
            ratio = torch.exp((log_ratio * m).sum() / m.sum()).expand_as(logp)
        else:
            ratio = torch.exp(log_ratio)
        term = -torch.minimum(ratio * a, ratio.clamp(1 - eps[0], 1 + eps[1]) * a)
        if beta:
            d = group.ref_logprobs[i] - logp
            term = term + beta * (torch.exp(d) - d - 1)
        terms.append(term * m)
        masks.append(m)
        lens.append(m.sum())
    g = len(terms)
    if loss in ("grpo", "gspo"):
        return sum(t.sum() / n for t, n in zip(terms, lens)) / g
    if loss == "dr_grpo":
        return sum(t.sum() for t in terms) / (g * (l_max or max(int(n) for n in lens)))
    if loss == "dapo":
        return sum(t.sum() for t in terms) / sum(lens)
    raise ValueError(loss)


@pytest.mark.parametrize("loss,beta", [("grpo", 0.0), ("grpo", 0.05), ("dr_grpo", 0.0), ("dapo", 0.05), ("gspo", 0.0)])
def test_masked_loss_equals_the_plain_restatement(loss, beta):
    """Every plan's gradient with masks equals the reference's: normalisers count only unmasked tokens, the KL term
    too. gspo's sequence ratio averages the unmasked tokens."""
    group = _group(beta=beta > 0)
    eps = {"dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}.get(loss, (0.2, 0.2))
    reference = tiny_model("llama")
    _reference_loss(reference, group, loss, beta, eps).backward()
    for plan in ("standard", "standard_batched", "exact"):
        model = tiny_model("llama")
        backward_group(model, group, plan=plan, loss=LossConfig(loss, beta=beta), chunk_size=8)
        assert_close(f"{loss} {plan}", grads(reference), grads(model), 1e-10)


def test_masks_change_the_gradient_and_an_all_true_mask_does_not():
    """The test data reaches the mask: masking changes the gradient; masks of all True equal no masks, bitwise."""
    group = _group()
    plain = Group(prompt=group.prompt, responses=group.responses, advantages=group.advantages,
                  old_logprobs=group.old_logprobs)
    ones = Group(prompt=group.prompt, responses=group.responses, advantages=group.advantages,
                 old_logprobs=group.old_logprobs, loss_masks=[torch.ones(n, dtype=torch.bool) for n in LENGTHS])
    out = {}
    for name, g in (("masked", group), ("plain", plain), ("ones", ones)):
        model = tiny_model("llama")
        backward_group(model, g, plan="exact", chunk_size=8)
        out[name] = grads(model)
    assert torch.equal(out["plain"], out["ones"])
    assert (out["masked"] - out["plain"]).norm() > 1e-3 * out["plain"].norm()


def test_a_masked_tokens_log_probs_have_no_effect():
    """Perturbing the old and reference log-probs of masked tokens leaves the gradient bitwise unchanged."""
    group = _group(beta=True)
    olds = [o.clone() for o in group.old_logprobs]
    refs = [r.clone() for r in group.ref_logprobs]
    for o, r, m in zip(olds, refs, group.loss_masks):
        o[~m] -= 3.0
        r[~m] -= 5.0
    perturbed = Group(prompt=group.prompt, responses=group.responses, advantages=group.advantages,
                      old_logprobs=olds, ref_logprobs=refs, loss_masks=group.loss_masks)
    out = []
    for g in (group, perturbed):
        model = tiny_model("llama")
        backward_group(model, g, plan="exact", loss=LossConfig("grpo", beta=0.05), chunk_size=8)
        out.append(grads(model))
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("family", ["llama", "qwen3_next-A", "mamba2", "deepseek_v3"])
def test_exact_equals_standard_with_masks(family):
    group = _group(beta=True)
    out = {}
    for plan in ("standard", "exact", "detach"):
        model = tiny_model(family)
        backward_group(model, group, plan=plan, loss=LossConfig("grpo", beta=0.05), chunk_size=8)
        out[plan] = grads(model)
    # deepseek_v3's float32 kernel (its router) works token by token, so chunking rounds it alike in both plans:
    # 9e-16 measured, hence float64's tolerance rather than its family's (FP32_INSIDE, 1e-6).
    tol = EXACT_F64 if family == "deepseek_v3" else gradient_tolerance(family)
    assert_close(f"{family} exact", out["standard"], out["exact"], tol)
    assert (out["detach"] - out["standard"]).norm() > 0  # detach's prompt state is a constant: its bias


@pytest.mark.parametrize("options", [dict(micro_batch=2), dict(checkpoint="layers"), dict(offload_state=True),
                                     dict(micro_batch=3, checkpoint="layers", offload_state=True)])
def test_masks_with_micro_batches_checkpointing_and_offload(options):
    group = _group()
    reference, model = tiny_model("llama"), tiny_model("llama")
    backward_group(reference, group, plan="standard")
    backward_group(model, group, plan="exact", chunk_size=8, **options)
    assert_close(f"{options}", grads(reference), grads(model), 1e-10)


@pytest.mark.parametrize("masks,error,match", [
    (lambda: [torch.ones(n, dtype=torch.bool) for n in LENGTHS[:2]], ValueError, "list of 3 bool tensors"),
    (lambda: [torch.ones(n + 1, dtype=torch.bool) for n in LENGTHS], ValueError, "must have shape \\(6,\\)"),
    (lambda: [torch.ones(n) for n in LENGTHS], TypeError, "must be a torch.bool tensor"),
    (lambda: [torch.zeros(n, dtype=torch.bool) if i == 1 else torch.ones(n, dtype=torch.bool)
              for i, n in enumerate(LENGTHS)], ValueError, "masks every token of responses\\[1\\]"),
])
def test_bad_masks_are_refused_when_the_group_is_built(masks, error, match):
    g = random_group(20, LENGTHS)
    with pytest.raises(error, match=match):
        Group(prompt=g.prompt, responses=g.responses, advantages=g.advantages, loss_masks=masks())


def _unskipped(hidden, weight, targets, keep, loss_of, token_level, *args, **kwargs):
    """The replay's fused pass with every row through the output projection (the path without the skip)."""
    return linear_loss(hidden, weight, targets, torch.ones_like(keep), loss_of, token_level, *args, **kwargs)


@pytest.mark.parametrize("plan", ["exact", "detach"])
@pytest.mark.parametrize("family", ["llama", "qwen3_next-A"])
def test_skipping_masked_tokens_output_projection_changes_nothing(plan, family, monkeypatch):
    """The replay plans run the output projection on loss tokens only: gradients and loss equal those of the same plan
    projecting every token, and exact's those of the standard plan (which does); the log-probs returned are the same
    plan's on loss tokens and NaN on masked ones (standard's too: the loss reads loss tokens only). The projection
    sees exactly the loss tokens' rows (float64)."""
    group = _group(beta=True)
    out = {}
    product = logits_module.accumulated_product
    for path in ("standard", "skipped", "unskipped"):
        model = tiny_model(family)
        rows: list[int] = []  # the output projection's rows, per call

        def counted(h, *args, rows=rows, **kwargs):
            rows.append(h.shape[0])
            return product(h, *args, **kwargs)

        with monkeypatch.context() as m:
            if path == "unskipped":
                m.setattr(replay, "linear_loss", _unskipped)
            m.setattr(logits_module, "accumulated_product", counted)  # where the fused pass forms its logits
            result = backward_group(model, group, plan="standard" if path == "standard" else plan,
                                    loss=LossConfig("grpo", beta=0.05), chunk_size=8, micro_batch=2)
        out[path] = (grads(model), result.loss, result.logprobs, sum(rows))
    loss_tokens = sum(int(m.sum()) for m in group.loss_masks)
    padded = 2 * max(LENGTHS[:2]) + LENGTHS[2]  # two micro-batches: responses 0-1 padded to 9, response 2
    assert out["skipped"][3] == loss_tokens < out["unskipped"][3] == padded
    assert_close(f"{family} {plan} skip", out["unskipped"][0], out["skipped"][0], 1e-12)
    assert abs(out["unskipped"][1] - out["skipped"][1]) <= 1e-12
    if plan == "exact":
        assert_close(f"{family} exact skip vs standard", out["standard"][0], out["skipped"][0],
                     gradient_tolerance(family))
    for std, lp, full, mask in zip(out["standard"][2], out["skipped"][2], out["unskipped"][2], group.loss_masks):
        assert bool(lp[~mask].isnan().all()) and bool(std[mask].isfinite().all())
        assert (lp[mask] - full[mask]).abs().max() <= 1e-12


@pytest.mark.parametrize("family", ["llama", "qwen3_next-A"])
def test_detach_with_masks_equals_standard_at_one_prompt_token(family):
    """P = 1: nothing is captured, so detach is exact; with masks it equals standard with the same masks."""
    group = _group(prompt_len=1, beta=True)
    out = {}
    for plan in ("standard", "detach"):
        model = tiny_model(family)
        backward_group(model, group, plan=plan, loss=LossConfig("grpo", beta=0.05), chunk_size=8, micro_batch=2)
        out[plan] = grads(model)
    assert_close(f"{family} detach P=1", out["standard"], out["detach"], gradient_tolerance(family))


def test_detach_with_masks_equals_exact_before_its_prompt_backward(monkeypatch):
    """With masks, detach's gradient is exact's replay part (exact without its prompt backward), and differs from
    detach without the masks."""
    group = _group(prompt_len=40, beta=True)
    unmasked = Group(prompt=group.prompt, responses=group.responses, advantages=group.advantages,
                     old_logprobs=group.old_logprobs, ref_logprobs=group.ref_logprobs)
    out = {}
    for name, plan, g in (("detach", "detach", group), ("unmasked", "detach", unmasked), ("replay", "exact", group)):
        model = tiny_model("llama")
        with monkeypatch.context() as m:
            if name == "replay":
                m.setattr(exact_plan, "prompt_backward", lambda *args, **kwargs: None)
            backward_group(model, g, plan=plan, loss=LossConfig("grpo", beta=0.05), chunk_size=8, micro_batch=2)
        out[name] = grads(model)
    assert_close("masked detach vs exact's replay", out["detach"], out["replay"], 1e-13)
    assert (out["detach"] - out["unmasked"]).norm() > 1e-3 * out["detach"].norm()


# ------------------------------------------------------------------- masked tokens never refuse a group

@pytest.mark.parametrize("plan", ["standard", "exact", "detach"])
def test_group_results_log_probs_are_accepted_as_old_and_ref_log_probs(plan):
    """`GroupResult.logprobs` of a replay plan (NaN at masked tokens) reused as old and reference log-probs: the
    group is accepted and its gradient equals, bitwise, the one with finite values at those tokens."""
    group = _group(beta=True)
    reused = backward_group(tiny_model("llama"), group, plan="exact", chunk_size=8).logprobs
    assert all(bool(lp[~m].isnan().all()) for lp, m in zip(reused, group.loss_masks))
    finite = [torch.where(m, lp, torch.full_like(lp, -0.7)) for lp, m in zip(reused, group.loss_masks)]
    out = []
    for values in (reused, finite):
        g = Group(prompt=group.prompt, responses=group.responses, advantages=group.advantages, old_logprobs=values,
                  ref_logprobs=values, loss_masks=group.loss_masks)
        model = tiny_model("llama")
        result = backward_group(model, g, plan=plan, loss=LossConfig("grpo", beta=0.05), chunk_size=8)
        assert math.isfinite(result.loss)
        out.append(grads(model))
    assert bool(out[0].isfinite().all()) and float(out[0].norm()) > 0
    assert torch.equal(out[0], out[1])


def test_nan_or_an_unlikely_value_on_a_loss_token_is_still_refused():
    group = _group()
    bad = [lp.clone() for lp in group.old_logprobs]
    bad[1][0] = float("nan")  # response 1's token 0 is in the loss (_masks)
    assert bool(group.loss_masks[1][0])
    with pytest.raises(ValueError, match=r"old_logprobs\[1\] contains NaN or inf at a token in the loss"):
        Group(prompt=group.prompt, responses=group.responses, advantages=group.advantages, old_logprobs=bad,
              loss_masks=group.loss_masks)
    bad[1][0] = -129.0
    g = Group(prompt=group.prompt, responses=group.responses, advantages=group.advantages,
              old_logprobs=[lp.float() for lp in bad], loss_masks=group.loss_masks)
    with pytest.raises(ValueError, match=r"old_logprobs\[1\] reaches -129 at a token in the loss.*never that unlikely"):
        backward_group(tiny_model("llama", dtype=torch.float32), g, plan="exact", chunk_size=8)


def test_the_samplers_own_group_with_unlikely_observation_tokens_trains():
    """A float32 model whose output layer is scaled x1000 samples its argmax (log-prob ~0) and finds the forced
    observation tokens absurdly unlikely (log-probs of hundreds below 0, past the -88 that float32's ratio bound
    refuses on a loss token): the sampler's own group is accepted and trains to a finite gradient equal, bitwise,
    to the one with mild values at the masked tokens."""
    model = tiny_model("llama", dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1000.0)
    prompt = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(3))
    call = int(sample_group(model, prompt, 1, SamplingConfig(max_new_tokens=1, top_k=1)).responses[0][0])
    cfg = SamplingConfig(max_new_tokens=12, call_end=(call,), max_turns=2)
    out = sample_group(model, prompt, 2, cfg, seed=0, chunk_size=8,
                       environment=lambda i, response: torch.tensor([(call + 1 + i) % 512, (call + 7) % 512]))
    masks = out.loss_masks
    assert all(bool((~m).any()) for m in masks)
    lowest = min(float(lp[~m].min()) for lp, m in zip(out.logprobs, masks))
    assert lowest < -129 and min(float(lp[m].min()) for lp, m in zip(out.logprobs, masks)) > -1
    mild = [torch.where(m, lp, torch.full_like(lp, -1.0)) for lp, m in zip(out.logprobs, masks)]
    result = []
    for olds in (out.logprobs, mild):
        group = Group(prompt, out.responses, torch.tensor([1.0, -1.0]), old_logprobs=olds, loss_masks=masks)
        model.zero_grad(set_to_none=True)
        backward_group(model, group, plan="exact", chunk_size=8, prompt_state=out.state)
        result.append(grads(model))
    assert bool(result[0].isfinite().all()) and float(result[0].norm()) > 0
    assert torch.equal(result[0], result[1])

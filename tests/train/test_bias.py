"""The bias meter (`--bias-every`): its numbers equal an independent computation, and it changes nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import faithful_float64

import longstraw.train.trainer
from longstraw.admission.loading import load_model
from longstraw.api.group import backward_group
from longstraw.train import bias
from longstraw.train.config import TrainConfig
from longstraw.train.reporting import Progress, plot_metrics
from longstraw.train.trainer import Trainer

TIME_KEYS = ("peak_memory_bytes", "tokens_per_s", "time_rollout_s", "time_train_s")


pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(tmp_path: Path, name: str, **extra) -> TrainConfig:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": f"Tell me about {w}, briefly.", "answer": w}) + "\n"
                                for w in ("cats", "rain", "maps", "tea")))
    return TrainConfig.from_flat(model="tiny-llama", dtype="float64", task="jsonl", data=str(data),
                                 reward_fn="rewards_for_tests:even_byte_fraction", group_size=4, max_new_tokens=6,
                                 chunk_size=8, lr=1e-3, plan="detach", steps=3, eval_prompts=0, plot=False,
                                 run_dir=str(tmp_path / name), **extra)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def test_meter_equals_an_independent_computation_and_leaves_the_run_bit_identical(tmp_path, monkeypatch):
    """Three steps of a metered detach run (A) next to an unmetered one (B). Before each step, a third trainer (C)
    loads B's weights, rolls out the same group (same seed, same weights) and computes the detach and the exact
    gradient with backward_group directly; A's logged cosine and relative error must match them to 1e-8, and A's
    metrics and weights must equal B's bit for bit. Float64, RMSNorm computed in float64 (helpers.faithful_float64)."""
    monkeypatch.setattr(longstraw.train.trainer, "load_model", lambda *a, **k: faithful_float64(load_model(*a, **k)))
    a = Trainer(_cfg(tmp_path, "a", bias_every=1))
    b = Trainer(_cfg(tmp_path, "b"))
    c = Trainer(_cfg(tmp_path, "c"))
    cfg = c.cfg
    seen = []
    for step in range(3):
        c.model.load_state_dict(b.model.state_dict())
        r = c.sampler.rollout(c.model, step, 0, c.data.examples(step)[0])
        grads = {}
        for plan in ("detach", "exact"):
            c.model.zero_grad(set_to_none=True)
            backward_group(c.model, r.group, plan=plan, chunk_size=cfg.plan.chunk_size,
                           micro_batch=cfg.plan.micro_batch, loss=cfg.plan.loss_config())
            grads[plan] = _flat(c.model)
        gd, ge = grads["detach"], grads["exact"]
        cosine = float(gd @ ge / (gd.norm() * ge.norm()))
        rel_error = float((gd - ge).norm() / ge.norm())

        ma = a.train_step(step, Progress(3, enabled=False))
        mb = b.train_step(step, Progress(3, enabled=False))
        assert ma["reward_mean"] == pytest.approx(float(r.rewards.mean()), abs=0)  # the same group was scored
        assert ma["bias_cosine"] == pytest.approx(cosine, abs=1e-8, rel=0)
        assert ma["bias_rel_error"] == pytest.approx(rel_error, abs=1e-8, rel=1e-8)
        assert ma["bias_norm_ratio"] == pytest.approx(float(gd.norm() / ge.norm()), rel=1e-8)
        assert ma["time_bias_s"] > 0 and not any(k.startswith("bias") for k in mb)
        assert {k: v for k, v in ma.items() if k not in TIME_KEYS and not k.startswith(("bias", "time_bias"))} == {
            k: v for k, v in mb.items() if k not in TIME_KEYS}
        for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
            assert torch.equal(pa, pb), (step, name)
        for sa, sb in zip(a.optimizer.state.values(), b.optimizer.state.values()):
            assert all(torch.equal(sa[k], sb[k]) for k in sa)
        seen.append((cosine, rel_error, ma["grad_norm"]))
    # The comparison means something: the steps trained, and detach's gradient really differs from the exact one.
    assert all(g > 0 for _, _, g in seen)
    assert all(cos < 1 - 1e-6 and rel > 1e-4 for cos, rel, _ in seen), seen


def test_exact_gradient_restores_grads_and_rng(tiny_llama64):
    """The meter's exact pass puts back the very .grad tensors and every RNG state, and returns the mean
    gradient of its groups."""
    from helpers import random_group

    model = tiny_llama64
    groups = [random_group(12, [3, 5], seed=1), random_group(9, [4, 2, 6], seed=2)]
    cfg = TrainConfig.from_flat(plan="detach", bias_every=1, chunk_size=4)
    model.zero_grad(set_to_none=True)
    backward_group(model, groups[0], plan="detach", chunk_size=4)
    before = [p.grad for p in model.parameters()]
    copies = [g.clone() if g is not None else None for g in before]
    rng = torch.get_rng_state()
    exact = bias.exact_gradient(model, groups, cfg)
    assert all(p.grad is g for p, g in zip(model.parameters(), before))
    assert all(g is None and c is None or torch.equal(g, c) for g, c in zip(before, copies))
    assert torch.equal(torch.get_rng_state(), rng)
    model.zero_grad(set_to_none=True)
    for g in groups:
        backward_group(model, g, plan="exact", chunk_size=4)
    mean = [p.grad / 2 for p in model.parameters()]
    assert all(torch.allclose(x, y, rtol=0, atol=1e-15) for x, y in zip(exact, mean))
    model.zero_grad(set_to_none=True)


def test_compare_gradients_known_values():
    out = bias.compare_gradients([torch.tensor([3.0, 0.0]), None], [torch.tensor([3.0, 4.0]), None])
    assert out["bias_cosine"] == pytest.approx(0.6) and out["bias_rel_error"] == pytest.approx(0.8)
    assert out["bias_norm_ratio"] == pytest.approx(0.6)
    # A parameter with a gradient on one side only counts as zeros on the other.
    out = bias.compare_gradients([None, torch.tensor([1.0])], [torch.tensor([1.0]), torch.tensor([1.0])])
    assert out["bias_cosine"] == pytest.approx(1 / math.sqrt(2)) and out["bias_rel_error"] == pytest.approx(
        1 / math.sqrt(2))
    zero = bias.compare_gradients([torch.zeros(2)], [torch.zeros(2)])
    assert all(math.isnan(v) for v in zero.values())  # no direction: NaN, not a made-up number


def test_bias_every_config_errors_and_plot(tmp_path):
    with pytest.raises(ValueError, match="the exact plan computes the exact gradient itself"):
        TrainConfig.from_flat(plan="exact", bias_every=2)
    with pytest.raises(ValueError, match="bias_every must be >= 0"):
        TrainConfig.from_flat(plan="detach", bias_every=-1)
    assert TrainConfig.from_flat(plan="standard", bias_every=0).run.bias_every == 0
    assert not bias.due(TrainConfig.from_flat(plan="detach", bias_every=3), 1)
    assert bias.due(TrainConfig.from_flat(plan="detach", bias_every=3), 2)  # the 3rd step (0-based 2)
    rows = [{"step": s, "reward_mean": 0.5, "reward_max": 1.0, "peak_memory_bytes": 2**20,
             **({"bias_cosine": 0.9, "bias_rel_error": 0.4} if s % 2 == 0 else {})} for s in (1, 2, 3, 4)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_metrics(metrics, tmp_path / "progress.png") and (tmp_path / "progress.png").stat().st_size > 0

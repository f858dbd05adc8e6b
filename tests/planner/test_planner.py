"""`longstraw plan`: state formulas against the engine's real state, sharding arithmetic, CLI errors, and the
planner's prediction against measured peaks (each plan, two architectures) within 15%."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks.memory import B1, run_one
from longstraw import Group, backward_group, load_model
from longstraw.cli import main
from longstraw.planner import (
    PLANS,
    PlanInputs,
    estimate,
    largest_prompt,
    load_config,
    parse_size,
    spec_from_config,
    state_bytes,
    state_parts,
)

TOLERANCE = 0.15  # the planner's bound on |predicted / measured - 1| of the training-step memory


def _spec(name: str):
    return spec_from_config(load_config(name), name)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "b1-llama"])
def test_state_formula_matches_the_engines_captured_state(name):
    model = load_model(name)
    gen = torch.Generator().manual_seed(0)
    p = 97  # not a multiple of the chunk: a short last chunk
    group = Group(prompt=torch.randint(0, 500, (p,), generator=gen),
                  responses=[torch.randint(0, 500, (5,), generator=gen)], advantages=torch.ones(1))
    stats = backward_group(model, group, plan="detach", chunk_size=32).stats
    predicted, grad = state_bytes(_spec(name), p - 1, 4, 32, exact=False)
    assert stats["prompt_state_bytes"] == predicted and grad == 0
    _, grad_exact = state_bytes(_spec(name), p - 1, 4, 32, exact=True)
    assert grad_exact == predicted  # K/V both carry gradient


def test_param_counts_match_the_instantiated_models():
    for name in ("b1-llama", "b1-qwen3"):
        model = load_model(name)
        unique = {id(p): p.numel() for p in model.parameters()}
        assert _spec(name).params == sum(unique.values()), name
    assert _spec("b1-qwen3").tied and not _spec("b1-llama").tied


def test_builtin_paper_scale_descriptions():
    hybrid = _spec("hybrid-27b")
    assert 26e9 < hybrid.params < 28e9
    assert hybrid.mixers.count("attention") == 16 and hybrid.mixers.count("linear") == 48
    glm = _spec("glm5-class")
    assert 700e9 < glm.params < 800e9 and glm.expert_params > 0.9 * glm.params
    assert set(glm.mixers) <= {"dsa", "mla"}
    # Only the 16 attention layers grow with P: doubling P doubles the growing part exactly.
    s1, _ = state_bytes(hybrid, 1000, 2, 2048, exact=False)
    s2, _ = state_bytes(hybrid, 2000, 2, 2048, exact=False)
    s3, _ = state_bytes(hybrid, 3000, 2, 2048, exact=False)
    assert s2 - s1 == s3 - s2 == 1000 * 16 * 2 * 4 * 256 * 2
    assert s1 - (s2 - s1) > 0  # the constant recurrent states of the 48 linear layers
    # DSA: indexer keys are kept but carry no gradient.
    state, grad = state_bytes(glm, 1000, 2, 2048, exact=True)
    assert 0 < grad < state


def test_sharding_and_context_parallel_divide_what_they_should():
    spec = _spec("hybrid-27b")
    one = PlanInputs(prompt_tokens=2**20, response_tokens=1024, group_size=8, gpus=1)
    eight = replace(one, gpus=8)
    cp8 = replace(one, gpus=8, cp=8)
    e1, e8, c8 = (estimate(spec, x, "exact").components for x in (one, eight, cp8))
    assert e8["weights"] == e1["weights"] // 8 and e8["optimizer"] == e1["optimizer"] // 8
    assert e8["prompt_state"] == e1["prompt_state"] and "fsdp_gathered" in e8 and "fsdp_gathered" not in e1
    # Context parallelism shards the attention state; every rank computes every chunk, so each holds all the
    # recurrent states (the exact plan's chunk-boundary states included) and their gradient.
    parts = state_parts(spec, 2**20 - 1, 2, 2048, exact=True)
    assert parts.recurrent > 0 and parts.attention > 0
    assert c8["prompt_state"] == math.ceil(parts.attention / 8) + parts.recurrent
    assert c8["state_gradients"] == math.ceil(parts.attention_grad / 8) + parts.recurrent_grad
    llama = _spec("b1-llama")
    one_l, cp8_l = (estimate(llama, x, "exact").components for x in (one, cp8))
    assert cp8_l["prompt_state"] == pytest.approx(one_l["prompt_state"] / 8, abs=1)
    # G does not change the replay plans' peak; it multiplies standard_batched's activations.
    g2, g8 = replace(cp8, group_size=2), cp8
    assert estimate(spec, g2, "detach").total_bytes == estimate(spec, g8, "detach").total_bytes
    sb2, sb8 = estimate(spec, g2, "standard_batched"), estimate(spec, g8, "standard_batched")
    assert sb8.components["sequence_activations"] == 4 * sb2.components["sequence_activations"]
    # Per-layer activation checkpointing keeps less than the full activations.
    ckpt = estimate(spec, replace(cp8, checkpoint_layers=True), "exact").components
    full = estimate(spec, cp8, "exact").components
    assert ckpt["replay_activations"] < full["replay_activations"] / 4
    assert ckpt["prompt_backward_chunk"] < full["prompt_backward_chunk"]
    assert ckpt["prompt_state"] == full["prompt_state"]
    # Exact keeps a recurrent state per chunk boundary: a larger chunk keeps fewer.
    assert estimate(spec, replace(cp8, chunk_size=8192), "exact").components["prompt_state"] < full["prompt_state"]


def test_offloaded_state_leaves_one_layer_on_the_device():
    """With checkpointing, an offloaded state puts one layer's attention part (and one recurrent state) on the
    device and the rest in host memory; without checkpointing every layer's copy is saved, so nothing is gained."""
    spec = _spec("hybrid-27b")
    base = PlanInputs(prompt_tokens=2**20, response_tokens=1024, group_size=8, gpus=8, cp=8, checkpoint_layers=True)
    resident = estimate(spec, base, "exact").components
    off = estimate(spec, replace(base, offload_state=True), "exact").components
    parts = state_parts(spec, 2**20 - 1, 2, 2048, exact=True)
    assert "state_in_host_memory" not in off  # host memory is no GPU row: it is not in the GPU's peak either
    assert estimate(spec, replace(base, offload_state=True), "exact").host_bytes == \
        resident["prompt_state"] + resident["state_gradients"]
    layer, f = math.ceil(parts.largest_layer / 8), 2048 / (2**20 - 1)
    copies = max(layer, math.ceil(layer * (1 - f) + parts.attention_grad / 8 * f))
    # On a GPU the next attention layer's copies are prefetched on a side stream: one more layer on the device.
    assert off["prompt_state"] == max(2 * layer, math.ceil(2 * layer * (1 - f) + parts.attention_grad / 8 * f)) + \
        parts.recurrent_grad
    assert estimate(spec, replace(base, offload_state=True, device="cpu"), "exact").components[
        "prompt_state"] == copies + parts.recurrent_grad  # (no prefetch on the CPU)
    assert off["prompt_state"] < resident["prompt_state"] / 20
    no_ckpt = estimate(spec, replace(base, offload_state=True, checkpoint_layers=False), "exact").components
    assert no_ckpt["prompt_state"] == estimate(spec, replace(base, checkpoint_layers=False), "exact").components[
        "prompt_state"]


def test_beyond_max_positions_nothing_fits(capsys):
    """A 2048-position model never 'fits' a 100,000-token prompt, and the table says why."""
    spec = _spec("tiny-llama")
    assert spec.max_positions == 2048
    inp = PlanInputs(prompt_tokens=100_000, response_tokens=16, group_size=4, device="cpu")
    for plan in PLANS:
        est = estimate(spec, inp, plan)
        assert not est.fits and not est.within_positions
        assert largest_prompt(spec, replace(inp, gpu_memory=10**15), plan) == 2048 - 16
    main(["plan", "--model", "tiny-llama", "--prompt-tokens", "100000", "--response-tokens", "16",
          "--group-size", "4"])
    assert "exceeds the model's max_position_embeddings (2,048)" in capsys.readouterr().out


def test_largest_prompt_is_the_boundary():
    spec = replace(_spec("b1-llama"), max_positions=0)  # memory alone (the 131,072 positions would cap detach)
    inp = PlanInputs(prompt_tokens=2, response_tokens=256, group_size=8, dtype="fp32", gpu_memory=parse_size("1GiB"),
                     device="cpu", optimizer="none")
    for plan in PLANS:
        p = largest_prompt(spec, inp, plan)
        assert p is not None and p > 2, plan
        assert estimate(spec, replace(inp, prompt_tokens=p), plan).fits
        assert not estimate(spec, replace(inp, prompt_tokens=p + 1), plan).fits
    sizes = {plan: largest_prompt(spec, inp, plan) for plan in PLANS}
    assert sizes["standard_batched"] < sizes["standard"] < sizes["exact"] < sizes["detach"]


def test_parse_size():
    assert parse_size("96GB") == 96 * 10**9 and parse_size("24GiB") == 24 * 2**30
    assert parse_size("1.5 TB") == 1.5e12 and parse_size("512mib") == 512 * 2**20
    for bad in ("96", "ninety GB", "96 parsecs", "-1GB", "0GB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_size(bad)


def test_cli_json_and_table(capsys, tmp_path):
    args = ["plan", "--model", "b1-llama", "--prompt-tokens", "4096", "--response-tokens", "256",
            "--group-size", "8", "--gpus", "1", "--gpu-memory", "1GiB", "--dtype", "fp32"]
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["plans"]) == set(PLANS)
    for plan, entry in doc["plans"].items():
        assert entry["total_bytes"] == max(entry["phases"].values()), plan
        assert isinstance(entry["fits"], bool) and "prompt_state_bytes" in entry
        assert all(isinstance(v, int) for v in entry["components"].values())
    assert doc["plans"]["exact"]["prompt_state_bytes"] == doc["plans"]["detach"]["prompt_state_bytes"] > 0
    assert doc["plans"]["exact"]["components"]["state_gradients"] > 0
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "prompt_state" in table and "largest prompt" in table and "fits" in table
    # A local config.json (directory or file) works without the hub.
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100).save_pretrained(tmp_path)
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        assert main(["plan", "--model", model, "--prompt-tokens", "100", "--response-tokens", "10",
                     "--group-size", "2", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["model"]["layers"] == 2


@pytest.mark.parametrize("family, kinds", [
    ("cohere2", {"sliding": 1, "attention": 1}),
    ("glm4_moe", {"attention": 2}),
    ("nemotron_h", {"mamba": 1, "attention": 1, "none": 2}),  # its MLP and MoE blocks mix no tokens
])
def test_plan_reads_the_added_families(family, kinds, capsys, tmp_path):
    """`longstraw plan` on a directory holding the tests' tiny config of each family: every plan is estimated."""
    from helpers import tiny_config

    tiny_config(family).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--prompt-tokens", "500", "--response-tokens", "50",
                 "--group-size", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["model_type"] == family and doc["model"]["layer_kinds"] == kinds
    assert set(doc["plans"]) == set(PLANS) and doc["plans"]["exact"]["prompt_state_bytes"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory", "lots"], "cannot read memory size 'lots'"),
    (["--gpu-memory", "96"], "cannot read memory size '96'"),
    (["--model", "not-a-preset/nor/a-hub-id"], "unknown model 'not-a-preset/nor/a-hub-id'"),
    (["--cp", "4"], "--cp 4 needs at least as many GPUs"),
    (["--prompt-tokens", "1"], "--prompt-tokens must be >= 2"),
    (["--group-size", "0"], "must be >= 1"),
])
def test_cli_errors(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = {"--model": "b1-llama", "--prompt-tokens": "100", "--response-tokens": "10", "--group-size": "2"}
    for i in range(0, len(argv), 2):
        base[argv[i]] = argv[i + 1]
    args = ["plan"] + [x for kv in base.items() for x in kv]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- validated against measurement


def _measure_and_predict(models, prompt_tokens, response_tokens, groups, chunk_size):
    """Run every (model, plan, G) in a fresh bench worker (two at a time: peaks are per process) and pair each
    measured step peak with the planner's prediction for the same configuration on CPU."""
    configs = [(m, plan, g) for m in models for g in groups for plan in PLANS]

    def one(cfg):
        model, plan, g = cfg
        bench = replace(B1, model=model, prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                        chunk_size=chunk_size)
        return run_one(bench, plan, g)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, configs))
    rows = []
    for (model, plan, g), entry in zip(configs, results):
        assert entry["status"] == "ok", f"{model} {plan} G={g}: {entry.get('error')}\n{entry.get('stderr_tail')}"
        inp = PlanInputs(prompt_tokens=prompt_tokens, response_tokens=response_tokens, group_size=g,
                         dtype="fp32", chunk_size=chunk_size, device="cpu", optimizer="none")
        est = estimate(_spec(model), inp, plan)
        rows.append((model, plan, g, entry["peak_bytes"], est.step_bytes, est.peak_phase))
    return rows


def _check(rows):
    report = "\n".join(f"{m:9} {p:17} G={g:<2} measured {meas / 2**20:8.1f} MiB  predicted {pred / 2**20:8.1f} MiB "
                       f"({100 * (pred / meas - 1):+.1f}%, peak in {phase})" for m, p, g, meas, pred, phase in rows)
    print(report)
    for model, plan, g, measured, predicted, _ in rows:
        assert abs(predicted / measured - 1) <= TOLERANCE, f"{model} {plan} G={g}\n{report}"
    # The exact plan's two peaks (replay, prompt backward) are both exercised somewhere in the comparison.
    return {phase for _, plan, *_, phase in rows if plan == "exact"}


@pytest.mark.slow  # ~40 s of fresh-process measurements; the recorded measurements check every formula by default
def test_planner_matches_measured_peaks_reduced_b1():
    """B1's model shapes (llama and qwen3) at P=1024, R=128, G=2, one prompt chunk: every plan within 15% of the
    measured step; here exact peaks in its prompt backward."""
    assert "prompt_backward" in _check(_measure_and_predict(("b1-llama", "b1-qwen3"), 1024, 128, (2,), 1024))


@pytest.mark.slow
def test_planner_matches_measured_peaks_full_b1():
    """Bench B1 itself (P=4096, R=256) at G in {2, 8} for llama and qwen3."""
    assert _check(_measure_and_predict(("b1-llama", "b1-qwen3"), 4096, 256, (2, 8), 2048))


def test_state_growth_per_layer_kind():
    """Mamba2 keeps a constant state; sliding-window layers stop growing at W; MLA grows by its latent."""
    from transformers import DeepseekV3Config, Mamba2Config, MistralConfig

    mamba = spec_from_config(Mamba2Config(hidden_size=256, num_hidden_layers=2, num_heads=8, head_dim=64,
                                          state_size=16, n_groups=1, vocab_size=1000))
    assert state_bytes(mamba, 1000, 2, 256, exact=False) == state_bytes(mamba, 100_000, 2, 256, exact=False)
    # exact keeps one state per chunk boundary
    assert state_bytes(mamba, 4096, 2, 256, exact=True)[0] == 16 * state_bytes(mamba, 4096, 2, 256, exact=False)[0]
    window = spec_from_config(MistralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, sliding_window=512,
                                            vocab_size=1000))
    assert set(window.mixers) == {"sliding"}
    # detach keeps the whole capture chunks (256) that reach into the last W-1 = 511 positions: bounded in P
    per_token = 2 * 2 * 2 * 32 * 2  # layers * (K, V) * Hkv * D * bytes
    for p in (50_000, 100_000, 1_000_000):
        kept = state_bytes(window, p, 2, 256, exact=False)[0] // per_token
        assert 511 <= kept < 511 + 256
    # exact keeps them all (the reverse prompt backward reads them as chunk boundaries)
    assert state_bytes(window, 50_000, 2, 256, exact=True)[0] == 50_000 * per_token
    mla = spec_from_config(DeepseekV3Config(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32,
                                            q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                            vocab_size=1000))
    assert mla.mlps == ("dense", "moe") and mla.expert_params > 0
    assert state_bytes(mla, 1000, 2, 256, exact=False)[0] == 1000 * 2 * (32 + 8) * 2


# ---------------------------------------------------------------- recurrent layers (gated DeltaNet, Mamba2)

RECURRENT_TOLERANCE = 0.10  # |predicted / measured - 1| of the step memory, b1-mamba2 and b1-qwen3-next
RECURRENT_MODELS = ("b1-mamba2", "b1-qwen3-next")
RECURRENT_CASES = [(plan, checkpoint) for plan in ("standard", "detach", "exact") for checkpoint in ("none", "layers")]


def test_recurrent_scans_pad_to_their_chunk_and_capture_counts_them():
    """The torch scans pad a segment to whole chunks (Mamba2: the config's 256; gated delta rule: 64), so a
    128-token replay costs a 256-token scan; the capture of a 2048-token chunk peaks at 186 MiB through b1-mamba2
    and 71 MiB through b1-qwen3-next (measured in-process: VmHWM above the loaded model, P = 4096), where the
    attention-only term gave 8 and 34."""
    from longstraw.planner import recurrent_bytes

    mamba = _spec("b1-mamba2")
    assert mamba.mamba_chunk == 256
    r1, r128, r256 = (recurrent_bytes(mamba, "mamba", t, 4) for t in (1, 128, 256))
    assert r128.saved > 0.8 * r256.saved and r1.saved > 0.6 * r256.saved  # the scan's (c x c) blocks dominate
    assert recurrent_bytes(mamba, "mamba", 257, 4).saved > 1.8 * r256.saved  # one token more: a second chunk
    assert recurrent_bytes(mamba, "mamba", 128, 4, batch=2).saved > 2 * r128.saved  # a batch pads every row
    linear = _spec("b1-qwen3-next")
    lin64 = recurrent_bytes(linear, "linear", 64, 4)
    # one token past a 64-token chunk: a second chunk of six (64 x 64) fp32 matrices per value head
    assert recurrent_bytes(linear, "linear", 65, 4).saved - lin64.saved >= 64 * 6 * linear.lin_value_heads * 64 * 4
    inp = PlanInputs(prompt_tokens=4096, response_tokens=128, group_size=2, dtype="fp32", chunk_size=2048,
                     device="cpu", optimizer="none")
    for name, measured in (("b1-mamba2", 185.7), ("b1-qwen3-next", 70.7)):
        for plan in ("detach", "exact"):
            est = estimate(_spec(name), inp, plan)
            capture = (est.phases["capture"] - (est.total_bytes - est.step_bytes)) / 2**20
            assert abs(capture / measured - 1) <= RECURRENT_TOLERANCE, (name, plan, capture)


@pytest.mark.parametrize("name", RECURRENT_MODELS)
def test_recurrent_saved_bytes_match_saved_tensor_hooks(name):
    """What autograd saves in a 100-token replay segment (padded to 256 by b1-mamba2's scan, to 128 by the gated
    delta rule), counted with saved-tensor hooks (distinct storages, weights excluded), against
    `planner.model_activation_bytes`: within 8% (measured: b1-mamba2 -2.2%, b1-qwen3-next +3.1%)."""
    from longstraw.engine.hf.segment import run_segment
    from longstraw.engine.state.capture import capture_prompt
    from longstraw.planner import model_activation_bytes

    model = load_model(name)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, 1000, (164,), generator=torch.Generator().manual_seed(0))
    state = capture_prompt(model, ids[:64], 64, keep_boundaries=False)
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_segment(model, ids[64:].unsqueeze(0), 64, state.fork())
    predicted = model_activation_bytes(_spec(name), 4, 4, "replay", 100)
    assert abs(predicted / sum(saved.values()) - 1) <= 0.08


@pytest.mark.slow
def test_planner_matches_measured_peaks_recurrent():
    """b1-mamba2 and b1-qwen3-next (3 gated-DeltaNet + 1 attention layer, MoE) at P = 4096, R = 128, G = 2, chunk
    2048: standard, detach and exact, each with and without per-layer activation checkpointing, within 10% of the
    measured step (7 min on 2 idle CPU cores; bench/results/memory-b1-*-4k-recurrent-20261130.json)."""
    jobs = [(model, plan, checkpoint) for model in RECURRENT_MODELS for plan, checkpoint in RECURRENT_CASES]

    def one(job):
        model, plan, checkpoint = job
        bench = replace(B1, model=model, prompt_tokens=4096, response_tokens=128, chunk_size=2048)
        return run_one(bench, plan, 2, checkpoint)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, jobs))
    rows = []
    for (model, plan, checkpoint), entry in zip(jobs, results):
        assert entry["status"] == "ok", f"{model} {plan}/{checkpoint}: {entry.get('error')}\n{entry.get('stderr_tail')}"
        inp = PlanInputs(prompt_tokens=4096, response_tokens=128, group_size=2, dtype="fp32", chunk_size=2048,
                         device="cpu", optimizer="none", checkpoint_layers=checkpoint == "layers")
        est = estimate(_spec(model), inp, plan)
        rows.append((model, f"{plan}/{checkpoint}", entry["peak_bytes"], est.step_bytes, est.peak_phase))
    report = "\n".join(f"{m:14} {c:16} measured {meas / 2**20:8.1f} MiB  predicted {pred / 2**20:8.1f} MiB "
                       f"({100 * (pred / meas - 1):+.1f}%, peak in {phase})" for m, c, meas, pred, phase in rows)
    print(report)
    for model, case, measured, predicted, _ in rows:
        assert abs(predicted / measured - 1) <= RECURRENT_TOLERANCE, f"{model} {case}\n{report}"


# Every recorded measurement of the engine that the planner claims (bench/results/, written by `python -m benchmarks
# memory`/`bench pareto`/`bench stress`). b1-deepseek-v3 (MLA + MoE): its masked-path and math-SDPA score terms are
# located on the B1 runs (memory-b1-deepseek-v3-4k-20261129-1213/-1240) and checked on a second shape
# (memory-b1-deepseek-v3-2k-all-plans-20261130).
RECORDED = (
    "memory-deep-smollm2-2k-all-plans-20261130", "memory-deep-smollm2-16k-replay-plans-20261130",
    "memory-deep-smollm2-16k-exact-ckpt-20261130", "memory-deep-smollm2-16k-standard-ckpt-20261130",
    "memory-b1-mamba2-4k-recurrent-20261130", "memory-b1-mamba2-8k-r100-chunk1024-recurrent-20261130",
    "memory-b1-qwen3-next-4k-recurrent-20261130", "memory-b1-qwen3-next-8k-r100-chunk1024-recurrent-20261130",
    "memory-b1-llama-4k-20261129-1300", "pareto-b1-llama-4k-20261206", "pareto-b1-llama-4k-levers-20261130",
    "prompt-b1-llama-1GiB-20261129",
    "stress-tiny-llama-long-exact-20261129", "stress-tiny-mamba2-131k-exact-20261130",
    "memory-b1-deepseek-v3-4k-20261129-1213", "memory-b1-deepseek-v3-4k-20261129-1240",
    "memory-b1-deepseek-v3-2k-all-plans-20261130",
    # exact with kept capture graphs (keep_prompt_graph 0/1/2, with and without checkpointing)
    "pareto-b1-llama-4k-keep-20261130", "pareto-deep-smollm2-2k-keep-20261130",
    # multi-turn groups (3 turns of 64 generated + 128 observation tokens per response), G = 2, 8 and 16
    "memory-b1-llama-8k-agent-turns-20261206", "memory-b1-llama-8k-agent-turns-g16-20261206",
    # routed-expert families read generically (config.json beside the results: bench/results/b1-qwen3-moe/,
    # b1-gpt-oss/): standard, detach, exact at P = 4096, and with per-layer checkpointing
    "memory-b1-qwen3-moe-4k-20261202", "memory-b1-qwen3-moe-4k-ckpt-20261202", "memory-b1-gpt-oss-4k-20261202",
    "memory-b1-gpt-oss-4k-ckpt-20261202",
)


@pytest.mark.parametrize("name", RECORDED)
def test_planner_against_recorded_measurements(name):
    """The planner's step memory within 10% of every configuration measured in `bench/results/<name>.json`, so a
    formula change is checked against all the measurements at once (without rerunning hours of benchmarks)."""
    from pathlib import Path

    root = Path(__file__).parents[2]
    document = json.loads((root / "bench" / "results" / f"{name}.json").read_text())
    config = document["config"]
    model = config["model"]  # a preset, or a directory of the repository holding the model's config.json
    spec = _spec(str(root / model) if (root / model).is_dir() else model)
    # A multi-turn response (`bench memory --turns`) holds turns x (generated + observation) tokens, all of which
    # run through the model
    response_tokens = config.get("turns", 1) * (config["response_tokens"] + config.get("observation_tokens", 0))
    rows = []
    for entry in document["results"]:
        if entry.get("status") != "ok":
            continue
        stats = entry["stats"]
        inp = PlanInputs(
            prompt_tokens=stats["prompt_tokens"], response_tokens=response_tokens,
            group_size=entry["group_size"], dtype=config.get("dtype", "float32"),
            chunk_size=entry.get("chunk_size", config.get("chunk_size", 2048)),
            micro_batch=entry.get("micro_batch", config.get("micro_batch", 1)), device="cpu", optimizer="none",
            checkpoint_layers=entry.get("checkpoint", "none") == "layers",
            offload_state=bool(stats.get("offload_state", False)),
            keep_prompt_graph=int(stats.get("keep_prompt_graph", 0)))
        predicted = estimate(spec, inp, entry["plan"]).step_bytes
        rows.append((f"{entry['plan']} P={inp.prompt_tokens} G={inp.group_size} k={inp.micro_batch} "
                     f"chunk={inp.chunk_size} ckpt={inp.checkpoint_layers} offload={inp.offload_state} "
                     f"keep={inp.keep_prompt_graph}",
                     entry["peak_bytes"], predicted))
    assert rows, f"{name}: no measured configuration"
    report = "\n".join(f"{c}: measured {m / 2**20:.1f} MiB, predicted {p / 2**20:.1f} MiB ({100 * (p / m - 1):+.1f}%)"
                       for c, m, p in rows)
    for case, measured, predicted in rows:
        assert abs(predicted / measured - 1) <= 0.10, f"{name} {case}\n{report}"


def test_recorded_multi_turn_peak_is_flat_in_group_size():
    """The recorded multi-turn groups (b1-llama, P = 8192, 3 turns of 64 generated + 128 observation tokens): exact's
    peak grows by at most 5% from G = 2 to G = 16, as the file's `peak_growth` says and its peaks show."""
    document = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" /
                           "memory-b1-llama-8k-agent-turns-g16-20261206.json").read_text())
    growth = document["ratios"]["peak_growth"]["exact"]
    assert (growth["from_g"], growth["to_g"]) == (2, 16) and growth["pct"] <= 5.0
    peaks = {e["group_size"]: e["peak_bytes"] for e in document["results"]
             if e["plan"] == "exact" and e.get("status") == "ok"}
    assert abs(100 * (peaks[16] / peaks[2] - 1) - growth["pct"]) < 1e-9


def test_observation_tokens_cost_what_response_tokens_cost(capsys):
    """An agent's observation tokens run through the model like generated ones, masked from the loss: the forecast
    for R generated + O observation tokens is the forecast for R + O, except that detach's and exact's log-prob
    transient counts the R loss tokens only (the replay scores no masked token; measured on `bench tree`'s leaves,
    tests/planner/test_tree.py), and the header says so."""
    from longstraw.cli import main

    base = ["plan", "--model", "b1-llama", "--prompt-tokens", "8192", "--group-size", "8", "--dtype", "float32",
            "--device", "cpu", "--json"]
    assert main([*base, "--response-tokens", "192", "--observation-tokens", "384"]) == 0
    agent = json.loads(capsys.readouterr().out)
    assert main([*base, "--response-tokens", "576"]) == 0
    plain = json.loads(capsys.readouterr().out)
    for name, plan in agent["plans"].items():
        other = plain["plans"][name]
        if name in ("detach", "exact"):
            assert plan["components"]["logprob_chunk"] < other["components"]["logprob_chunk"]
            assert plan["phases"]["replay"] < other["phases"]["replay"]
            assert plan["total_bytes"] <= other["total_bytes"]  # (exact's peak may be its prompt backward's)
            assert plan["components"]["replay_activations"] == other["components"]["replay_activations"]
        else:
            assert plan["total_bytes"] == other["total_bytes"], name
    assert agent["inputs"]["observation_tokens"] == 384 and agent["inputs"]["response_tokens"] == 576
    assert main([*base[:-1], "--response-tokens", "192", "--observation-tokens", "384"]) == 0
    assert "R=576 (of which 384 observation tokens)" in capsys.readouterr().out


def test_trl_scale_rows_against_the_planner():
    """`bench trl-scale`'s recorded per-rank step peaks (2 CPU processes, b1-llama, P = 8192, G = 8) against the
    planner's forecast of each row, recomputed now from the command the result file records, every row within 10%:
    TRL's rows (standard_batched, layer-wise FSDP), LongStraw DDP, and LongStraw's FSDP2 rows, whose `sharded_compute`
    gathers every parameter and holds the full gradient through the step. FSDP2 + cp 2 peaks in the reduce-scatter at
    the block's end (the `gradient_reduce` phase), FSDP2 at cp 1 in the replay. A second run measured FSDP2 + cp 2
    again beside the same gathering a layer at a time (`--fsdp-gather layer`), and a third both at deep-smollm2
    (P = 2048, G = 4), where the layers hold most of the parameters."""
    import shlex

    results = Path(__file__).resolve().parents[2] / "bench/results"
    rows = []
    for name in ("trl-scale-b1-llama-8k-20261201-132700.json", "trl-scale-b1-llama-8k-layer-20261201.json",
                 "trl-scale-deep-smollm2-2k-layer-20261201.json"):
        document = json.loads((results / name).read_text())
        rows += [(f"{name}:{row['id']}", row) for row in document["results"]]
    ratios = {}
    for row_id, row in rows:
        command = shlex.split(row["forecast"]["command"].split("  (column")[0])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*command[1:], "--json"]) == 0
        plan = json.loads(out.getvalue())["plans"][row["forecast"]["plan"]]
        ratios[row_id] = row["step_peak_bytes"] / (plan["total_bytes"] - plan["components"]["weights"])
        if row["id"] == "longstraw-fsdp2-cp2" and "b1-llama" in row_id:
            assert plan["peak_phase"] == "gradient_reduce"
    assert len(ratios) == 9
    for row_id, ratio in ratios.items():
        assert 0.9 <= ratio <= 1.1, (row_id, ratio)


def test_gradient_reduce_phase_from_the_shapes():
    """LongStraw's plans under FSDP with every parameter gathered end in a reduce-scatter of the largest unit's
    gradient (b1-llama: the (V, d) embedding / output projection, 31.25 MiB fp32), on top of the gathered parameters
    and the full gradient: 2.5 units on 2 CPU processes (flat input, gloo's copy of it, the rank's half), 1.5 on CUDA.
    With a layer gathered at a time only the units that are not layers are left to reduce there (the largest is
    the same (V, d) matrix), on top of those units gathered and their gradient. Replicated (DDP) and the standard
    plans have no such phase."""
    spec = _spec("b1-llama")
    unit = spec.vocab * spec.hidden * 4
    base = PlanInputs(prompt_tokens=8192, response_tokens=128, group_size=8, dtype="float32", gpus=2, device="cpu",
                      optimizer="none", chunk_size=1024, checkpoint_layers=True, cp=2)
    est = estimate(spec, base, "exact")
    assert est.components["fsdp_reduce"] == unit + unit // 2 + unit
    assert est.phases["gradient_reduce"] == (est.components["weights"] + est.components["runtime"]
                                             + est.components["fsdp_gathered"] + est.components["gradients"]
                                             + est.components["fsdp_reduce"])
    assert estimate(spec, replace(base, device="cuda"), "exact").components["fsdp_reduce"] == unit + unit // 2
    layer = estimate(spec, replace(base, fsdp_gather="layer"), "exact")
    held = (2 * spec.vocab * spec.hidden + spec.hidden) * 4  # untied embeddings and output projection, final norm
    assert layer.components["fsdp_reduce"] == est.components["fsdp_reduce"]
    assert layer.components["fsdp_gathered"] == held + 2 * spec.max_layer_params * 4
    assert layer.components["gradients"] == (spec.params * 4 - held) // 2 + held
    for inputs, plan in ((replace(base, shard=False), "exact"), (base, "standard_batched")):
        est = estimate(spec, inputs, plan)
        assert "gradient_reduce" not in est.phases and "fsdp_reduce" not in est.components


def test_the_paper_scale_needs_layer_wise_gathering(capsys):
    """hybrid-27b at 2.1M positions on 8 x 96 GB, context parallel over the 8 GPUs: gathering every parameter (and
    holding the full gradient through the step) neither detach nor exact fits; gathering a layer at a time
    (sharded_compute(gather="layer"), which --cp 8 on 8 GPUs allows) both fit. The standard plans keep their
    layer-wise model either way."""
    base = ["plan", "--model", "hybrid-27b", "--prompt-tokens", "2100000", "--response-tokens", "4096",
            "--group-size", "8", "--gpus", "8", "--gpu-memory", "96GB", "--dtype", "bf16", "--cp", "8",
            "--chunk-size", "8192", "--checkpoint-layers", "--offload-state", "--json"]
    plans = {}
    for gather in ("all", "layer"):
        assert main([*base, "--fsdp-gather", gather]) == 0
        plans[gather] = json.loads(capsys.readouterr().out)["plans"]
    for plan in ("detach", "exact"):
        assert not plans["all"][plan]["fits"] and plans["layer"][plan]["fits"]
        assert plans["all"][plan]["components"]["fsdp_gathered"] > 50e9 > plans["layer"][plan]["components"][
            "fsdp_gathered"]
    assert plans["all"]["standard"]["total_bytes"] == plans["layer"]["standard"]["total_bytes"]


def _every_described_model() -> list[str]:
    """The planner's built-in descriptions, every preset, and each model directory beside the recorded results
    (bench/results/<name>/config.json)."""
    from longstraw.models.presets import PRESETS
    from longstraw.planner.spec import BUILTIN_NAMES

    root = Path(__file__).resolve().parents[2]
    recorded = sorted(str(path.parent) for path in (root / "bench" / "results").glob("*/config.json"))
    assert recorded, "no recorded model directory under bench/results"
    return [*BUILTIN_NAMES, *PRESETS, *recorded]


@pytest.mark.parametrize("name", _every_described_model())
def test_the_peak_is_never_below_one_of_its_own_rows(name):
    """Every row of `longstraw plan`'s table is GPU memory held within the plan's peak phase, so no row exceeds the
    peak: over every described model, both levers on and off, one GPU, 8 GPUs gathering every parameter, and 8 GPUs
    with cp 8 gathering a layer at a time, at 8K and 2.1M prompt tokens (checkpointed standard plans once reported
    activations of a formula their peak does not use; the offloaded state is host memory, outside the rows)."""
    spec = _spec(name)
    sharding = [dict(gpus=1), dict(gpus=8), dict(gpus=8, cp=8, fsdp_gather="layer")]
    for p, levers, shard in itertools.product((8192, 2_100_000), itertools.product((False, True), repeat=2), sharding):
        inp = PlanInputs(prompt_tokens=p, response_tokens=256, group_size=8, chunk_size=1024,
                         checkpoint_layers=levers[0], offload_state=levers[1], keep_prompt_graph=2, **shard)
        for plan in PLANS:
            est = estimate(spec, inp, plan)
            over = {row: n for row, n in est.components.items() if n > est.total_bytes}
            assert not over, f"{name} {plan} {inp}: rows {over} above the peak {est.total_bytes}"
            assert est.total_bytes == max(est.phases.values())
            assert (est.host_bytes > 0) == (levers[1] and plan in ("detach", "exact"))


PAPER = ["plan", "--model", "hybrid-27b", "--prompt-tokens", "2100000", "--response-tokens", "4096", "--group-size",
         "8", "--gpus", "8", "--gpu-memory", "96GB", "--dtype", "bf16", "--cp", "8", "--chunk-size", "8192",
         "--checkpoint-layers", "--offload-state"]


def test_the_table_ends_with_one_verdict_line(capsys):
    """`make plan-paper`'s table (gathering a layer at a time) ends with one verdict line naming the plans that fit
    with their peaks, those that do not, and what the other gathering gives; gathering every parameter, the verdict
    says nothing fits and names --fsdp-gather layer. The numbers are the table's own."""
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("plan-paper: install\n", 1)[1].split("\n\n", 1)[0]
    assert recipe.count("longstraw plan") == 1 and "--fsdp-gather layer" in recipe
    docs = {}
    for gather in ("layer", "all"):
        assert main([*PAPER, "--fsdp-gather", gather, "--json"]) == 0
        docs[gather] = json.loads(capsys.readouterr().out)["plans"]
    assert main([*PAPER, "--fsdp-gather", "layer"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [i for i, line in enumerate(lines) if line.startswith("verdict:")] == [len(lines) - 1]
    last, layer, every = lines[-1], docs["layer"], docs["all"]
    for plan in ("detach", "exact"):
        assert layer[plan]["fits"] and f"{plan} ({layer[plan]['total_bytes'] / 1e9:.2f} GB per GPU)" in last
    assert last.startswith("verdict: a 2,100,000-token prompt fits 8 x 96.0 GB GPUs with ")
    assert f"not with standard_batched ({layer['standard_batched']['total_bytes'] / 1e9:.2f} GB)" in last
    assert f"standard up to {layer['standard']['largest_prompt_tokens']:,} tokens" in last
    assert f"(--fsdp-gather all) detach and exact would not fit ({every['detach']['total_bytes'] / 1e9:.2f}" in last
    assert main([*PAPER, "--fsdp-gather", "all"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("verdict: a 2,100,000-token prompt fits 8 x 96.0 GB GPUs with no plan")
    assert "(--fsdp-gather layer) detach and exact would fit" in last

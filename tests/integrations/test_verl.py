"""`longstraw.integrations.verl` against verl's own actor update (verl's TrainingWorker and FSDP2 engine on one CPU
process, float64, SGD): 2 prompts × 4 responses, 2 micro-batches, 2 PPO epochs (the second off-policy, so the clip
acts). The gradient of every optimizer step must equal verl's to 1e-10 for every mapped loss_agg_mode, gspo, tool
tokens masked out of the loss, a sampling temperature, verl's clamps (a reference log-prob 3, 10 and 15 nats above
the policy's, log-ratios beyond 20, a gspo sequence log-ratio beyond 10), and the qwen3_next hybrid; what is not
mapped is refused before any gradient. verl pins transformers < 5.11, so these run in their own venv
(`make test-verl`)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed here: `make test-verl` runs these tests in "
                                   "its own venv (verl 0.9 pins transformers < 5.11)")

import torch  # noqa: E402
from helpers import assert_close, assert_ranks_ok, free_port, gradient_tolerance, rel_err, run_ranks  # noqa: E402

from longstraw.integrations.verl import config_refusals, settings_from_environment  # noqa: E402
from longstraw.plan import DETACH, EXACT  # noqa: E402

KL = {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl"}
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
EQUAL = {f"qwen3-{agg}": {"family": "qwen3", "actor": {"loss_agg_mode": agg, **KL}} for agg in AGG_MODES} | {
    "qwen3-gspo": {"family": "qwen3", "actor": {"loss_agg_mode": "seq-mean-token-mean",
                                                "policy_loss": {"loss_mode": "gspo"},
                                                "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}},
    "qwen3-observation-tokens": {"family": "qwen3", "actor": {"loss_agg_mode": "token-mean", **KL},
                                 "batch": {"observation": True}},
    "qwen3-temperature-dual-clip": {"family": "qwen3", "actor": {"loss_agg_mode": "seq-mean-token-mean",
                                                                 "clip_ratio_c": 1.5, "temperature": 0.75}},
    "qwen3_next-token-mean": {"family": "qwen3_next", "actor": {"loss_agg_mode": "token-mean", **KL},
                              "update": {"remove_padding": False}},
    "qwen3_next-seq-mean-token-mean": {"family": "qwen3_next", "actor": {"loss_agg_mode": "seq-mean-token-mean"},
                                       "update": {"remove_padding": False}},
}
# verl packs a micro-batch's rows into one sequence by default (use_remove_padding); transformers' torch kernels of
# gated DeltaNet (without flash-linear-attention, as on CPU) know no sequence boundaries inside it, so verl's own
# packed update of qwen3_next carries recurrent state from one row into the next: its reference here pads instead.
# Its kernels compute in float32 inside a float64 model (helpers.FP32_INSIDE): the family's tolerance is 1e-6.
# The temperature is one float32 represents exactly (verl divides the logits by a float32 copy of it).
# verl's clamps. A reference log-prob 3, 10 and 15 nats above the policy's on the first token of every row (on the
# tiny model with its lm_head scaled 100x, whose log-probs spread over tens of nats, so that the policy gives that
# token at most -(gap + 0.5) and the reference stays a log-prob: verl_child.py's `reference_gap`): verl clamps that
# token's k3 at 10 from 2.6 nats up, no gradient. old = -17 on every token of row 2 (A < 0) puts its gspo sequence
# log-ratio near 12, above verl's clamp at 10 (gspo has no dual clip: unclamped, the row weighs e^12). Without the
# clamps these gradients are other ones (test_the_clamp_cases_reach_verls_clamps).
CLAMPED = {f"qwen3-kl-gap-{gap}": {"family": "qwen3", "actor": {"loss_agg_mode": "token-mean", **KL},
                                   "reference_gap": {"scale": 100.0, "gap": float(gap)}, "unclamped": True}
           for gap in (3, 10, 15)} | {
    "qwen3-gspo-sequence-log-ratio-12": {"family": "qwen3", "unclamped": True,
                                         "actor": {"loss_agg_mode": "seq-mean-token-mean",
                                                   "policy_loss": {"loss_mode": "gspo"}},
                                         "batch": {"set": [["old_log_probs", [2], None, -17.0]]}},
}
# Vanilla PPO's log-ratio clamp at ±20: old = -30 and -700 put the first two tokens of every row near 25 and 695
# (exp(695) is still finite in float64; LongStraw refuses old log-probs whose ratio could overflow the loss's dtype
# before any gradient). The clip (A > 0) and the dual clip (A < 0) leave those tokens no gradient with or without
# the clamp, so this case checks that the clamp changes nothing else.
EQUAL |= CLAMPED | {
    "qwen3-log-ratio-beyond-20": {"family": "qwen3", "actor": {"loss_agg_mode": "seq-mean-token-mean", **KL},
                                  "batch": {"set": [["old_log_probs", None, [0], -30.0],
                                                    ["old_log_probs", None, [1], -700.0]]}},
}
# Prefix trees over the mini-batch (LongStraw's default): different questions after one system prompt of 24 tokens,
# and successive turns of one conversation (turn p's rows continue turn p−1's first row), with gspo's sequence ratio
# over turns among them (a row's response in a node other rows continue: the tree's two-pass sequence losses).
TREES = {
    "qwen3-system-prompt-token-mean": {"family": "qwen3", "actor": {"loss_agg_mode": "token-mean", **KL},
                                       "batch": {"system": 24}},
    "qwen3-system-prompt-seq-mean-token-mean": {"family": "qwen3", "actor": {"loss_agg_mode": "seq-mean-token-mean"},
                                                "batch": {"system": 24, "observation": True}},
    "qwen3-turns-token-mean": {"family": "qwen3", "actor": {"loss_agg_mode": "token-mean", **KL},
                               "batch": {"turns": True, "prompt_lengths": [12, 5, 5]}},
    "qwen3-turns-seq-mean-token-sum-norm": {"family": "qwen3", "actor": {"loss_agg_mode": "seq-mean-token-sum-norm"},
                                            "batch": {"turns": True, "prompt_lengths": [12, 5, 5]}},
    "qwen3-turns-gspo": {"family": "qwen3", "actor": {"loss_agg_mode": "seq-mean-token-mean",
                                                      "policy_loss": {"loss_mode": "gspo"},
                                                      "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
                         "batch": {"turns": True, "prompt_lengths": [12, 5, 5]}},
}
EQUAL |= TREES
MIXED = {"qwen3-float32": {"family": "qwen3", "actor": {"loss_agg_mode": "token-mean"}, "update": {"dtype": "fp32"}},
         "qwen3-bf16": {"family": "qwen3", "actor": {"loss_agg_mode": "token-mean"},
                        "update": {"dtype": "fp32", "compute_dtype": "bf16"}}}
REFUSED = {
    "entropy": ({"entropy_coeff": 0.01}, {}, "no entropy term"),
    "kl-k1": ({"use_kl_loss": True, "kl_loss_type": "kl"}, {}, "kl_loss_type='kl'"),
    "dual-clip-below-clip": ({"clip_ratio_c": 1.1}, {}, "clip_ratio_c=1.1"),
    "token-advantages": ({}, {"token_advantages": True}, "per-token advantages"),
    "nan-advantage": ({}, {"set": [["advantages", [2], [1], math.nan]]},
                      "row 2 of the mini-batch: its advantage is nan at response token 1 (1 of its 4 loss tokens are "
                      "not finite); advantages must be finite: look for a NaN or inf reward score"),
}


@pytest.fixture(scope="module")
def updates(tmp_path_factory) -> dict:
    cases = EQUAL | MIXED | {f"refused-{name}": {"family": "qwen3", "actor": actor, "batch": batch, "refused": True}
                     for name, (actor, batch, _) in REFUSED.items()}
    out = tmp_path_factory.mktemp("verl") / "updates.pt"
    here = Path(__file__).resolve().parent
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": os.pathsep.join(
        [str(here), str(here.parent), str(here.parents[1]), str(here.parents[1] / "src"),
         os.environ.get("PYTHONPATH", "")])}
    env.pop("LONGSTRAW_PLAN", None)
    run = subprocess.run([sys.executable, str(here / "verl_child.py"), str(out), json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", list(EQUAL))
def test_gradients_equal_verls_own_update(updates, case):
    """float64: every optimizer step's gradient (2 PPO epochs -> 2 steps) equals verl's within 1e-10 (qwen3_next:
    1e-6, its kernels' float32)."""
    verl_steps, ours = updates[case]["verl"], updates[case]["longstraw"]
    assert len(verl_steps) == len(ours) == 2
    for step, (theirs, mine) in enumerate(zip(verl_steps, ours)):
        assert theirs.dtype == torch.float64 and theirs.norm() > 0
        err = assert_close(f"{case} step {step + 1}", theirs, mine, gradient_tolerance(EQUAL[case]["family"]))
        print(f"{case} step {step + 1}: {err:.2g}")
    assert (verl_steps[0] - verl_steps[1]).norm() > 1e-3 * verl_steps[0].norm()  # the second epoch moved


@pytest.mark.parametrize("case", list(TREES))
def test_the_tree_encodes_shared_tokens_once(updates, case):
    """The tree cases ran one tree per training mini-batch (2 epochs: 2 calls): LongStraw's engine in verl has no other
    path (`LongStrawFSDPEngine` holds no per-group fallback; gspo over turns included). System prompt: its 24 tokens
    are in all 8 rows, encoded once. Turns: turn 0's first row (12 prompt tokens and its response) is a prefix of
    itself and of the 8 rows of turns 1 and 2, encoded once."""
    calls = updates[case]["calls"]
    assert len(calls) == 2
    for call in calls:
        (encoded,), (flattened,) = call["metrics"]["actor/longstraw_tokens_encoded"], \
            call["metrics"]["actor/longstraw_tokens_flattened"]
        print(f"{case}: {encoded:.0f} tokens encoded, {flattened:.0f} flattened")
        saved = 7 * 24 if "system" in case else 8 * (12 + 2 - 1)  # responses have 2 tokens at least
        assert flattened - encoded >= saved


@pytest.mark.parametrize("case", list(CLAMPED))
def test_the_clamp_cases_reach_verls_clamps(updates, case):
    """Without log_ratio_clamp and kl_clamp LongStraw's gradient is another one on these batches (step 1, the same
    parameters: off by more than 50%), so their equality above is the clamps' doing."""
    theirs, unclamped = updates[case]["verl"][0], updates[case]["unclamped"][0]
    print(f"{case}: unclamped LongStraw vs verl, step 1: {rel_err(unclamped, theirs):.3g}")
    assert rel_err(unclamped, theirs) > 0.5


def test_float32_and_bf16_mixed_precision_against_verl(updates):
    """float32 parameters: equal to verl's within 1e-6. bf16 mixed precision (FSDP2 computes in bf16, verl autocasts
    its forward): the two round differently, so LongStraw's gradient must be as close to the float32 one as verl's
    is (within 1.25×; measured 0.77% / 1.2% against verl's 1.7% / 1.7%: LongStraw keeps log-probs and the loss in
    float32), and within 3%."""
    reference = updates["qwen3-float32"]["verl"]
    for step in range(2):
        assert_close(f"float32 step {step + 1}", reference[step], updates["qwen3-float32"]["longstraw"][step], 1e-6)
        ours = rel_err(updates["qwen3-bf16"]["longstraw"][step], reference[step])
        theirs = rel_err(updates["qwen3-bf16"]["verl"][step], reference[step])
        assert 0 < theirs < 0.03 and ours < min(1.25 * theirs, 0.03), (step, ours, theirs)


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_what_it_cannot_map_before_any_gradient(updates, name):
    result = updates[f"refused-{name}"]
    assert result["error"] is not None, f"{name} was not refused"
    assert REFUSED[name][2] in result["error"]
    assert not result["gradients_left"]


def test_config_refusals_name_the_option_and_the_fix():
    from verl.workers.config import ActorConfig

    def refusals(**settings):
        return config_refusals(ActorConfig(strategy="fsdp2", rollout_n=4, ppo_micro_batch_size_per_gpu=1,
                                           **settings))

    assert refusals() == []
    assert refusals(loss_agg_mode="seq-mean-token-sum-norm", use_kl_loss=True, kl_loss_type="k3") == []
    (message,) = refusals(policy_loss={"loss_mode": "clip_cov"})
    assert "loss_mode='clip_cov'" in message and "'vanilla'" in message
    (message,) = refusals(kl_loss_type="mse", use_kl_loss=True)
    assert "kl_loss_type=low_var_kl" in message


def test_settings_from_the_environment():
    assert settings_from_environment({}).plan is EXACT
    settings = settings_from_environment({"LONGSTRAW_PLAN": "detach", "LONGSTRAW_CHUNK_SIZE": "512",
                                          "LONGSTRAW_MICRO_BATCH": "2", "LONGSTRAW_CHECKPOINT": "layers"})
    assert (settings.plan, settings.chunk_size, settings.micro_batch, settings.checkpoint) == (
        DETACH, 512, 2, "layers")
    with pytest.raises(ValueError, match="LONGSTRAW_CHUNK_SIZE='many'"):
        settings_from_environment({"LONGSTRAW_CHUNK_SIZE": "many"})
    with pytest.raises(ValueError, match="unknown plan 'fast'"):
        settings_from_environment({"LONGSTRAW_PLAN": "fast"})
    assert settings_from_environment({}).tree_min_shared == 1
    assert settings_from_environment({"LONGSTRAW_TREE_MIN_SHARED": "16"}).tree_min_shared == 16
    with pytest.raises(ValueError, match="LONGSTRAW_TREE_MIN_SHARED=0 must be >= 1"):
        settings_from_environment({"LONGSTRAW_TREE_MIN_SHARED": "0"})


def test_the_switch_is_verls_model_external_lib(tmp_path):
    """`actor_rollout_ref.model.external_lib=longstraw.integrations.verl`: verl imports the module when it reads the
    model config, and from then on builds LongStraw's engine for the language model's fsdp/fsdp2 backends on every
    device verl registered (a fresh process, no test shim: verl's own registry as shipped)."""
    import transformers

    transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    code = f"""
from verl.workers.engine.base import EngineRegistry
from verl.workers.config import HFModelConfig

def engines():
    return sorted({{(backend, str(device), cls.__name__)
                   for backend, devices in EngineRegistry._engines["language_model"].items()
                   if backend in ("fsdp", "fsdp2") for device, cls in devices.items()}})

print("before", engines())
HFModelConfig(path={str(tmp_path)!r}, load_tokenizer=False, external_lib="longstraw.integrations.verl")
print("after", engines())
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    before = next(line for line in run.stdout.splitlines() if line.startswith("before"))
    after = next(line for line in run.stdout.splitlines() if line.startswith("after"))
    assert "FSDPEngineWithLMHead" in before and "LongStrawFSDPEngine" not in before
    assert "'cuda', 'LongStrawFSDPEngine'" in after and "FSDPEngineWithLMHead" not in after


def test_the_example_is_a_verl_config_longstraw_accepts():
    """examples/verl/grpo_long_prompts.sh: every override composes into verl's own ppo_trainer config (hydra refuses
    an unknown key), the switch is set, and LongStraw refuses nothing in its actor config."""

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    script = (Path(__file__).resolve().parents[2] / "examples" / "verl" / "grpo_long_prompts.sh").read_text()
    overrides = [re.sub(r'"?\$\{(\w+)(:-|:\?)([^}]*)\}"?', lambda m: m.group(3) if m.group(2) == ":-" else "x.parquet",
                        line.strip().rstrip("\\").strip())
                 for line in script.splitlines() if re.match(r"\s+\+?[\w.]+=", line)]
    assert len(overrides) > 20
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    assert config.actor_rollout_ref.model.external_lib == "longstraw.integrations.verl"
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.LONGSTRAW_PLAN == "exact"
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert config_refusals(actor) == []


def test_two_data_parallel_ranks_equal_verls_two_ranks(tmp_path):
    """2 processes, FSDP2 sharded over both, each with its own 2 prompts × 4 responses: verl divides by the tokens or
    sequences of both ranks and multiplies each rank's loss by dp = 2 for FSDP's mean; LongStraw's options do the
    same under its gather-once / reduce-scatter-once block. Every step's whole gradient equal within 1e-10."""
    cases = {"dp2-token-mean": {"family": "qwen3", "actor": {"loss_agg_mode": "token-mean", **KL}},
             "dp2-seq-mean-token-sum-norm": {"family": "qwen3", "actor": {"loss_agg_mode": "seq-mean-token-sum-norm"}}}
    updates = _ranks_updates(tmp_path, cases, 2)
    for case in cases:
        assert len(updates[case]["verl"]) == 2
        for step, (theirs, mine) in enumerate(zip(updates[case]["verl"], updates[case]["longstraw"])):
            assert_close(f"{case} step {step + 1}", theirs, mine, 1e-10)


def test_ulysses_group_shards_the_prompt_state_and_equals_verls_update(tmp_path):
    """verl's Ulysses group (ulysses_sequence_parallel_size 2 over 2 processes: dp 1) as LongStraw's context-parallel
    group: both ranks run the tree on the same rows, each keeping the attention state of its own half of the capture
    chunks (LONGSTRAW_CHUNK_SIZE 4 splits every prompt over both), and the update equals verl's on the same batch
    (run without Ulysses: verl's Ulysses patches only FlashAttention-2, which a CPU run has not). A hybrid (gated
    DeltaNet + attention) keeps its recurrent state on both ranks. detach equals its own update without Ulysses. A plan
with no prompt state is refused by name."""
    env = {"LONGSTRAW_CHUNK_SIZE": "4"}
    cases = {
        "sp2-system-prompt-token-mean": {"family": "qwen3", "ulysses": 2, "env": env,
                                         "actor": {"loss_agg_mode": "token-mean", **KL}, "batch": {"system": 24}},
        "sp2-turns-gspo": {"family": "qwen3", "ulysses": 2, "env": env,
                           "actor": {"loss_agg_mode": "seq-mean-token-mean", "policy_loss": {"loss_mode": "gspo"},
                                     "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
                           "batch": {"turns": True, "prompt_lengths": [12, 5, 5]}},
        "sp2-hybrid": {"family": "qwen3_next", "ulysses": 2, "env": env, "actor": {"loss_agg_mode": "token-mean"},
                       "update": {"remove_padding": False}},  # verl's reference: see the note above EQUAL's hybrids
        "sp2-detach": {"family": "qwen3", "ulysses": 2, "env": env | {"LONGSTRAW_PLAN": "detach"},
                       "actor": {"loss_agg_mode": "token-mean"}, "batch": {"system": 24}},
        "sp2-refused-standard": {"family": "qwen3", "ulysses": 2, "env": {"LONGSTRAW_PLAN": "standard"},
                                 "actor": {"loss_agg_mode": "token-mean"}, "refused": True},
    }
    updates = _ranks_updates(tmp_path, cases, 2)
    for case, spec in cases.items():
        if spec.get("refused"):
            assert "ulysses_sequence_parallel_size=2 with LONGSTRAW_PLAN=standard" in updates[case]["error"]
            assert not updates[case]["gradients_left"]
            continue
        # the exact plan equals verl's update; detach (the paper's biased gradient) its own unsharded update
        reference = updates[case]["unsharded" if "detach" in case else "verl"]
        assert len(reference) == 2
        for step, (theirs, mine) in enumerate(zip(reference, updates[case]["longstraw"])):
            err = assert_close(f"{case} step {step + 1}", theirs, mine, gradient_tolerance(spec["family"]))
            print(f"{case} step {step + 1}: {err:.2g}")
        sharded = [c["metrics"]["actor/longstraw_peak_path_state_bytes"][0] for c in updates[case]["calls"]]
        whole = [c["metrics"]["actor/longstraw_peak_path_state_bytes"][0] for c in updates[case]["unsharded_calls"]]
        print(f"{case}: prompt state on rank 0 {sharded} bytes, {whole} unsharded")
        assert len(sharded) == len(whole) == 2 and all(0 < s < w for s, w in zip(sharded, whole)), (sharded, whole)


def test_ulysses_under_two_data_parallel_ranks(tmp_path):
    """4 processes: verl's mesh (dp 2, sp 2), each Ulysses pair with its own rows. verl's normalisers count the two
    data-parallel ranks' rows and FSDP averages over all four ranks; the update equals verl's on the same rows."""
    cases = {"dp2-sp2": {"family": "qwen3", "ulysses": 2, "env": {"LONGSTRAW_CHUNK_SIZE": "4"},
                         "actor": {"loss_agg_mode": "seq-mean-token-mean", **KL}, "batch": {"system": 24}}}
    updates = _ranks_updates(tmp_path, cases, 4)["dp2-sp2"]
    assert len(updates["verl"]) == 2
    for step, (theirs, mine) in enumerate(zip(updates["verl"], updates["longstraw"])):
        assert_close(f"dp2-sp2 step {step + 1}", theirs, mine, 1e-10)


def _ranks_updates(tmp_path: Path, cases: dict, processes: int) -> dict:
    """verl_child.py's results of `cases` on `processes` gloo ranks (each rank's exit checked)."""
    here = Path(__file__).resolve().parent
    out = tmp_path / "updates.pt"
    ranks = run_ranks([str(here / "verl_child.py"), str(out), json.dumps(cases)], processes, timeout=900,
                      paths=[here, here.parent, here.parents[1], here.parents[1] / "src"])
    assert_ranks_ok(ranks)
    return torch.load(out, weights_only=False)

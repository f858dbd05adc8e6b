"""`LongStrawAsyncGRPOTrainer` (TRL's asynchronous GRPO trainer with LongStraw's tree) against a reference written
from TRL's `AsyncGRPOTrainer.compute_loss` on flattened samples (trl_async_setup.py: no LongStraw code in it), over
two optimizer steps of two micro-batches each, fed by a scripted rollout worker (TRL's worker interface, no vLLM
server): each step's gradient and the parameters after it, float64, in one process and in two (gloo). Then the models
TRL's own trainer refuses (recurrent layers, attention sinks) trained where TRL refuses them, the router term over
the packed trie, the loss metrics, what the drop-in refuses, and that TRL's module is left as it was.

The reference runs transformers with sdpa attention (its softmax in float64; eager's is float32) where the model has
it; gpt-oss has no sdpa path, so both sides run eager attention there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'longstraw[trl]'")

from datasets import Dataset  # noqa: E402
from helpers import EXACT_F64, assert_close, gradient_tolerance, rel_err, run_ranks, tiny_model  # noqa: E402
from router_helpers import patch_routers  # noqa: E402
from transformers import GptOssConfig  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl_async_setup import SETTINGS, NoWeightSync, ScriptedWorker, samples, train_ours, train_reference  # noqa: E402

import longstraw.integrations.trl_async as trl_async  # noqa: E402
from longstraw.models.tokenizer import byte_tokenizer_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# one step more than the run takes: accelerate's dispatcher fetches a micro-batch ahead
ONE_PROCESS = SETTINGS["per_device_train_batch_size"] * (SETTINGS["gradient_accumulation_steps"] *
                                                         SETTINGS["max_steps"] + 1)
_DIRS: dict[str, str] = {}


def _saved(family: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-init model of `family` saved to disk (TRL's asynchronous trainer loads from a path); LFM2's from
    its released config's values (admission's tiny copy), the others from the tests' tiny configs."""
    if family not in _DIRS:
        path = tmp_path_factory.mktemp(f"async-{family}")
        if family == "lfm2":
            from longstraw.admission.released import sweep_config
            from longstraw.admission.tiny import build_tiny_model, tiny_config

            model = build_tiny_model(tiny_config(sweep_config("lfm2"))[0]).float()
        else:
            model = tiny_model(family, dtype=torch.float32)
        model.save_pretrained(path)
        _DIRS[family] = str(path)
    return _DIRS[family]


def _compare(ours, ref, tol: float) -> float:
    (g_ours, p_ours), (g_ref, p_ref) = ours, ref
    assert len(g_ours) == len(g_ref) == SETTINGS["max_steps"]
    errors = []
    for a, b in zip(g_ours, g_ref):
        assert b.norm() > 0
        errors.append(assert_close("gradient", b, a, tol))
    errors.append(assert_close("parameters", p_ref, p_ours, tol))
    assert rel_err(g_ref[1], g_ref[0]) > 1e-3  # the second step is another gradient: the update reached it
    return max(errors)


@pytest.mark.parametrize("family,budget", [("llama", 0), ("qwen3", 0), ("llama", 120)])
def test_equals_trl_async_loss(family, budget, tmp_path, tmp_path_factory):
    """Two optimizer steps of the drop-in equal the reference's ≤ 1e-10 in float64 (multi-turn samples with tool
    results masked out, a shared system prompt, samples that fork after a shared first turn); micro-batches of a fixed
    count, or of TRL's token budget (120 unique tokens per row: a varying number of samples)."""
    model_dir, items = _saved(family, tmp_path_factory), samples(3 * ONE_PROCESS if budget else ONE_PROCESS)
    info: dict = {}
    err = _compare(train_ours(model_dir, items, str(tmp_path / "ours"), info=info, token_budget=budget),
                   train_reference(model_dir, items, token_budget=budget), EXACT_F64)
    print(f"{family}, token budget {budget}: {err:.2g}")
    logged = info["log_history"][0]
    assert logged["longstraw/tokens_encoded"] < logged["longstraw/tokens_flattened"]  # the trie shares tokens
    for key in ("ratio", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "perf/fwd_bwd_s",
                "batch/trained_tokens_per_step"):
        assert key in logged, key


def test_router_term_over_the_packed_trie(tmp_path, tmp_path_factory, monkeypatch):
    """Qwen3-MoE with TRL's router term (coefficient 0.001 over gradient accumulation times transformers' aux loss
    over each row's trie, every trie node once): ≤ 1e-10 with the routers' softmax in float64 (router_helpers)."""
    patch_routers(monkeypatch)
    model_dir, items = _saved("qwen3_moe", tmp_path_factory), samples(ONE_PROCESS)
    info: dict = {}
    err = _compare(train_ours(model_dir, items, str(tmp_path / "ours"), info=info, router_aux_loss_coef=0.001),
                   train_reference(model_dir, items, coef=0.001), EXACT_F64)
    print(f"qwen3_moe with the router term: {err:.2g}")
    assert info["log_history"][0]["aux_loss"] > 0


LAYERS = "Tree packing only routes attention layers"
# family: (TRL's refusal, or None where TRL trains it; attention; router coefficient of the released config)
MODELS = {
    "gpt_oss": ("uses attention sinks", "eager", 0.9),
    "qwen3_next-A": (LAYERS, None, 0.001),  # gated DeltaNet, MoE
    "qwen3_5_text": (LAYERS, None, None),  # gated DeltaNet
    "jamba": (LAYERS, None, 0.001),  # Mamba, MoE
    "falcon_h1": (LAYERS, None, None),  # Mamba-2 beside attention in each layer
    "nemotron_h": (LAYERS, None, None),  # Mamba-2, attention and MoE layers
    "lfm2": (LAYERS, None, None),  # short convolutions
    "deepseek_v3": (None, None, None),  # MLA, MoE
    "gemma3-A": (None, None, None),  # sliding windows
}


@pytest.mark.parametrize("family", list(MODELS))
def test_trains_every_kind_of_model(family, tmp_path, tmp_path_factory):
    """Recurrent, convolutional and hybrid models, attention sinks, MLA and sliding windows: TRL's AsyncGRPOTrainer
    refuses the first kinds when it is built; the drop-in trains two steps of each (with its router term where it has
    one), equal to the reference ≤ 1e-10, or ≤ 1e-6 where its kernels compute in float32 inside the float64 model."""
    refusal, attention, coef = MODELS[family]
    model_dir, items = _saved(family, tmp_path_factory), samples(ONE_PROCESS)
    kwargs = {"attn_implementation": attention} if attention else {}
    if refusal is not None:
        # TRL loads with its tree kernel (it takes no attn_implementation in model_init_kwargs)
        args = AsyncGRPOConfig(output_dir=str(tmp_path / "trl"),
                               **{**SETTINGS, "model_init_kwargs": {"dtype": torch.float32}})
        with pytest.raises(ValueError, match=refusal):
            AsyncGRPOTrainer(model_dir, args=args, processing_class=byte_tokenizer_hf(),
                             rollout_worker=ScriptedWorker([]), weight_transfer=NoWeightSync(),
                             train_dataset=Dataset.from_dict({"prompt": ["p"]}))
    config = {} if coef is None else {"router_aux_loss_coef": coef}
    ours = train_ours(model_dir, items, str(tmp_path / "ours"), model_init_kwargs=kwargs, **config)
    err = _compare(ours, train_reference(model_dir, items, coef=coef or 0.0, attention=attention or "sdpa"),
                   gradient_tolerance(family))
    print(f"{family}: TRL {'refuses (' + refusal + ')' if refusal else 'runs it'}; the drop-in equals the reference "
          f"to {err:.2g}")


@pytest.mark.parametrize("family", ["llama", *(pytest.param(f, marks=pytest.mark.slow)
                                               for f in ("qwen3", "gpt_oss", "qwen3_next-A"))])
def test_two_processes(family, tmp_path, tmp_path_factory):
    """Two processes (gloo, accelerate's MULTI_CPU): rank 0's queue feeds both ranks through TRL's planner, and the
    gradient averaged over the ranks equals the reference's mean of the two rows' gradients, ≤ 1e-10 (≤ 1e-6 where
    kernels compute in float32: Qwen3-Next), with the router term of gpt-oss and Qwen3-Next."""
    model_dir = _saved(family, tmp_path_factory)
    _, attention, coef = MODELS.get(family, (None, None, None))
    config = {"model_init_kwargs": {"attn_implementation": attention} if attention else {},
              **({} if coef is None else {"router_aux_loss_coef": coef})}
    here = Path(__file__).parent
    ranks = run_ranks([str(here / "trl_async_child.py"), model_dir, str(tmp_path), json.dumps(config)], 2,
                      timeout=600, paths=[here, here.parent, ROOT, ROOT / "src"], env={"ACCELERATE_USE_CPU": "1"})
    for code, out in ranks:
        assert code == 0, out[-4000:]
    saved = torch.load(tmp_path / "steps.pt")
    assert saved["world"] == 2
    count = SETTINGS["per_device_train_batch_size"] * 2 * (SETTINGS["gradient_accumulation_steps"] *
                                                           SETTINGS["max_steps"] + 1)
    reference = train_reference(model_dir, samples(count), processes=2, coef=coef or 0.0,
                                attention=attention or "sdpa")
    err = _compare((saved["steps"], saved["params"]), reference, gradient_tolerance(family))
    assert torch.equal(torch.load(tmp_path / "params-1.pt"), saved["params"])  # the ranks stay in step
    print(f"{family}, two processes: {err:.2g}")


def test_refusals_and_trl_left_as_it_was(tmp_path, tmp_path_factory):
    """fp16, a model LongStraw's admission refuses (attention dropout in train mode) and a router term LongStraw
    cannot record are refused when the trainer is built, each by name; after a build, TRL's module has its own
    loader and the model its own config class and sink parameters again."""
    model_dir = _saved("gpt_oss", tmp_path_factory)
    module = sys.modules[trl_async.AsyncGRPOTrainer.__module__]
    loader = module.create_model_from_path
    with pytest.raises(ValueError, match="fp16=True"):
        trl_async.refuse(trl_async.config_refusals(AsyncGRPOConfig(output_dir=str(tmp_path), fp16=True,
                                                                   use_cpu=True)))
    with pytest.raises(ValueError, match="dropout"):
        train_ours(model_dir, [], str(tmp_path / "dropout"),
                   model_init_kwargs={"attn_implementation": "eager", "attention_dropout": 0.1})
    assert module.create_model_from_path is loader
    trainer = trl_async.LongStrawAsyncGRPOTrainer(
        model_dir, args=trl_async.LongStrawAsyncGRPOConfig(output_dir=str(tmp_path / "ok"), **{
            **SETTINGS, "model_init_kwargs": {"dtype": torch.float32, "attn_implementation": "eager"}}),
        processing_class=byte_tokenizer_hf(), rollout_worker=ScriptedWorker([]), weight_transfer=NoWeightSync(),
        train_dataset=Dataset.from_dict({"prompt": ["p"]}))
    assert type(trainer.model.config) is GptOssConfig
    assert any(name.endswith(".sinks") for name, _ in trainer.model.named_parameters())
    assert trainer.args.model_init_kwargs["attn_implementation"] == "eager"
    assert module.create_model_from_path is loader
    # TRL turns its router term on for Llama-4 (its config has the fields), whose router logits transformers does not
    # record: refused when the trainer is built, naming TRL's option, not at the first micro-batch
    from longstraw.admission.released import sweep_config
    from longstraw.admission.tiny import build_tiny_model, tiny_config

    build_tiny_model(tiny_config(sweep_config("llama4_text"))[0]).float().save_pretrained(tmp_path / "llama4")
    with pytest.raises(ValueError, match=r"records \(output_router_logits\).*set router_aux_loss_coef=0\.0"):
        train_ours(str(tmp_path / "llama4"), [], str(tmp_path / "llama4-run"), router_aux_loss_coef=0.001)
    json.dumps(trainer.args.to_dict(), default=str)

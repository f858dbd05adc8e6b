"""One peer configuration of `python -m benchmarks peers` in a fresh process:
`python -m benchmarks.peers_worker '<json config>'`.

The group is `worker.py`'s (`make_group`: the same prompt, G responses of R tokens and advantages for the same
seed) and the model is the same preset with the same seed, so every configuration scores the same tokens with the
same weights. What is measured is one group's loss forward and backward (gradients accumulated into `.grad`; no
optimizer step), as `benchmarks/worker.py` measures `backward_group`: peak = VmHWM above VmRSS just before it (the
high-water mark reset first, docs/design.md §5), wall and CPU time, CPU pressure. One JSON line on stdout: status
"ok" and the measurement, or status "not installed" when the peer's package cannot be imported (exit 0). Any other
failure exits non-zero with the traceback on stderr, which the parent records.

**TRL** (`peer: "trl"`): TRL's own training step. A real `trl.GRPOTrainer` is built on the model (fp32, loss_type
"grpo" as LongStraw's worker, beta 0, temperature 1, `per_device_train_batch_size` = `batch`,
`gradient_accumulation_steps` = G / batch, `gradient_checkpointing` as configured: TRL's default is on) and
`trainer.train()` runs for one optimizer step. Only generation is replaced: `_generate_and_score_completions`
returns the group (prompt ids repeated per row, completion ids, masks of ones, the advantages, `num_items_in_batch`)
as TRL's own method returns it. Everything after that is TRL's and transformers' code: `_prepare_inputs` (shuffle and
split into micro-batches), `Trainer.training_step` (train mode, `compute_loss`, `accelerator.backward`),
`GRPOTrainer._compute_loss` with `_get_per_token_logps_and_entropies` through TRL's fused log-prob head, and
Trainer's own enabling of activation checkpointing. One decision is TRL's GPU one rather than its CPU one (config
`trl_compact_head`, default on; `bench peers --trl-all-positions` turns it off): on CUDA and XPU TRL's head projects
only the completion positions ("compact"); on other devices it projects every position, prompt included, in
4096-token x vocabulary tiles (`_compact_head_on_every_device`), which on CPU would make the head, not the method,
TRL's peak (b1-llama, P = 1024: 1.4 GiB with batch 1 and checkpointing). The tiles themselves still run through
TRL's torch fallback, which keeps a few [tokens, vocabulary] temporaries where its Triton kernel works in place.
The measured region runs from the start of the first `training_step` to the end of the G / batch-th; the train loop
is then stopped before the optimizer step.

**Prefix Grouper** (`peer: "prefix_grouper"`, PyPI `prefix-grouper`, optional): its own code does the grouping and
the attention split: `PrefixGrouper.from_ungrouped_masks`, `concat_input` (prompt once, then the G responses, one
row), its transformers attention registration `register_attention()` ("prefix_grouper_attention", which ungroups
q/k/v, attends the prefix causally and each response over prefix + itself, and regroups), `split_output(...,
include_prefix_last=1)` and `convert_padding`, with position ids [0..P) then [P..P+R) per response as its README
prescribes. Two pieces are ours, as its README leaves them to the user: the attention function it calls on CPU
(`sdpa_adapter`: PyTorch SDPA, causal aligned at the bottom right as flash-attention does, Prefix Grouper's key
padding mask applied, GQA without repeating K/V), and the head and loss: `split_output` is applied to the final
hidden states rather than to full-sequence logits (the same split, done before the LM head, so prompt positions
never get logits), then LongStraw's chunked log-prob kernel (the head LongStraw's plans use: no [tokens, vocab]
logits kept) and LongStraw's grpo loss (`loss.response_loss`). Activation checkpointing: transformers'
`activation_checkpointing_enable` (non-reentrant), as Trainer enables it, in train mode (the presets have no dropout).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import load_bench_model
from benchmarks.launch import worker_args
from benchmarks.worker import _cpu_stall_us, cpu_pressure, make_group
from longstraw.peak import PeakMemory

CONFIG_KEYS = ("peer", "model", "dtype", "device", "prompt_tokens", "response_tokens", "group_size", "seed",
               "batch", "checkpoint")
SDPA_ADAPTER = "longstraw_pg_sdpa"  # the name the adapter is registered under in transformers' AttentionInterface


class NotInstalled(Exception):
    """The peer's package cannot be imported: recorded as status "not installed", not as a failure."""


class _Measured(Exception):
    """Raised from the last measured training step to stop TRL's train loop before its optimizer step."""


class _Meter:
    """The measured region, as `benchmarks/worker.py` measures `backward_group`."""

    def __init__(self, device: str) -> None:
        self.device = device

    def start(self) -> None:
        gc.collect()  # garbage from the setup is neither in the baseline nor freed mid-step
        self.meter = PeakMemory(self.device)
        self.meter.start()
        self.stall0 = _cpu_stall_us()
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def stop(self) -> dict[str, Any]:
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        step_s, cpu_s = time.perf_counter() - self.t0, time.process_time() - self.c0
        stall1 = _cpu_stall_us()
        pressure = cpu_pressure(self.stall0, stall1, step_s)
        return {
            "peak_bytes": self.meter.peak_bytes(), "baseline_bytes": self.meter.base,
            "high_water_bytes": self.meter.peak_absolute_bytes(),
            "peak_source": "cuda.max_memory_allocated" if self.meter.cuda else "VmHWM",
            "hwm_reset": self.meter.reset_ok, "time_s": step_s, "cpu_time_s": cpu_s, "cpu_pressure": pressure,
            "torch_threads": torch.get_num_threads(),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        }


def _checkpointing(model: Any) -> bool:
    """Whether transformers' activation checkpointing is on (its newer name first, then the deprecated one)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


# ---------------------------------------------------------------- TRL


def _zero_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return [0.0] * len(completions)  # never called: generation and scoring are replaced


def _compact_head_on_every_device() -> None:
    """Make TRL's fused LM head score only the completion positions on this device, as it does on CUDA and XPU.

    `add_fused_lm_head`'s forward decides `compact = _use_triton(device)`: with Triton (CUDA, XPU) it projects only
    the positions whose label is not -100 (the completions); elsewhere it projects every position, prompt included,
    to keep tile shapes fixed for compilers (Neuron). That is the only use of the name in `trl.trainer.utils`; the
    kernel (`trl.kernels.chunked_logprob`) keeps its own check and so its torch fallback for the tiles on CPU."""
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "_use_triton"):
        raise RuntimeError("trl.trainer.utils._use_triton is gone: this TRL decides its compact head differently; "
                           "rerun with --trl-all-positions or update benchmarks.peers_worker")
    trl_utils._use_triton = lambda device: True


def _count_head_rows() -> list[int]:
    """Record the rows (positions) each call of TRL's fused head projects: batch x R when compact, batch x (P + R)
    when not. The list fills as TRL runs; the call is passed on unchanged."""
    import trl.trainer.utils as trl_utils

    kernel, rows = trl_utils._ChunkedLogProbFunction, []

    class Counted:
        @staticmethod
        def apply(hidden: torch.Tensor, *args: Any) -> Any:
            rows.append(int(hidden.shape[0]))
            return kernel.apply(hidden, *args)

    trl_utils._ChunkedLogProbFunction = Counted  # type: ignore[misc, assignment]
    return rows


def run_trl(config: dict[str, Any]) -> dict[str, Any]:
    """TRL's GRPO training step on the group (module docstring)."""
    try:
        import trl
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        raise NotInstalled(f"TRL cannot be imported ({err}): pip install 'longstraw[trl]'") from err
    from longstraw.models.tokenizer import byte_tokenizer_hf

    device = str(config["device"])
    g, p, r = int(config["group_size"]), int(config["prompt_tokens"]), int(config["response_tokens"])
    batch = int(config["batch"])
    if g % batch:
        raise ValueError(f"batch {batch} does not divide G = {g}")
    steps = g // batch
    model = load_bench_model(str(config["model"]), str(config["dtype"]), device)
    group = make_group(model.config.vocab_size, p, r, g, int(config["seed"]))
    # What GRPOTrainer._generate_and_score_completions returns for this group (no old/ref log-probs: TRL computes
    # none for num_iterations = 1, beta = 0, steps_per_generation = gradient_accumulation_steps, no vLLM).
    scored = {
        "prompt_ids": group.prompt.repeat(g, 1).to(device),
        "prompt_mask": torch.ones(g, p, dtype=torch.long, device=device),
        "completion_ids": torch.stack(group.responses).to(device),
        "completion_mask": torch.ones(g, r, dtype=torch.long, device=device),
        "advantages": group.advantages.to(device),
        "num_items_in_batch": torch.tensor(g * r, device=device),
    }
    meter = _Meter(device)
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=steps,
            num_generations=g, max_completion_length=r, max_steps=1, loss_type="grpo", beta=0.0, temperature=1.0,
            gradient_checkpointing=bool(config["checkpoint"]), bf16=False, fp16=False, use_cpu=device == "cpu",
            report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
            seed=int(config["seed"]), dataloader_num_workers=0,
        )
        if config.get("trl_compact_head", True):
            _compact_head_on_every_device()
        head_rows = _count_head_rows()
        trainer = GRPOTrainer(model=model, reward_funcs=_zero_reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["x"] * g}),
                              processing_class=byte_tokenizer_hf())

        def scored_batch(inputs: list[dict[str, Any]]) -> dict[str, Any]:
            return dict(scored)  # the prompts TRL's sampler drew are not used: the group is the bench's

        trainer._generate_and_score_completions = scored_batch  # type: ignore[method-assign]
        training_step: Callable[..., torch.Tensor] = trainer.training_step
        losses: list[float] = []

        def measured(*a: Any, **kw: Any) -> torch.Tensor:
            if not losses:
                meter.start()
            out = training_step(*a, **kw)
            losses.append(float(out))
            if len(losses) == steps:
                record.update(meter.stop(), loss=sum(losses), micro_steps=steps, peer_version=trl.__version__,
                              trl_compact_head=bool(config.get("trl_compact_head", True)),
                              trl_head_rows=max(head_rows, default=0),
                              gradient_checkpointing=_checkpointing(trainer.model))
                raise _Measured
            return out

        trainer.training_step = measured  # type: ignore[method-assign]
        try:
            trainer.train()
        except _Measured:
            pass
    if not record:
        raise RuntimeError(f"TRL's train loop ended after {len(losses)} of {steps} micro-steps")
    return record


# ---------------------------------------------------------------- Prefix Grouper


def sdpa_adapter(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function Prefix Grouper calls (for its prefix and for its suffix part): q (b, h, q, d), k/v
    (b, h_kv, k, d), `attention_mask` its key padding mask (b, k), True on real tokens. Causal with the queries aligned
    at the end of the keys (as flash-attention's causal, which Prefix Grouper is written for): query i sees keys
    j <= i + k - q. Returns (b, q, h, d), as transformers' attention functions do."""
    q_len, k_len = query.shape[2], key.shape[2]
    gqa = key.shape[1] != query.shape[1]
    padded = attention_mask is not None and not bool(attention_mask.all())
    if q_len == k_len and not padded:
        mask, causal = None, True
    else:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        if padded:
            assert attention_mask is not None
            mask = mask[None] & attention_mask.bool()[:, None, :]
            mask = mask | ~mask.any(-1, keepdim=True)  # a padding query with no key: any output (it is dropped)
            mask = mask[:, None]
        causal = False
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=causal, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def prefix_grouper_logprobs(model: Any, prompt: torch.Tensor, responses: torch.Tensor,
                            token_chunk: int = 1024) -> torch.Tensor:
    """Per-token log-probs (G, R) of `responses` (G, R) after `prompt` (P,) through Prefix Grouper (module docstring);
    the model's attention implementation must be "prefix_grouper_attention" (`prepare_prefix_grouper`)."""
    from longstraw.engine.logprobs import chunked_logprobs

    PrefixGrouper = importlib.import_module("prefix_grouper").PrefixGrouper  # noqa: N806 (untyped, optional)

    device = prompt.device
    g, r = responses.shape
    p = prompt.shape[0]
    prompt_mask = torch.ones(1, p, dtype=torch.bool, device=device)
    response_mask = torch.ones(g, r, dtype=torch.bool, device=device)
    grouper = PrefixGrouper.from_ungrouped_masks(prompt_mask, response_mask, group_sizes=g, padding_mode="right",
                                                 device=device)
    input_ids = grouper.concat_input(prompt[None], prompt_mask, responses, response_mask)
    # Position ids as Prefix Grouper's README prescribes: the prompt's, then each response from P again.
    positions = torch.cat([torch.arange(p, device=device), (p + torch.arange(r, device=device)).repeat(g)])[None]
    hidden = model.model(input_ids=input_ids, position_ids=positions, prefix_grouper=grouper,
                         prefix_grouper_attn_func=SDPA_ADAPTER, use_cache=False).last_hidden_state
    _, _, suffix_hidden, suffix_mask = grouper.split_output(hidden, include_prefix_last=1)  # (G, R + 1, d)
    suffix_hidden, suffix_mask = suffix_hidden[:, :-1], suffix_mask[:, 1:]
    targets = grouper.convert_padding(responses, response_mask, padding_mode="right")
    if not bool(suffix_mask.all()):
        raise AssertionError("unexpected padding in Prefix Grouper's suffix")
    logp = chunked_logprobs(suffix_hidden.reshape(g * r, -1), model.get_output_embeddings().weight,
                            targets.reshape(-1), token_chunk)
    return logp.view(g, r)


def prepare_prefix_grouper(model: Any) -> None:
    """Register Prefix Grouper's attention and our SDPA adapter with transformers and switch the model to it."""
    try:  # imported by name: an optional package without type information
        register_attention = importlib.import_module("prefix_grouper.utils.register_transformers").register_attention
    except ImportError as err:
        raise NotInstalled(f"Prefix Grouper cannot be imported ({err}): pip install prefix-grouper") from err
    from transformers import AttentionInterface

    register_attention()
    AttentionInterface.register(SDPA_ADAPTER, sdpa_adapter)
    model.set_attn_implementation("prefix_grouper_attention")


def run_prefix_grouper(config: dict[str, Any]) -> dict[str, Any]:
    """One group's GRPO loss forward and backward through Prefix Grouper (module docstring)."""
    from longstraw.engine.loss.config import LossConfig
    from longstraw.engine.loss.terms import GroupTotals, response_loss

    device = str(config["device"])
    g, p, r = int(config["group_size"]), int(config["prompt_tokens"]), int(config["response_tokens"])
    model = load_bench_model(str(config["model"]), str(config["dtype"]), device)
    prepare_prefix_grouper(model)
    if config["checkpoint"]:  # as transformers' Trainer enables it (its newer name first)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints only in train mode; the presets have no dropout
    group = make_group(model.config.vocab_size, p, r, g, int(config["seed"]))
    prompt, responses = group.prompt.to(device), torch.stack(group.responses).to(device)
    advantages = group.advantages.to(device)
    cfg = LossConfig("grpo")
    meter = _Meter(device)
    meter.start()
    logp = prefix_grouper_logprobs(model, prompt, responses)
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss = response_loss(logp, mask, advantages, GroupTotals.of([r] * g, cfg), cfg)
    loss.backward()
    return {**meter.stop(), "loss": float(loss.detach()), "gradient_checkpointing": _checkpointing(model),
            "peer_version": getattr(importlib.import_module("prefix_grouper"), "__version__", None)}


PEERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"trl": run_trl, "prefix_grouper": run_prefix_grouper}


def run_config(config: dict[str, Any]) -> dict[str, Any]:
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"peers worker config is missing {', '.join(missing)}")
    if config["peer"] not in PEERS:
        raise ValueError(f"unknown peer {config['peer']!r}: one of {', '.join(PEERS)}")
    try:
        return {"status": "ok", **PEERS[str(config["peer"])](config)}
    except NotInstalled as err:
        return {"status": "not installed", "error": str(err)}


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "python -m benchmarks.peers_worker '<json config>'", 1)
    if args is None:
        return 2
    print(json.dumps(run_config(json.loads(args[0]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a gloo group (one process by default; torch.distributed's environment for more): each case's actor
update through verl's TrainingWorker with verl's engine and with LongStraw's (`verl_setup.run_update`), saved by
rank 0 for test_verl.py. argv: OUT.pt, JSON {case: spec}; a spec holds the model family, verl's actor settings, the
batch options, and `refused` for a case LongStraw must refuse (then only its error message and whether any
gradient was left behind are saved). Each rank makes its own share of the batch (another seed). The batch option
`set`, a list of [field, rows, tokens, value] (rows, tokens: lists of indices, or null for every row / every
response token), overwrites those entries of the batch's (B, R_max) field inside the responses. The spec's
`reference_gap` {"scale": s, "gap": g} runs the case on the tiny model with its lm_head times s (log-probs spread
over tens of nats), the first response token of every row the likeliest one whose log-prob is at most -(g + 0.5),
old log-probs the policy's own (on-policy) and reference log-probs 0.1 below them, but g above on that token. The
spec's `env` sets LONGSTRAW_* variables for LongStraw's run; its training calls' LongStraw metrics are saved as
`calls`. The spec's `ulysses` u runs LongStraw's update with verl's ulysses_sequence_parallel_size u: the u ranks of a
group share one batch, and verl's reference update runs without Ulysses on the same batches (u data-parallel copies
of each, which leave verl's gradient unchanged: its normalisers count every copy and FSDP averages them)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile

from verl_setup import make_batch, run_update, save_tiny_model  # first: it puts verl on the CPU

# isort: split
import torch
import torch.distributed as dist
from helpers import faithful_float64
from transformers import AutoModelForCausalLM
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

import longstraw.integrations.verl as verl_integration
from longstraw.integrations.verl import LongStrawFSDPEngine


def main() -> None:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    models: dict[str, str] = {}
    results: dict[str, dict] = {}
    for name, spec in cases.items():
        family, gap = spec["family"], spec.get("reference_gap")
        key = family if gap is None else f"{family}-lm_head-x{gap['scale']}"
        if key not in models:
            models[key] = tempfile.mkdtemp(prefix=f"verl-{key}-")
            save_tiny_model(family, models[key])  # seeded: every rank saves the same weights
            if gap is not None:
                _scale_lm_head(models[key], gap["scale"])
        options = dict(spec.get("batch", {}))
        edits = options.pop("set", [])
        ulysses = spec.get("ulysses", 1)
        batch = make_batch(**options | {"seed": options.get("seed", 0) + 1000 * (rank // ulysses)})  # this rank's share
        _set(batch, edits)
        if gap is not None:
            _reference_gap(batch, models[key], gap["gap"])
        if spec.get("refused"):
            left: list[bool] = []
            try:
                with _environment(spec.get("env", {})):
                    run_update(_Watched.of(left), models[key], batch, spec["actor"], ulysses=ulysses)
                results[name] = {"error": None}
            except ValueError as err:
                results[name] = {"error": str(err), "gradients_left": any(left)}
            continue
        calls: list[dict] = []
        results[name] = {"verl": run_update(FSDPEngineWithLMHead, models[key], batch, spec["actor"],
                                            **spec.get("update", {}))}
        with _environment(spec.get("env", {})):
            results[name]["longstraw"] = run_update(_Recorded.of(calls), models[key], batch, spec["actor"],
                                                    **spec.get("update", {}) | _ulysses(ulysses))
        results[name]["calls"] = calls
        if ulysses > 1:  # LongStraw's update without Ulysses: the state each rank keeps when it is not sharded
            results[name]["unsharded_calls"] = unsharded = []
            with _environment(spec.get("env", {})):
                results[name]["unsharded"] = run_update(_Recorded.of(unsharded), models[key], batch, spec["actor"],
                                                        **spec.get("update", {}))
        if spec.get("unclamped"):  # LongStraw's update without verl's clamps: shows the case reaches them
            with _unclamped():
                results[name]["unclamped"] = run_update(LongStrawFSDPEngine, models[key], batch, spec["actor"],
                                                        **spec.get("update", {}))
        print(f"{name}: done", flush=True)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _ulysses(size: int) -> dict:
    """run_update's options for LongStraw's run with a Ulysses group of `size` (verl refuses Ulysses without its
    packed layout, use_remove_padding, which LongStraw's tree does not read)."""
    return {"ulysses": size} | ({"remove_padding": True} if size > 1 else {})


def _scale_lm_head(folder: str, scale: float) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(folder)


def _policy_logprobs(folder: str, batch) -> torch.Tensor:
    """The model's log-probs (B, R_max, V) of each response position, from a plain float64 forward of the batch."""
    model = faithful_float64(AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").double().eval())
    r_max = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    return torch.log_softmax(logits[:, -r_max - 1:-1], -1)


def _reference_gap(batch, folder: str, gap: float) -> None:
    """`reference_gap` of the module docstring, in place."""
    r_max = batch["responses"].shape[1]
    first = _policy_logprobs(folder, batch)[:, 0]  # (B, V): the first response token's, set by the prompt alone
    token = first.masked_fill(first > -gap - 0.5, -torch.inf).argmax(-1)  # the likeliest at least gap + 0.5 down
    batch["responses"][:, 0] = token
    batch["input_ids"][:, -r_max] = token
    logp = _policy_logprobs(folder, batch).gather(-1, batch["responses"][..., None])[..., 0]
    inside = batch["attention_mask"][:, -r_max:].to(logp.dtype)
    ref = logp - 0.1
    ref[:, 0] = logp[:, 0] + gap
    batch["old_log_probs"][:] = (logp * inside).to(batch["old_log_probs"].dtype)
    batch["ref_log_prob"][:] = (ref * inside).to(batch["ref_log_prob"].dtype)
    print(f"reference gap {gap}: policy log-probs of the first tokens {logp[:, 0].min():.2f}..{logp[:, 0].max():.2f}, "
          f"reference {ref[:, 0].min():.2f}..{ref[:, 0].max():.2f}", flush=True)


@contextlib.contextmanager
def _unclamped():
    """`loss_config` without the clamps, inside the block."""
    original = verl_integration.loss_config

    def without(*args, **kwargs):
        return dataclasses.replace(original(*args, **kwargs), log_ratio_clamp=None, kl_clamp=None)

    verl_integration.loss_config = without
    try:
        yield
    finally:
        verl_integration.loss_config = original


def _set(batch, edits: list) -> None:
    """The spec's `set` edits, applied where the response has tokens (padding keeps its zeros)."""
    r_max = batch["responses"].shape[1]
    inside = batch["attention_mask"][:, -r_max:].bool()
    for field, rows, tokens, value in edits:
        chosen = torch.zeros_like(inside)
        for k in range(inside.shape[0]) if rows is None else rows:
            chosen[k, slice(None) if tokens is None else tokens] = True
        batch[field][chosen & inside] = value


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """The spec's `env` (LONGSTRAW_* settings) set inside the block."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Recorded(LongStrawFSDPEngine):
    """LongStraw's engine recording, for each training mini-batch, its LongStraw metrics (the tree's statistics)."""

    calls: list[dict]

    @classmethod
    def of(cls, calls: list[dict]) -> type:
        return type("Recorded", (cls,), {"calls": calls})

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        out = super().forward_backward_batch(data, loss_function, forward_only)
        metrics = out["metrics"] if isinstance(out, dict) else {}
        if "actor/pg_loss" in metrics:
            self.calls.append({"metrics": {k: v for k, v in metrics.items() if k.startswith("actor/longstraw_")}})
        return out


class _Watched(LongStrawFSDPEngine):
    """LongStraw's engine recording, when its update raises, whether any parameter holds a gradient."""

    left: list[bool]

    @classmethod
    def of(cls, left: list[bool]) -> type:
        return type("Watched", (cls,), {"left": left})

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        try:
            return super().forward_backward_batch(data, loss_function, forward_only)
        except ValueError:
            self.left.append(any(p.grad is not None for p in self.module.parameters()))
            raise


if __name__ == "__main__":
    main()

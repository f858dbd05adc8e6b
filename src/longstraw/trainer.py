"""The GRPO training loop, top to bottom.

One step, for each of `prompts_per_step` prompts:
  rollout   — capture the prompt once, sample G responses from that state (`rollout.sample_group`);
  rewards   — decode, score with the task, drop the group if all rewards are equal (dynamic sampling);
  advantages— `compute_advantages` (grpo / mean_centered / rloo);
  reference — with beta > 0, the frozen initial model scores the responses from its own prompt capture;
then, `num_iterations` times: `backward_group` on every kept group (the first pass reuses the rollout's
prompt state, later passes recapture because the weights moved; a group whose advantages are all 0 with
beta = 0 has an exactly zero gradient and is skipped, counted in `skipped_zero_advantage`), average over
groups, clip the gradient norm, refuse a non-finite norm before the optimizer touches the weights, check that
the AdamW update leaves every weight and moment finite before applying it, AdamW step. Then the LR schedule.

Data is a pure function of (seed, step, prompt index), so resuming only needs the step number; the
checkpoint also keeps every RNG state.

Reliability: the run directory and, on resume, the checkpoint (checksum, config, model shapes) are checked
before the model loads (`rundir.py`, `checkpoint.py`); the whole dataset is checked before step 1. A step
changes the weights only at its end (optimizer and scheduler steps); until then the last completed step is
still in memory, so an exception or Ctrl-C/SIGTERM there saves it (`stopping.py` holds a signal that arrives
during the update or a checkpoint write until they finish). After a kill, a resume truncates metrics.jsonl to
the checkpoint's step.

Several processes (`longstraw train --nproc N`, or torchrun): each rank takes a contiguous slice of the step's
prompts (same seeds as one process), rolls out and backpropagates its own groups with the model sharded by
FSDP2, and the gradients are reduced once per pass (`distributed/`); the step's gradient is the mean over all
ranks' groups, as in one process. Rank 0 writes metrics and checkpoints (same file format in both cases).
"""

from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longstraw import bias
from longstraw.api import backward_group
from longstraw.checkpoint import FILENAME, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from longstraw.config import TrainConfig
from longstraw.distributed.runtime import Parallel
from longstraw.group import Group
from longstraw.loss import compute_advantages
from longstraw.memory import PeakMemory
from longstraw.models import load_model
from longstraw.rollout import SamplingConfig, sample_group, score_responses, stop_ids_of
from longstraw.rundir import check_resume_config, prepare_run_dir, print_notes, truncate_metrics
from longstraw.stopping import StopSignals
from longstraw.tasks import Example, JsonlTask, Task, format_prompt, make_task
from longstraw.tokenizer import load_tokenizer

EVAL_SEED_OFFSET = 1_000_003  # held-out prompts come from a seed stream training never draws from


class RewardError(ValueError):
    """The task's reward function raised or returned a non-finite value (the message names it and the step)."""


def _derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's hash() of ints is stable, but mixing keeps streams apart)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p + 0x632BE59BD9B4E019 + (x << 6) + (x >> 2))) & 0x7FFFFFFFFFFFFFFF
    return x


def build_task(cfg: TrainConfig, tokenizer: Any) -> Task:
    """The configured task; options that do not apply to it are not passed."""
    if cfg.task == "passkey":
        return make_task("passkey", tokenizer=tokenizer, prompt_tokens=cfg.prompt_tokens, digits=cfg.digits)
    elif cfg.task == "multikey":
        return make_task("multikey", tokenizer=tokenizer, prompt_tokens=cfg.prompt_tokens, digits=cfg.digits,
                         n_keys=cfg.num_keys)
    elif cfg.task == "kv":
        return make_task("kv", tokenizer=tokenizer, prompt_tokens=cfg.prompt_tokens)
    elif cfg.task == "jsonl":
        options: dict[str, Any] = {"path": cfg.data}
        if cfg.reward_fn:
            options["reward_fn"] = cfg.reward_fn
        return make_task("jsonl", **options)
    else:
        raise ValueError(f"unknown task {cfg.task!r}")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP2 `DTensor`) tensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _max_abs(tensors: list[torch.Tensor]) -> list[float]:
    """max |x| of each tensor (NaN or inf if it holds one), read in one pass each, with one device sync."""
    if not tensors:
        return []
    # aminmax: one read, propagates NaN, and is 2-3x faster on the CPU than vector_norm(inf) or abs().max().
    extremes = [torch.aminmax(t.reshape(-1)) for t in tensors]
    return torch.stack([torch.maximum(-lo, hi).float() for lo, hi in extremes]).tolist()


def _adamw_update_is_finite(optimizer: torch.optim.Optimizer, names: dict[int, str], grad_bound: float) -> str | None:
    """The first parameter (by name) that this AdamW step would make non-finite, or None; nothing is modified.
    grad_bound: a bound on every gradient element (the gradient's norm after clipping).

    Usually proved without computing the step, from two reads (max |w|, max v): Adam's update is bounded. With
    m_0 = v_0 = 0 and constant betas, Cauchy-Schwarz gives |m_t| <= (1-b1) sqrt(S_t v_t / (1-b2)),
    S_t = sum_{j<t} (b1^2/b2)^j, so |m_hat / (sqrt(v_hat) + eps)| <= R_t = (1-b1) sqrt(S_t / (1-b2))
    sqrt(1-b2^t) / (1-b1^t), hence |new w| <= max|w| |1 - lr wd| + lr R_t, and v_new <= b2 max v +
    (1-b2) grad_bound^2. Both a factor 4 below the dtype's largest value (room for rounding): finite. Otherwise
    (a huge lr, weights near the limit, an eps that rounds to 0 as in float16) the update is computed the way
    torch's AdamW (the trainer's: no amsgrad) computes it, one slice at a time, and checked."""
    for group in optimizer.param_groups:
        lr, (b1, b2), eps, decay = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        params = [p for p in group["params"] if p.grad is not None]
        states = [optimizer.state.get(p, {}) for p in params]
        w_max = _max_abs([_local(p.detach()) for p in params])
        v_max = _max_abs([_local(st["exp_avg_sq"]) for st in states if "exp_avg_sq" in st])
        v_max_of = iter(v_max)
        for p, st, w_abs in zip(params, states, w_max):
            step = float(st["step"]) + 1 if "step" in st else 1.0
            v_abs = next(v_max_of) if "exp_avg_sq" in st else 0.0
            limit = torch.finfo(p.dtype).max / 4
            if 0 <= b1 < 1 and 0 <= b2 < 1 and float(torch.tensor(eps, dtype=p.dtype)) > 0:
                r = b1 * b1 / b2
                s_t = step if r == 1 else (1 - r**step) / (1 - r)
                bound = (1 - b1) * math.sqrt(s_t / (1 - b2)) * math.sqrt(1 - b2**step) / (1 - b1**step)
                if (w_abs * abs(1 - lr * decay) + lr * bound < limit
                        and b2 * v_abs + (1 - b2) * grad_bound * grad_bound < limit):
                    continue
            if not _adamw_slices_are_finite(p, st, lr, b1, b2, eps, decay, step):
                return names.get(id(p), "a parameter")
    return None


def _adamw_slices_are_finite(p: torch.Tensor, state: dict, lr: float, b1: float, b2: float, eps: float,
                             decay: float, step: float) -> bool:
    """Compute parameter p's AdamW update exactly, 4M elements at a time, and say whether it stays finite."""
    weight, grad = _local(p.detach()).reshape(-1), _local(p.grad).reshape(-1)
    m = _local(state["exp_avg"]).reshape(-1) if "exp_avg" in state else torch.zeros_like(weight)
    v = _local(state["exp_avg_sq"]).reshape(-1) if "exp_avg_sq" in state else torch.zeros_like(weight)
    size = 1 << 22
    for s in range(0, weight.numel(), size):
        g = grad[s : s + size]
        denom = torch.mul(v[s : s + size], b2).addcmul_(g, g, value=1 - b2)  # v_new
        if not math.isfinite(_max_abs([denom])[0]):
            return False
        denom.sqrt_().div_(math.sqrt(1 - b2**step)).add_(eps)
        new = torch.lerp(m[s : s + size], g, 1 - b1).div_(denom).mul_(-lr / (1 - b1**step))
        new.add_(weight[s : s + size], alpha=1 - lr * decay)
        if not math.isfinite(_max_abs([new])[0]):
            return False
    return True


def _first_non_finite(model: torch.nn.Module) -> str | None:
    """The first parameter with a NaN or infinite weight (this rank's shard), or None."""
    named = list(model.named_parameters())
    for (name, _), value in zip(named, _max_abs([_local(p.detach()) for _, p in named])):
        if not math.isfinite(value):
            return name
    return None


def _lr_lambda(cfg: TrainConfig):
    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
            done = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))
        return 1.0

    return factor


@dataclass
class ScoredGroup:
    """One prompt's sampled and rewarded group, ready for the gradient passes."""

    prompt: torch.Tensor
    group: Group
    state: object  # the captured prompt state, reusable while the weights are unchanged
    rewards: torch.Tensor


class Progress:
    """One line per step on stderr; on a terminal, an in-place bar while the step runs."""

    def __init__(self, total_steps: int, enabled: bool = True) -> None:
        self.total = total_steps
        self.tty = sys.stderr.isatty()
        self.enabled = enabled  # only rank 0 prints

    def update(self, step: int, phase: str, done: int, of: int) -> None:
        if self.tty and self.enabled:
            width = 20
            filled = int(width * done / max(1, of))
            bar = "#" * filled + "-" * (width - filled)
            print(f"\rstep {step + 1}/{self.total} [{bar}] {phase} {done}/{of}   ", end="", file=sys.stderr, flush=True)

    def step_done(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = (
            f"step {m['step']}/{self.total} | reward {m['reward_mean']:.3f} (max {m['reward_max']:.3f}) | "
            f"loss {m['loss']:+.2e} | gnorm {m['grad_norm']:.2f} | peak {m['peak_memory_bytes'] / 2**30:.2f} GiB | "
            f"{m['tokens_per_s']:.0f} tok/s | "
            f"rollout {m['time_rollout_s']:.1f}s train {m['time_train_s']:.1f}s"
        )
        if "bias_cosine" in m:
            line += f" | bias: cos {m['bias_cosine']:.4f} rel err {m['bias_rel_error']:.3f}"
        if m["dropped_groups"]:
            line += f" | dropped {m['dropped_groups']} equal-reward group(s)"
        if m.get("skipped_zero_advantage"):
            line += f" | skipped {m['skipped_zero_advantage']} zero-advantage group(s) (no gradient)"
        print(("\r" if self.tty else "") + line + " " * 4, file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, cfg: TrainConfig, parallel: Parallel | None = None) -> None:
        self.cfg = cfg
        self.par = parallel if parallel is not None else Parallel(device=cfg.device)  # one process by default
        self.par.share(cfg.prompts_per_step)  # refuse a count the ranks cannot split before loading anything
        if cfg.bias_every and self.par.distributed:
            raise ValueError("--bias-every runs in one process only (sharded gradients): drop it or --nproc")
        self.run_dir = Path(cfg.run_dir)
        self._ckpt: dict[str, Any] | None = None  # the checkpoint to resume from (rank 0), read before the model
        if self.par.is_main:  # only rank 0 writes into the run directory
            prepare_run_dir(self.run_dir, cfg.resume, cfg.overwrite)
            if cfg.resume:
                self._ckpt = load_checkpoint(self.run_dir)
                print_notes(check_resume_config(self._ckpt["config"], cfg.to_dict(), cfg.force,
                                                str(self.run_dir / FILENAME)))
        self.model = load_model(cfg.model, dtype=cfg.dtype, device=self.par.device, seed=cfg.seed)
        if self._ckpt is not None:
            _check_same_shapes(self.model, self._ckpt["model"], self.run_dir / FILENAME)
        self.tokenizer = load_tokenizer(cfg.model)
        self.task = build_task(cfg, self.tokenizer)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.validate_data()
        self.reference = None
        if cfg.beta > 0:  # the frozen initial policy, for the KL term
            self.reference = copy.deepcopy(self.model).requires_grad_(False)
        self.model = self.par.shard(self.model)  # FSDP2 across ranks; unchanged in one process
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        self.sampling = SamplingConfig(
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            stop_ids=stop_ids_of(self.model, self.tokenizer),
        )
        self.step = 0
        self.summary: dict[str, Any] = {}
        # Error-path bookkeeping: `_dirty` is True from the first optimizer/scheduler step of a step until the
        # step is complete (its in-memory state is then neither the last step nor the next one).
        self._dirty = False
        self._saving = False
        self._saved_step: int | None = None
        self._steps_done = 0  # completed in this invocation
        self._boundary_rng: dict[str, Any] | None = None  # the RNG states at the last step boundary
        self.writer = None
        if cfg.tensorboard and self.par.is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--tensorboard needs the tensorboard package: "
                                 "pip install 'longstraw[tensorboard]' (or tensorboard)") from None
            self.writer = SummaryWriter(str(self.run_dir / "tb"))

    # ------------------------------------------------------------------ data

    def _encode(self, example: Example, where: str = "") -> torch.Tensor:
        ids = torch.tensor(format_prompt(self.tokenizer, example.prompt), dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError(f"{where or 'the task'}: empty prompt")
        if self.max_positions is not None and ids.numel() + self.cfg.max_new_tokens > self.max_positions:
            fix = "shorten it" if where else "lower --prompt-tokens"
            raise ValueError(
                f"{where + ': ' if where else ''}prompt of {ids.numel()} tokens + {self.cfg.max_new_tokens} new "
                f"tokens exceeds the {self.max_positions} positions of model {self.cfg.model!r}: {fix} or lower "
                "--max-new-tokens"
            )
        return ids

    def validate_data(self) -> None:
        """Before step 1: every row of a jsonl dataset (non-empty, fits the model's positions with the longest
        response), or one generated example (haystack/kv prompts land within a word/pair of --prompt-tokens)."""
        if isinstance(self.task, JsonlTask):
            for example in self.task.rows:
                self._encode(example, where=f"{self.task.path}:{example.meta['line']}")
        else:
            self._encode(self.step_examples(0)[0])

    def step_examples(self, step: int) -> list[Example]:
        return [self.task.sample(random.Random(_derive_seed(self.cfg.seed, step, j)))
                for j in range(self.cfg.prompts_per_step)]

    def _decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    # ------------------------------------------------------------------ one step

    def rollout(self, step: int, j: int, example: Example) -> ScoredGroup:
        cfg = self.cfg
        prompt = self._encode(example)
        cp = self.par.context_parallel  # None unless ranks share prompts (--cp)
        # The exact plan reuses this state and needs the recurrent state at every chunk boundary; detach does not.
        out = sample_group(self.model, prompt, cfg.group_size, self.sampling, seed=_derive_seed(cfg.seed, step, j, 1),
                           chunk_size=cfg.chunk_size, keep_boundaries=cfg.plan == "exact", context_parallel=cp)
        rewards = torch.tensor([self._reward(self._decode(r), example, f"step {step + 1}") for r in out.responses],
                               dtype=torch.float64)
        advantages = compute_advantages(rewards, cfg.advantage)
        ref = None
        if self.reference is not None:
            ref = score_responses(self.reference, prompt, out.responses, cfg.chunk_size, cfg.micro_batch,
                                  context_parallel=cp)
        group = Group(prompt, out.responses, advantages, old_logprobs=out.logprobs, ref_logprobs=ref)
        return ScoredGroup(prompt=prompt, group=group, state=out.state, rewards=rewards)

    def _reward(self, completion: str, example: Example, where: str) -> float:
        """The task's reward of one completion; RewardError naming the function and `where` if it fails."""
        name = repr(self.cfg.reward_fn) if self.cfg.reward_fn else f"of task {self.cfg.task!r}"
        try:
            value = float(self.task.reward(completion, example))
        except Exception as err:
            if isinstance(err, ValueError) and name in str(err):  # the task's own check already names it
                raise RewardError(f"{where}: {err}") from err
            raise RewardError(f"{where}: the reward function {name} raised {type(err).__name__}: {err}") from err
        if not math.isfinite(value):
            raise RewardError(f"{where}: the reward function {name} returned {value}; a reward must be finite")
        return value

    def train_step(self, step: int, progress: Progress) -> dict[str, Any]:
        cfg = self.cfg
        meter = PeakMemory(cfg.device)
        meter.start()
        t0 = time.perf_counter()
        examples = self.step_examples(step)
        mine = self.par.share(len(examples))  # this rank's prompts (all of them in one process)
        kept: list[ScoredGroup] = []
        all_rewards, dropped, response_tokens = [], 0, 0
        with self.par.compute(self.model, reduce=False):
            for j in mine:
                progress.update(step, "rollout", j - mine.start, len(mine))
                r = self.rollout(step, j, examples[j])
                all_rewards.append(r.rewards)
                response_tokens += sum(r.group.lengths)
                if cfg.dynamic_sampling and bool((r.rewards == r.rewards[0]).all()):
                    dropped += 1
                    continue
                kept.append(r)
        t1 = time.perf_counter()

        loss_total, grad_norm, bias_metrics = 0.0, 0.0, {}
        n_kept = int(self.par.sum(len(kept)))  # over all ranks: every rank takes the same branches below
        skipped = 0  # kept groups of this rank whose gradient is exactly zero (all advantages 0, beta 0)
        for it in range(cfg.num_iterations if n_kept else 0):
            self.optimizer.zero_grad(set_to_none=True)
            loss_total, skipped = 0.0, 0
            with self.par.compute(self.model):  # sharded: gradients reduced (averaged over ranks) once, at exit
                for j, r in enumerate(kept):
                    progress.update(step, f"train (pass {it + 1})", j, len(kept))
                    result = backward_group(
                        self.model, r.group, mode=cfg.plan, loss=cfg.loss, chunk_size=cfg.chunk_size,
                        micro_batch=cfg.micro_batch, prompt_state=r.state if it == 0 else None,
                        context_parallel=self.par.context_parallel,
                        checkpoint="layers" if cfg.checkpoint_layers else "none", offload_state=cfg.offload_state,
                        **cfg.loss_options(),
                    )
                    if cfg.offload_state:
                        r.state = None  # its host copy served this pass: free the device copy the sampler made
                    loss_total += result.loss / n_kept
                    skipped += result.skipped == "zero_advantage"
            loss_total = self.par.sum(loss_total)
            if self.par.sum(len(kept) - skipped) == 0:
                # Every group was skipped: give AdamW the zero gradient the passes would have produced, so the
                # step (momentum, weight decay) is the one it was before skipping existed.
                for p in self.model.parameters():
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
            params = [p for p in self.model.parameters() if p.grad is not None]
            for p in params:  # the step's loss is the mean of all groups' losses (ranks' sums were averaged)
                p.grad.div_(n_kept / self.par.world_size)
            if it == 0 and bias.due(cfg, step):  # the step's own unclipped gradient vs the exact one; changes nothing
                bias_metrics = bias.measure(self.model, [r.group for r in kept], cfg)
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            grad_norm = self.par.clip_grad_norm(params, max_norm)
            if not math.isfinite(grad_norm):
                raise FloatingPointError(
                    f"step {step + 1}: gradient norm is {grad_norm}; the optimizer step was skipped and the weights "
                    "are unchanged. Lower the learning rate, use float32, or check the rewards"
                )
            self._checked_optimizer_step(step, min(grad_norm, max_norm))  # a bound on every gradient element
        self._dirty = True
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():
            # The schedule follows steps, also a step whose groups were all dropped (no optimizer.step()).
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        t2 = time.perf_counter() - bias_metrics.get("time_bias_s", 0.0)  # phase times and tok/s: the step's own

        ranks = self.par.gather({  # every rank's share of the step, in rank order (= prompt order)
            "rewards": torch.cat(all_rewards), "dropped": dropped, "response_tokens": response_tokens,
            "prompt_tokens": sum(int(r.prompt.numel()) for r in kept), "peak": meter.peak_absolute_bytes(),
            "t_rollout": t1 - t0, "t_train": t2 - t1, "t_step": t2 - t0, "skipped": skipped,
        })
        peak = max(x["peak"] for x in ranks)
        ranks = ranks[:: self.par.cp_size]  # the ranks of a context-parallel block hold the same groups
        rewards = torch.cat([x["rewards"] for x in ranks])
        dropped = sum(x["dropped"] for x in ranks)
        response_tokens = sum(x["response_tokens"] for x in ranks)
        prompt_tokens = sum(x["prompt_tokens"] for x in ranks)
        t_rollout, t_train = max(x["t_rollout"] for x in ranks), max(x["t_train"] for x in ranks)
        return {
            "step": step + 1,
            "reward_mean": float(rewards.mean()),
            "reward_max": float(rewards.max()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "loss": loss_total,
            "grad_norm": grad_norm,
            "lr": lr,
            "kept_groups": n_kept // self.par.cp_size,  # a context-parallel block's ranks share their groups
            "skipped_zero_advantage": sum(x["skipped"] for x in ranks),
            "dropped_groups": dropped,
            "response_tokens_mean": response_tokens / max(1, rewards.numel()),
            "prompt_tokens": prompt_tokens // max(1, n_kept // self.par.cp_size) if n_kept else 0,
            "peak_memory_bytes": peak,  # the largest rank's
            "tokens_per_s": (prompt_tokens + response_tokens) / max(1e-9, max(x["t_step"] for x in ranks)),
            "time_rollout_s": t_rollout,
            "time_train_s": t_train,
            **bias_metrics,
        }

    def _checked_optimizer_step(self, step: int, grad_bound: float) -> None:
        """AdamW step, refused (nothing applied) if it would make a weight or moment non-finite; then the weights
        are checked again, in case the step did what the check did not foresee."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        bad = [b for b in self.par.gather(_adamw_update_is_finite(self.optimizer, names, grad_bound)) if b]
        if bad:
            raise FloatingPointError(
                f"step {step + 1}: the AdamW update would make {bad[0]} (its weight or second moment) non-finite; "
                "it was not applied: the weights and optimizer state are as they were before it. Lower the learning "
                "rate, check the rewards, or use float32"
            )
        self._dirty = True  # from here until the step is complete, the state is not a step boundary
        self.optimizer.step()
        bad = [b for b in self.par.gather(_first_non_finite(self.model)) if b]
        if bad:
            raise FloatingPointError(
                f"step {step + 1}: after the AdamW step, {bad[0]} holds non-finite values (the update check passed, "
                "so this is unexpected); this process's weights are unusable: resume from the last checkpoint"
            )

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, when: str) -> float:
        """Mean greedy reward on held-out prompts (a seed stream training never draws from). It can take minutes
        on a CPU, so rank 0 says what it is doing and counts the prompts (in place on a terminal)."""
        cfg = self.cfg
        if cfg.eval_prompts == 0:
            return float("nan")
        greedy = SamplingConfig(max_new_tokens=cfg.max_new_tokens, top_k=1, stop_ids=self.sampling.stop_ids)
        examples = self.task.examples(cfg.eval_prompts, seed=cfg.seed + EVAL_SEED_OFFSET)
        mine = examples[self.par.dp_rank :: self.par.dp_size]  # blocks of ranks split the prompts
        talk = self.par.is_main
        if talk:
            print(f"held-out evaluation {when}: {len(examples)} prompts, greedy ...", file=sys.stderr, flush=True)
        tty = sys.stderr.isatty()
        total = 0.0
        with self.par.compute(self.model, reduce=False):
            for i, example in enumerate(mine):
                out = sample_group(self.model, self._encode(example), 1, greedy, chunk_size=cfg.chunk_size,
                                   context_parallel=self.par.context_parallel)
                total += self._reward(self._decode(out.responses[0]), example, "held-out evaluation")
                if talk and tty:
                    print(f"\r  prompt {i + 1}/{len(mine)}   ", end="", file=sys.stderr, flush=True)
        if talk and tty:
            print("\r", end="", file=sys.stderr, flush=True)
        return self.par.sum(total) / self.par.cp_size / len(examples)  # a block's ranks all add the same

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        """Checkpoint the current step boundary (every rank calls: a sharded state is gathered to rank 0)."""
        self._saving = True  # a signal now waits for the write to finish
        try:
            state = self.par.full_state(self.model, self.optimizer)
            if state is not None:  # rank 0
                save_checkpoint(self.run_dir, {
                    "step": self.step,
                    "model": state[0],
                    "optimizer": None if self.cfg.save_weights_only else state[1],
                    "scheduler": self.scheduler.state_dict(),
                    "config": self.cfg.to_dict(),
                    "summary": self.summary,
                    "rng": self._boundary_rng if self._boundary_rng is not None else rng_state(),
                })
            self._saved_step = self.step
        finally:
            self._saving = False

    def restore(self) -> None:
        ckpt, self._ckpt = self._ckpt, None  # read and checked in __init__ (rank 0); dropped once loaded
        meta = None
        if ckpt is not None:
            meta = {"scheduler": ckpt["scheduler"], "step": ckpt["step"], "summary": ckpt.get("summary", {}),
                    "has_optimizer": ckpt["optimizer"] is not None}
        meta = self.par.broadcast(meta)
        optimizer = self.optimizer if meta["has_optimizer"] else None
        self.par.load_full_state(self.model, optimizer, ckpt and ckpt["model"], ckpt and ckpt["optimizer"])
        self.scheduler.load_state_dict(meta["scheduler"])
        self.step = self._saved_step = int(meta["step"])
        self.summary = dict(meta["summary"])
        if ckpt is not None:
            set_rng_state(ckpt["rng"])
            if not meta["has_optimizer"]:
                print(f"{self.run_dir / FILENAME} holds weights only (save_weights_only): the optimizer state "
                      f"restarts from zero at step {self.step}, so this run differs from an uninterrupted one",
                      file=sys.stderr)

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        """Train to cfg.steps (or cfg.stop_after more steps). On an exception or Ctrl-C/SIGTERM after a
        completed step, the last completed step is checkpointed (one process) before the error propagates."""
        signals = StopSignals(busy=lambda: self._dirty or self._saving,
                              describe=lambda: f"finishing step {self.step + 1}'s update, then saving and stopping")
        with signals:
            try:
                return self._run(signals)
            except BaseException:
                self._save_after_failure()
                raise

    def _save_after_failure(self) -> None:
        """Checkpoint the last completed step unless it is already saved; one line on stderr saying where."""
        path = self.run_dir / FILENAME
        on_disk = f"the last checkpoint, step {self._saved_step}, is {path}" if self._saved_step is not None else \
            "no checkpoint was written"
        if self._steps_done == 0 and not self._dirty:
            return  # nothing new since the start (or the resumed checkpoint)
        if self._dirty or self.par.distributed:
            why = (f"step {self.step + 1} had already changed the weights when it failed, so it is not saved"
                   if self._dirty else "a failed distributed run cannot gather its state")
            if self.par.is_main:
                print(f"longstraw train: {why}; {on_disk}", file=sys.stderr)
            return
        if self._saved_step == self.step:
            print(f"longstraw train: the last completed step ({self.step}) is saved in {path}; continue with --resume",
                  file=sys.stderr)
            return
        try:
            self.save()
        except Exception as err:
            print(f"longstraw train: could not save step {self.step} ({type(err).__name__}: {err}); {on_disk}",
                  file=sys.stderr)
            return
        print(f"longstraw train: saved the last completed step ({self.step}) to {path}; continue with --resume",
              file=sys.stderr)

    def _run(self, signals: StopSignals) -> dict[str, Any]:
        cfg = self.cfg
        main = self.par.is_main  # only rank 0 prints and writes files
        metrics_path = self.run_dir / "metrics.jsonl"
        if cfg.resume:
            self.restore()
            if main:
                dropped = truncate_metrics(metrics_path, self.step)  # rows past the checkpoint are redone
                extra = f" ({dropped} metrics row(s) after it removed)" if dropped else ""
                print(f"resumed from {self.run_dir / FILENAME} at step {self.step}{extra}", file=sys.stderr)
        else:
            self.summary["eval_before"] = self.evaluate("before training")
            if cfg.eval_prompts and main:
                print(f"held-out greedy reward before training: {self.summary['eval_before']:.3f} "
                      f"({cfg.eval_prompts} prompts)", file=sys.stderr)
        self._boundary_rng = rng_state()
        progress = Progress(cfg.steps, enabled=main)
        last = min(cfg.steps, self.step + cfg.stop_after) if cfg.stop_after else cfg.steps
        while self.step < last:
            m = self.train_step(self.step, progress)  # sets _dirty once it changes the weights
            self.step += 1
            self._steps_done += 1
            if main:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(m) + "\n")
            self._boundary_rng = rng_state()
            self._dirty = False  # a step boundary again
            if self.writer is not None:
                for key, value in m.items():
                    if key != "step":
                        self.writer.add_scalar(key, value, m["step"])
            progress.step_done(m)
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < last:
                self.save()
            signals.check()  # a Ctrl-C held during the update stops here, at the boundary
        if self.step < cfg.steps:  # stopped early on purpose: checkpoint, no final evaluation
            self.save()
            signals.check()
            if main:
                print(f"stopped after step {self.step}; continue with --resume", file=sys.stderr)
            return self.summary
        self.summary["eval_after"] = self.evaluate("after training")
        self.summary["steps"] = self.step
        self.save()
        if not main:
            return self.summary
        if cfg.eval_prompts:
            print(f"held-out greedy reward: before {self.summary.get('eval_before', float('nan')):.3f} -> "
                  f"after {self.summary['eval_after']:.3f}", file=sys.stderr)
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        written = [metrics_path.name, "summary.json", FILENAME]
        if cfg.plot and plot_metrics(metrics_path, self.run_dir / "progress.png"):
            written.append("progress.png")
        if self.writer is not None:
            self.writer.close()
        print(f"outputs in {self.run_dir}: {', '.join(written)}", file=sys.stderr)
        return self.summary


def _check_same_shapes(model: torch.nn.Module, saved: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another architecture before load_state_dict raises a size-mismatch traceback."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in saved.items()}
    missing, extra = sorted(set(own) - set(theirs)), sorted(set(theirs) - set(own))
    differ = [k for k in own if k in theirs and own[k] != theirs[k]]
    if missing or extra or differ:
        detail = [f"{len(differ)} tensor(s) of another shape (e.g. {differ[0]}: {theirs[differ[0]]} in the "
                  f"checkpoint, {own[differ[0]]} here)"] if differ else []
        detail += [f"{len(missing)} missing (e.g. {missing[0]})"] if missing else []
        detail += [f"{len(extra)} unknown (e.g. {extra[0]})"] if extra else []
        raise ValueError(f"checkpoint {path} holds another model than this run's: {'; '.join(detail)}. Resume "
                         "with the model it was trained from")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_path: Path, out: Path) -> Path | None:
    """Reward (mean and max) and peak memory per step, and the bias meter's numbers when the run has them, as a
    PNG. Skipped with a note without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)", file=sys.stderr)
        return None
    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    metered = [r for r in rows if "bias_cosine" in r]
    fig, axes = plt.subplots(1, 3 if metered else 2, figsize=(15 if metered else 10, 3.6))
    ax1, ax2 = axes[0], axes[1]
    means = [r["reward_mean"] for r in rows]
    window = 5  # one group per step is noisy: show the trend too
    trend = [sum(means[max(0, i - window + 1) : i + 1]) / len(means[max(0, i - window + 1) : i + 1])
             for i in range(len(means))]
    ax1.plot(steps, means, marker="o", alpha=0.45, label="mean")
    ax1.plot(steps, trend, linewidth=2.2, label=f"mean, {window}-step average")
    ax1.plot(steps, [r["reward_max"] for r in rows], linestyle="--", alpha=0.6, label="max")
    ax1.set_xlabel("step")
    ax1.set_ylabel("reward")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend()
    ax1.set_title("sampled reward")
    ax2.plot(steps, [r["peak_memory_bytes"] / 2**30 for r in rows], marker="o", color="tab:red")
    ax2.set_xlabel("step")
    ax2.set_ylabel("GiB")
    ax2.set_title("peak memory per step")
    if metered:
        bias.plot_panel(axes[2], metered)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train in this process, or as one rank of a distributed job when launched by torchrun (WORLD_SIZE > 1)."""
    parallel = Parallel.start(cfg.device, cp=cfg.cp)
    try:
        summary = Trainer(cfg, parallel).run()
    except BaseException as err:
        parallel.fail(err)  # the other ranks print this error and exit instead of waiting forever
        raise
    parallel.close()
    return summary

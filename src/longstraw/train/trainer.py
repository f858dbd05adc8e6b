"""The GRPO training loop, top to bottom.

One step, for each of `prompts_per_step` prompts (`sampler.py`): capture the prompt once and sample G responses from
that state; decode and score them with the task, dropping a group whose rewards are all equal (dynamic sampling);
their advantages; with beta > 0, the frozen initial model's log-probs of them from its own prompt capture. (With
--rollout tree each prompt's rollout is a tree, trained with `backward_tree` on the prefix tree of its leaves.) Then,
`num_iterations` times: `backward_group` on every kept group (the first pass reuses the rollout's prompt state; a
group whose advantages are all 0 with beta = 0 has an exactly zero gradient and is skipped, counted in
`skipped_zero_advantage`), the mean over groups, the clipped gradient norm, and the AdamW step, refused before it
touches the weights when the norm or the update would be non-finite (`optimizer.py`). Then the LR schedule.

Reliability: the run directory and, on resume, the checkpoint are checked before the model loads, and rank 0 holds
the directory's lock until the run ends (`rundir.py`, `checkpoints.py`); the whole dataset is checked before step 1.
A step changes the weights only at its end, so an exception or Ctrl-C/SIGTERM before that saves the last completed
step, still in memory; a signal during the update or a checkpoint write is held until they finish (`stopping.py`).
With several ranks a signal is held until the step ends, where the ranks agree (one gather) and save together.

Several processes (`longstraw train --nproc N`, or torchrun): each rank takes a contiguous slice of the step's prompts
(same seeds as one process) with the model sharded by FSDP2, and the gradients are reduced once per pass
(`distributed/`), so the step's gradient is the mean over all ranks' groups. Rank 0 writes metrics and checkpoints."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from longstraw.admission.loading import load_model
from longstraw.api.group import backward_group
from longstraw.api.tree import backward_tree
from longstraw.distributed.runtime import Parallel
from longstraw.engine.sampling import stop_ids_of
from longstraw.models.tokenizer import load_tokenizer
from longstraw.train import bias
from longstraw.train.checkpoints import (
    FILENAME,
    CheckpointWriteError,
    check_same_shapes,
    restore_run,
    rng_state,
    save_run,
)
from longstraw.train.config import TrainConfig
from longstraw.train.data import TaskData
from longstraw.train.optimizer import (
    check_weights_finite,
    clip_and_check,
    make_optimizer,
    mean_gradient,
    scheduler_step,
)
from longstraw.train.preflight import distributed_rules
from longstraw.train.reporting import Progress, Report, StepLog
from longstraw.train.rundir import RunLock, open_run_dir
from longstraw.train.sampler import Sampler, ScoredTree
from longstraw.train.stopping import StopSignals, TrainingInterrupted, save_after_failure, warm_start_stopped
from longstraw.train.warmup import check_gold, warm_start


class StoppedTogether(TrainingInterrupted):
    """A stop signal every rank of a distributed run agreed on at a step boundary, after saving that step together:
    the ranks end cleanly (no failure is reported to the others)."""


class Trainer:
    def __init__(self, cfg: TrainConfig, parallel: Parallel | None = None) -> None:
        self.cfg = cfg
        self.par = parallel if parallel is not None else Parallel(device=cfg.model.device)  # one process by default
        self.options = cfg.plan.backward_options(context_shards=self.par.context_shards)  # every group's backward
        self.par.share(cfg.rollout.prompts_per_step)  # refuse a count the ranks cannot split before loading anything
        distributed_rules(cfg, self.par.world_size)  # the launcher of --nproc checked them too, before any rank
        self.run_dir = Path(cfg.run.run_dir)
        # Rank 0 checks and locks the run directory and, on resume, reads and checks the checkpoint, before the model
        # loads. The lock is held until `run` ends (released here if the setup fails).
        self._lock: RunLock | None = None
        self._ckpt: dict[str, Any] | None = None  # dropped once loaded
        if self.par.is_main:
            self._lock, self._ckpt = open_run_dir(self.run_dir, cfg)
        try:
            self._setup(cfg)
        except BaseException:
            self.release()
            raise

    def _setup(self, cfg: TrainConfig) -> None:
        """Everything after the run directory: the model, data, optimizer, sampler and reporting."""
        self.model = load_model(cfg.model.model, dtype=cfg.model.dtype, device=self.par.device, seed=cfg.run.seed)
        if self._ckpt is not None:
            check_same_shapes(self.model, self._ckpt["model"], self.run_dir / FILENAME)
        tokenizer = load_tokenizer(cfg.model.model)  # the data checks every prompt against the model's positions
        self.data = TaskData(cfg, tokenizer, getattr(self.model.config, "max_position_embeddings", None))
        self.reference = copy.deepcopy(self.model).requires_grad_(False) if cfg.plan.beta > 0 else None  # for the KL
        self.model = self.par.shard(self.model)  # FSDP2 across ranks; unchanged in one process
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg)
        self.sampler = Sampler(cfg, self.data, stop_ids_of(self.model, tokenizer), self.reference, self.par)
        if cfg.optimizer.warm_start_steps:
            check_gold(cfg, self.data, self.sampler.sampling.stop_ids)
        self.step = 0
        self.summary: dict[str, Any] = {}
        # Error-path bookkeeping: `_dirty` is True from the first optimizer/scheduler step of a step until the
        # step is complete (its in-memory state is then neither the last step nor the next one).
        self._dirty = self._saving = self._warming = False  # _warming: in the warm start (`_warm_start`)
        self._saved_step: int | None = None
        self._steps_done = 0  # completed in this invocation
        self._boundary_rng: dict[str, Any] | None = None  # the RNG states at the last step boundary
        self.report = Report(cfg, self.run_dir, enabled=self.par.is_main)  # only rank 0 prints and writes files

    def train_step(self, step: int, progress: Progress) -> dict[str, Any]:
        cfg = self.cfg
        log = StepLog(cfg.model.device)  # this rank's time, peak memory, rewards and tokens; starts the clock
        kept = self.sampler.step_groups(self.model, step, progress, log)  # rollout, rewards, advantages, reference
        loss_total, grad_norm, skipped, bias_metrics = 0.0, 0.0, 0, {}
        n_kept = int(self.par.sum(len(kept)))  # over all ranks: every rank takes the same branches below
        for it in range(cfg.plan.num_iterations if n_kept else 0):
            self.optimizer.zero_grad(set_to_none=True)
            loss_total, skipped = 0.0, 0  # skipped: this rank's groups of zero gradient (advantages all 0, beta 0)
            with self.par.compute(self.model):  # sharded: gradients reduced (averaged over ranks) once, at exit
                for j, r in enumerate(kept):
                    progress.update(step, f"train (pass {it + 1})", j, len(kept))
                    if isinstance(r, ScoredTree):  # --rollout tree: the leaves' prefix tree, shared tokens once
                        tree_result = backward_tree(self.model, r.tree, self.options)
                        loss_total += tree_result.loss / n_kept
                        skipped += tree_result.skipped == "zero_advantage"
                        continue
                    state = r.state if it == 0 else None  # the rollout's prompt state serves the first pass
                    result = backward_group(self.model, r.group, self.options, prompt_state=state)
                    if cfg.plan.offload_state:
                        r.state = None  # its host copy served this pass: free the device copy the sampler made
                    loss_total += result.loss / n_kept
                    skipped += result.skipped == "zero_advantage"
            loss_total = self.par.sum(loss_total)
            params = mean_gradient(self.model, n_kept / self.par.world_size,  # as the loss: the mean over groups
                                   none_computed=self.par.sum(len(kept) - skipped) == 0)
            if it == 0 and bias.due(cfg, step):  # the step's own unclipped gradient vs the exact one; changes nothing
                bias_metrics = bias.measure(self.model, [r.group for r in kept if not isinstance(r, ScoredTree)], cfg)
            # Clip; refuse a non-finite norm, or an update that would make a weight non-finite, before AdamW runs.
            grad_norm = clip_and_check(self.par, self.optimizer, self.model, params, cfg.optimizer.max_grad_norm, step)
            self._dirty = True  # from here until the step is complete, the state is not a step boundary
            self.optimizer.step()
            check_weights_finite(self.par, self.model, step)  # in case the step did what the check did not foresee
        self._dirty = True
        self.optimizer.zero_grad(set_to_none=True)
        lr = float(self.scheduler.get_last_lr()[0])  # typed float | Tensor; the trainer sets a float lr
        scheduler_step(self.scheduler)  # every step, also one whose groups were all dropped
        return log.row(self.par, step, n_kept, skipped, loss_total, grad_norm, lr, bias_metrics)

    def _agent_eval(self, when: str) -> None:
        """An agent task's held-out tool-call rate of the evaluation just run, in the summary."""
        if self.data.call_end and self.cfg.run.eval_prompts:
            self.summary[f"tool_call_rate_{when}"] = self.sampler.eval_tool_call_rate

    def _warm_start(self, signals: StopSignals) -> None:
        """The supervised warm start (`warmup.py`) on a fresh run, then the held-out evaluation after it. Its weights
        are no step boundary: a failure during it saves nothing (the run starts over). A Ctrl-C/SIGTERM is held only
        until the current gold response's backward ends, then stops the run."""
        self._dirty = self._warming = True
        self.summary["warm_start"] = warm_start(self.model, self.cfg, self.data, self.options,
                                                self.sampler.sampling.stop_ids, self.report.note, stop=signals.check)
        self._dirty = self._warming = False
        self.summary["eval_after_warm_start"] = self.sampler.evaluate(self.model, "after the warm start")
        self._agent_eval("after_warm_start")
        rate = self.summary.get("tool_call_rate_after_warm_start", float("nan"))
        self.report.note(f"held-out greedy reward after the warm start: {self.summary['eval_after_warm_start']:.3f}"
                         f" (tool-call rate {rate:.2f})")

    def save(self) -> None:
        """Checkpoint the current step boundary (every rank calls: a sharded state is gathered to rank 0)."""
        self._saving = True  # a signal now waits for the write to finish
        try:
            save_run(self.par, self.run_dir, self.model, self.optimizer, self.scheduler, self.cfg, self.step,
                     self.summary, self._boundary_rng)
            self._saved_step = self.step
        finally:
            self._saving = False

    def run(self) -> dict[str, Any]:
        """Train to cfg.optimizer.steps (or cfg.run.stop_after more steps). On an exception or Ctrl-C/SIGTERM after a
        completed step, the last completed step is checkpointed before the error propagates (several ranks: a
        signal stops them together at the end of the step, saved; an exception is not saved, see `stopping`)."""
        # Several ranks: a signal is always held until the next step boundary, where every rank learns whether any
        # rank got one (`_stop_requested`) and they save and stop together (saving is a collective).
        signals = StopSignals(busy=lambda: self.par.distributed or self._dirty or self._saving,
                              describe=self._describe_stop)
        try:
            with signals:
                try:
                    return self._run(signals)
                except BaseException as err:
                    if self._warming:  # a fresh run's warm start: nothing to save, and nothing was
                        self.report.warn(warm_start_stopped(err, self.run_dir))
                    elif not isinstance(err, CheckpointWriteError):  # its message says what is on disk
                        save_after_failure(self.save, self.run_dir / FILENAME, step=self.step,
                                           saved_step=self._saved_step, steps_done=self._steps_done,
                                           dirty=self._dirty, par=self.par)
                    raise
        finally:
            self.release()

    def release(self) -> None:
        """Release the run directory's lock (rank 0; idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _describe_stop(self) -> str:
        if self._warming:
            return "stopping after the warm start's current gold response; nothing of the warm start is saved"
        if self.par.distributed:  # rank 0 speaks for all
            return f"every rank finishes step {self.step + 1}, then they save and stop" if self.par.is_main else ""
        return f"finishing step {self.step + 1}'s update, then saving and stopping"

    def _stop_requested(self, signals: StopSignals) -> None:
        """At a step boundary: raise a held SIGINT/SIGTERM. Several ranks first agree (one gather): if any rank
        holds one, every rank saves the completed step (unless saved) and raises `StoppedTogether`."""
        if not self.par.distributed:
            signals.check()
            return
        signum = max(int(s or 0) for s in self.par.gather(signals.pending))
        if not signum:
            return
        signals.pending = None
        if self._saved_step != self.step:
            self.save()
        raise StoppedTogether(signum)

    def _run(self, signals: StopSignals) -> dict[str, Any]:
        cfg, report = self.cfg, self.report
        if cfg.run.resume:
            ckpt, self._ckpt = self._ckpt, None  # read and checked in __init__ (rank 0); dropped once loaded
            self.step, self.summary = restore_run(self.par, ckpt, self.model, self.optimizer, self.scheduler,
                                                  self.run_dir)
            self._saved_step = self.step
            report.resumed(self.step)  # metrics rows past the checkpoint are removed: those steps are redone
        else:
            self.summary["eval_before"] = self.sampler.evaluate(self.model, "before training")
            report.eval_before(self.summary["eval_before"])
            self._agent_eval("before")
            if cfg.optimizer.warm_start_steps:
                self._warm_start(signals)
        self._boundary_rng = rng_state()
        last = min(cfg.optimizer.steps, self.step + cfg.run.stop_after) if cfg.run.stop_after else cfg.optimizer.steps
        while self.step < last:
            m = self.train_step(self.step, report.progress)  # sets _dirty once it changes the weights
            self.step += 1
            self._steps_done += 1
            report.write(m)  # metrics.jsonl, before the step counts as complete
            self._boundary_rng = rng_state()
            self._dirty = False  # a step boundary again
            report.show(m)  # TensorBoard, the progress line
            if cfg.run.save_every and self.step % cfg.run.save_every == 0 and self.step < last:
                self.save()
            self._stop_requested(signals)  # a Ctrl-C held during the update stops here, at the boundary
        if self.step < cfg.optimizer.steps:  # stopped early on purpose: checkpoint, no final evaluation
            self.save()
            self._stop_requested(signals)
            report.note(f"stopped after step {self.step}; continue with --resume")
            return self.summary
        self.summary["eval_after"] = self.sampler.evaluate(self.model, "after training")
        self._agent_eval("after")
        self.summary["steps"] = self.step
        self.save()
        report.finish(self.summary)  # rank 0: the evaluation line, summary.json, progress.png, the outputs
        return self.summary


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train in this process, or as one rank of a distributed job when launched by torchrun (WORLD_SIZE > 1)."""
    parallel = Parallel.start(cfg.model.device, cp=cfg.parallelism.cp, tp=cfg.parallelism.tp)
    stopped = 0
    try:
        summary = Trainer(cfg, parallel).run()
    except StoppedTogether as err:
        stopped = err.signum  # every rank saved and stops: nothing to report to the others
    except BaseException as err:
        parallel.fail(err)  # the other ranks print this error and exit instead of waiting forever
        raise
    parallel.close()  # outside the except blocks, so no traceback holds the trainer when the group ends
    if stopped:
        raise StoppedTogether(stopped)
    return summary

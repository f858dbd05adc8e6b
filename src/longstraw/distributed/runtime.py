"""The trainer's view of the process group: who am I, which prompts are mine, reduce the metrics, save and load
full checkpoints, and make a failure on one rank stop every rank.

`Parallel()` (one process) makes every method a no-op or an identity, so the trainer reads the same in both cases.
`Parallel.start(device)` joins the process group that torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) describes: gloo on CPU, nccl on CUDA (one GPU per rank, `cuda:LOCAL_RANK`).

Failure propagation: a rank that raises writes "rank R failed: <error>" to the group's key-value store; a watcher thread
on every other rank prints it and exits with status 1, rather than block in a collective until the group's timeout (30
minutes). torchrun stops a failed job's other local workers too; the watcher adds the message, and other nodes.

A rank ends with its launcher (`end_with_launcher`, in `Parallel.start`): no rank outlives a SIGKILLed launcher."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import os
import signal
import sys
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from longstraw.distributed.context import ContextParallel, check_blocks, context_blocks
from longstraw.distributed.fsdp import clip_grad_norm, parallelize, sharded_compute

FAILURE_KEY = "longstraw/failure"
ACK_KEY = "longstraw/failure_seen"
# The launcher's PID, set by `longstraw train --nproc` (launch.py): a rank whose parent differs was orphaned early.
LAUNCHER_PID_ENV = "LONGSTRAW_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_DEATH_SIGNAL = signal.SIGHUP


def end_with_launcher(poll_s: float = 1.0) -> None:
    """Stop this rank like SIGTERM would when its parent (the launcher, or torchrun's agent) dies (Linux
    `PR_SET_PDEATHSIG`, elsewhere a thread polling the parent's PID); if the parent is already gone, SIGTERM now. The
    kernel sends the parent-death signal once per ending launcher thread: it is SIGHUP, turned into a single SIGTERM
    here, so that the trainer sees one stop request (a second SIGTERM means "stop at once, without saving")."""
    expected = os.environ.get(LAUNCHER_PID_ENV)
    parent = int(expected) if expected and expected.isdigit() else os.getppid()
    if threading.current_thread() is threading.main_thread():
        signal.signal(PARENT_DEATH_SIGNAL, _parent_died)
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) == 0
        except OSError:
            armed = False
    if not armed:  # no prctl: a watchdog thread notices the parent's end (this process is then re-parented)
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(poll_s)
            os.kill(os.getpid(), PARENT_DEATH_SIGNAL)

        threading.Thread(target=watch, name="longstraw-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before prctl: its signal will never come
        os.kill(os.getpid(), signal.SIGTERM)


_parent_gone = threading.Event()


def _parent_died(signum: int, frame: object) -> None:
    if not _parent_gone.is_set():
        _parent_gone.set()
        os.kill(os.getpid(), signal.SIGTERM)


def backend_for(device: str) -> str:
    """nccl for CUDA devices, gloo for CPU."""
    backend = {"cuda": "nccl", "cpu": "gloo"}.get(torch.device(device).type)
    if backend is None:
        raise ValueError(f"distributed training supports cpu (gloo) and cuda (nccl) devices, got {device!r}")
    return backend


class FailureWatch:
    """Polls the store for another rank's failure message; on one, prints it and exits this process with 1."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval_s: float = 0.2) -> None:
        self.store, self.rank, self.world_size, self.interval_s = store, rank, world_size, interval_s
        self.failed_here = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="longstraw-failure-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            if _parent_gone.is_set():  # the store lived in the launcher: polling it would only log its absence
                return
            try:
                if not self.store.check([FAILURE_KEY]) or self.failed_here:
                    continue
                message = self.store.get(FAILURE_KEY).decode()
                self.store.add(ACK_KEY, 1)
            except Exception:  # the store went away (its host exited): nothing more to learn from it
                return
            print(f"longstraw: rank {self.rank} stops because {message}", file=sys.stderr, flush=True)
            os._exit(1)  # the main thread may be blocked in a collective that will never complete

    def report(self, message: str, wait_s: float = 10.0) -> None:
        """Publish this rank's failure (the first report wins) and give the others a moment to read it."""
        self.failed_here = True
        mine = f"rank {self.rank} failed: {message}"
        try:
            if self.store.compare_set(FAILURE_KEY, "", mine).decode() != mine:  # another rank's failure came first:
                self.store.add(ACK_KEY, 1)  # this rank has seen it (its watch, stopped by `failed_here`, will not say)
                return
            deadline = time.monotonic() + wait_s
            while self.store.add(ACK_KEY, 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:
            pass  # best effort: the store may already be gone

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Parallel:
    """rank / world_size / device of this process; `mesh` is None in a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    mesh: DeviceMesh | None = None
    watch: FailureWatch | None = field(default=None, repr=False)
    # Context parallelism (context.py): blocks of `cp_size` consecutive ranks share each prompt, blocks split the data.
    cp_size: int = 1
    context_shards: ContextParallel | None = field(default=None, repr=False)
    # Tensor parallelism (tp.py): groups of `tp_size` consecutive ranks hold one model split by heads; a block is cp
    # such groups (`block_size` ranks) and `mesh` is FSDP2's over the blocks' tensor-parallel peers (None: one group).
    tp_size: int = 1
    tp_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def start(cls, device: str = "cpu", timeout_s: float = 1800.0, cp: int = 1, tp: int = 1) -> Parallel:
        """Join the process group described by the environment; a plain `Parallel(device)` if WORLD_SIZE <= 1.
        cp: ranks per context-parallel block; tp: ranks per tensor-parallel group (cp * tp must divide the ranks)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        check_blocks(world_size, cp, tp)
        if world_size <= 1:
            return cls(device=device)
        end_with_launcher()
        backend = backend_for(device)
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if backend == "nccl":
            if local_rank >= (count := torch.cuda.device_count()):
                raise ValueError(f"local rank {local_rank} has no GPU: this node has {count} CUDA device(s); start "
                                 f"at most {count} processes per node (--nproc / torchrun --nproc-per-node)")
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
        store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
        if not _exit_hook.is_set():  # a rank that ends by an error, not `close`, leaves the group too
            _exit_hook.set()
            atexit.register(end_at_exit)
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        watch = FailureWatch(dist.PrefixStore("longstraw_watch", store), rank, world_size)
        if tp > 1:
            from longstraw.distributed.tp import tensor_parallel_layout

            tp_mesh, mesh, context_shards = tensor_parallel_layout(torch.device(device).type, tp, cp)
        else:
            tp_mesh, mesh = None, init_device_mesh(torch.device(device).type, (world_size,))
            context_shards = context_blocks(cp) if cp > 1 else None
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mesh=mesh, watch=watch,
                   cp_size=cp, context_shards=context_shards, tp_size=tp, tp_mesh=tp_mesh)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def block_size(self) -> int:
        """Consecutive ranks that share every prompt: a context-parallel block of tensor-parallel groups."""
        return self.cp_size * self.tp_size

    @property
    def dp_rank(self) -> int:
        """Index of this rank's block (= the rank without context or tensor parallelism)."""
        return self.rank // self.block_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.block_size

    # ------------------------------------------------------------------ model
    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 over all ranks (`fsdp.parallelize`); unchanged in one process. With tensor parallelism: split by
        heads over the tensor-parallel group first (`tp.tensor_parallel`), then FSDP2 over `mesh` if there is one."""
        if self.tp_mesh is not None:
            from longstraw.distributed.tp import tensor_parallel

            model = tensor_parallel(model, self.tp_mesh)
        return parallelize(model, self.mesh) if self.mesh is not None else model

    def compute(self, model: torch.nn.Module, reduce: bool = True) -> AbstractContextManager[None]:
        """Context for forwards/backwards: gathers once and reduces gradients once when sharded
        (`fsdp.sharded_compute`; reduce=False for blocks without backward)."""
        return sharded_compute(model, reduce)

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        if not self.distributed:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if self.tp_mesh is not None:
            from longstraw.distributed.tp import clip_grad_norm as clip_mixed

            return clip_mixed(params, max_norm)
        return clip_grad_norm(params, max_norm)

    # ------------------------------------------------------------------ data
    def share(self, count: int, what: str = "prompts_per_step") -> range:
        """This rank's contiguous slice of `count` items (block 0 takes the first count/D, D = data-parallel
        size = ranks / (cp * tp); the ranks of one block take the same slice); count must divide."""
        blocks = self.dp_size
        if count % blocks:
            raise ValueError(f"{what} = {count} cannot be split evenly over {blocks} data-parallel groups of "
                             f"processes: use a multiple of {blocks} (e.g. --{what.replace('_', '-')} "
                             f"{blocks * max(1, count // blocks)}) or a process count that divides {count}")
        per = count // blocks
        return range(self.dp_rank * per, (self.dp_rank + 1) * per)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def sum(self, value: float) -> float:
        return float(sum(self.gather(value))) if self.distributed else value

    # ------------------------------------------------------------------ checkpoints
    def full_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict] | None:
        """(model, optimizer) state dicts in the single-process format, on rank 0 (None elsewhere). Sharded: gathered
        with torch.distributed.checkpoint's full-state-dict helpers (a collective), the optimizer's parameter names
        mapped back to `optimizer.state_dict()`'s indices, so a checkpoint is one file for any process count."""
        if not self.distributed:
            return model.state_dict(), optimizer.state_dict()
        from torch.distributed.checkpoint import state_dict as dcp

        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = dcp.get_model_state_dict(model, options=options)
        optim_sd = dcp.get_optimizer_state_dict(model, optimizer, options=options)
        if not self.is_main:
            return None
        return _with_tied_keys(model, model_sd), _names_to_indices(model, optim_sd)

    def load_full_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                        model_sd: dict | None, optim_sd: dict | None) -> None:
        """Inverse of `full_state`: rank 0 passes the dicts, the others None (they receive them by broadcast).
        optimizer None (on every rank): load the weights only, the optimizer keeps its fresh state."""
        if not self.distributed:
            model.load_state_dict(_given(model_sd))
            if optimizer is not None:
                optimizer.load_state_dict(_given(optim_sd))
            return
        from torch.distributed.checkpoint import state_dict as dcp

        options = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        names = _param_names(model)
        dcp.set_model_state_dict(model, _given(model_sd) if self.is_main else {}, options=options)
        if optimizer is None:
            return
        by_name = _rekeyed(_given(optim_sd), names) if self.is_main else {}
        dcp.set_optimizer_state_dict(model, optimizer, by_name, options=options)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if not self.distributed:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------------ lifecycle
    def fail(self, error: BaseException) -> None:
        """Tell every other rank that this one failed (they print `error` and exit 1), then stop watching for theirs.
        The process group itself is destroyed at this process's exit (`end_at_exit`)."""
        if self.watch is not None:
            self.watch.report(f"{type(error).__name__}: {error}")
            self.watch.stop()

    def close(self) -> None:
        """Leave the process group after a successful run (all ranks)."""
        if not self.distributed:
            return
        dist.barrier()
        if self.watch is not None:
            self.watch.stop()
        end_process_group()


def end_process_group() -> None:
    """Destroy the default process group, if any; call it once the trainer is out of scope. gloo's worker threads must
    be joined before interpreter exit (else: "terminate called without an active exception"), and a DDP model's reducer
    freed after the group joins them while holding the GIL that a thread still releasing a tensor needs (a deadlock).
    So: collect the trainer first, then destroy the group (through DeepSpeed where it runs: `_end_deepspeed`)."""
    gc.collect()
    if not dist.is_initialized():
        return
    if not _end_deepspeed():
        dist.destroy_process_group()


def _end_deepspeed() -> bool:
    """Under DeepSpeed, end the process group with its gloo threads joined now, not in the interpreter's teardown
    (False where DeepSpeed's communication is not in use). A finished engine stays alive after its trainer is collected,
    ZeRO-3 keeps its top module in `parameter_offload.FWD_MODULE_STACK` (read only inside a forward) and DeepSpeed its
    world group in a module global, and their parameters and modules hold the groups: destroy every engine (removes its
    hooks), empty the stack, end the groups through DeepSpeed (drops its own references) and collect."""
    comm, engine = (sys.modules.get(f"deepspeed.{name}") for name in ("comm", "runtime.engine"))
    if comm is None or engine is None or not comm.is_initialized():
        return False
    for obj in gc.get_objects():
        if isinstance(obj, engine.DeepSpeedEngine):
            obj.destroy()
    getattr(sys.modules.get("deepspeed.runtime.zero.parameter_offload"), "FWD_MODULE_STACK", []).clear()
    comm.destroy_process_group()
    gc.collect()
    return True


_exit_hook = threading.Event()  # set once `end_at_exit` is registered
EXIT_TEARDOWN_S = 10.0  # how long the exit waits for the process group's end before leaving without it


def end_at_exit() -> None:
    """`end_process_group` at interpreter exit if `close` did not, so that a rank that refused or failed does not
    abort (SIGABRT) while C++ tears gloo's threads down; in a daemon thread, waited for `EXIT_TEARDOWN_S` at most,
    so that a peer that never answers cannot hold the exit."""
    if not dist.is_initialized():
        return
    ender = threading.Thread(target=end_process_group, name="longstraw-end-group", daemon=True)
    ender.start()
    ender.join(EXIT_TEARDOWN_S)


def _param_names(model: torch.nn.Module) -> list[str]:
    """The trainable parameters' names in `model.parameters()` order (= the optimizer's indices)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _with_tied_keys(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Add the keys `model.state_dict()` has for tied weights (e.g. lm_head.weight) if the helper left them out."""
    out = dict(state)
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name not in out:
            twin = next(n for n, p in model.named_parameters() if p is model.get_parameter(name))
            out[name] = out[twin]
    return out


def _names_to_indices(model: torch.nn.Module, optim_sd: dict) -> dict:
    index = {name: i for i, name in enumerate(_param_names(model))}
    alias = {name: index[n] for n, p in model.named_parameters() if n in index
             for name, q in model.named_parameters(remove_duplicate=False) if q is p}
    return _rekeyed(optim_sd, alias)


def _rekeyed(optim_sd: dict, key: Any) -> dict:
    """`optim_sd` with its parameters' keys mapped through `key` (names to indices, or back)."""
    return {"state": {key[k]: value for k, value in optim_sd["state"].items()},
            "param_groups": [dict(g, params=[key[k] for k in g["params"]]) for g in optim_sd["param_groups"]]}


def _given(state_dict: dict | None) -> dict:
    """A state dict `load_full_state` needs here: rank 0 (the only process, when not distributed) passes them."""
    if state_dict is None:
        raise ValueError("load_full_state: rank 0 must pass the state dicts it loads")
    return state_dict

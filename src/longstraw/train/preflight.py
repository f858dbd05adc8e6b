"""What `longstraw train --nproc N` checks once, in the launcher, before any rank starts.

Each rank checks its model and task again (`Trainer`), but a refusal found there is printed once per rank, after every
rank has loaded the model and after rank 0 has created the run directory. Here the same checks run first, without
reading any weights: `distributed_rules` (the options that run in one process only) and `check_before_ranks` (the
model built on the meta device from its config, admitted and, with --tp, checked for tensor parallelism; the task
built with its tokenizer and a prompt checked against the model's positions)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from longstraw.train.sections import need

if TYPE_CHECKING:
    import torch

    from longstraw.train.config import TrainConfig


def distributed_rules(cfg: TrainConfig, world_size: int) -> None:
    """Refuse the options that run in one process only, when `world_size` processes would run."""
    if world_size <= 1:
        return
    need(not cfg.run.bias_every, "--bias-every runs in one process only (sharded gradients): drop it or --nproc")
    need(not cfg.optimizer.warm_start_steps, "--warm-start-steps runs in one process only: drop it or --nproc")


def model_config(name: str) -> Any:
    """The transformers config `load_model(name)` builds its model from, read without any weights; None for a hub id not
    in the local cache (not fetched here). ValueError for a name that is no model or a config that fails to load."""
    from transformers import AutoConfig

    from longstraw.admission.loading import check_model_name
    from longstraw.models.gguf_files import converted_gguf, resolve_model_path
    from longstraw.models.presets import PRESETS

    source = check_model_name(name)
    if source == "preset":
        return PRESETS[name]()
    path: Any = converted_gguf(resolve_model_path(name)) if source in ("packaged", "gguf") else name
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=source == "hub")
    except OSError as err:
        if source == "hub":
            return None  # not cached: each rank loads it (and its checks run there)
        raise ValueError(f"--model {name}: its config does not load ({str(err).splitlines()[0]})") from None


def meta_model(config: Any) -> torch.nn.Module:
    """The causal LM of `config` on the meta device: its modules and parameter shapes, no storage."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_before_ranks(cfg: TrainConfig, world_size: int) -> None:
    """The model and task checks of every rank, run once: the config read (`model_config`), the model built from it on
    the meta device, then `admission.admit`, with --tp `tp.check_tensor_parallel`, and `TaskData` (the task, a prompt
    against the model's positions). ValueError or FileNotFoundError saying what to change. Loads config and tokenizer,
    never weights; creates no run directory; fetches no uncached hub id (the ranks load and check it)."""
    from longstraw.admission.admission import admit
    from longstraw.models.tokenizer import load_tokenizer
    from longstraw.train.data import TaskData

    config = model_config(cfg.model.model)
    if config is None:
        return
    model = meta_model(config)
    admit(model)
    if cfg.parallelism.tp > 1:
        from longstraw.distributed.tp import check_tensor_parallel

        check_tensor_parallel(model, cfg.parallelism.tp)
    TaskData(cfg, load_tokenizer(cfg.model.model), getattr(model.config, "max_position_embeddings", None))

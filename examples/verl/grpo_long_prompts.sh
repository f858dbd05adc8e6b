#!/usr/bin/env bash
# GRPO with verl on long shared prompts, LongStraw's backward in the actor update: the one line that turns it on is
# `actor_rollout_ref.model.external_lib=longstraw.integrations.verl` (docs/verl.md). Everything else is a plain verl
# GRPO config for one node of 8 GPUs: FSDP2, vLLM rollout, 8 responses per prompt, the k3 KL loss, no entropy term.
#
#   pip install 'longstraw[verl]' vllm     # beside verl's own pin
#   TRAIN=~/data/longdoc/train.parquet TEST=~/data/longdoc/test.parquet bash examples/verl/grpo_long_prompts.sh
#
# verl needs GPUs: this script is not run by the tests (tests/integrations/test_verl.py checks that every key below
# is one verl's config accepts, and runs verl's actor update with and without LongStraw on CPU).
set -euo pipefail

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="${TRAIN:?set TRAIN to a parquet file of prompts}" \
    data.val_files="${TEST:?set TEST to a parquet file of prompts}" \
    data.train_batch_size=32 \
    data.max_prompt_length=131072 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    actor_rollout_ref.model.path="${MODEL:-Qwen/Qwen3-8B}" \
    actor_rollout_ref.model.external_lib=longstraw.integrations.verl \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1 \
    +ray_kwargs.ray_init.runtime_env.env_vars.LONGSTRAW_PLAN="${LONGSTRAW_PLAN:-exact}" \
    +ray_kwargs.ray_init.runtime_env.env_vars.LONGSTRAW_CHUNK_SIZE=4096 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 \
    trainer.logger='["console"]' \
    "$@"

"""LongStraw's benchmarks, a package beside the library: `python -m benchmarks NAME [options]` (`__main__`, the driver;
`registry`, the `Benchmark` values each module declares).

`memory` runs Bench B1 (docs/design.md §5): peak memory and step time of every plan across group sizes; `sweeps` the
prompt-length sweep and the per-architecture B1, and the command line of those and of `pareto`, the
micro-batch/chunk Pareto sweep (`bench prompt|pareto|arch`); `cp` the context-parallel prompt state; `peers`
LongStraw against TRL's GRPO step and Prefix Grouper (`peers_worker` runs one peer configuration); `trl_scale` TRL's
GRPOTrainer and the drop-in on 2 processes with DDP, FSDP2 and context parallelism (`trl_scale_worker` is one rank).
Each configuration runs in a fresh `worker` subprocess (`cp_worker` for a rank of `cp`), started through `launch`;
`common` holds what they share (the job, running it in a worker, the result file, the planner's forecast, model
loading); `accelerate_cpu` and `verl_cpu` run accelerate's and verl's paths on CPU processes (the tests use them too);
`trl_own_tests` runs TRL's own GRPO tests with the drop-in. `machine` describes the
host every result file records; `plots` draws the PNGs; `stress` finds the longest prompt one step fits in; `gpu` is
what `bench/gpu.sh` runs on one GPU.
"""

"""Benchmarks behind `longstraw bench ...`.

`memory` runs Bench B1 (DESIGN §5): peak memory and step time of every plan across group sizes; `sweeps` the
prompt-length sweep, the micro-batch/chunk Pareto sweep and the per-architecture B1 (`bench prompt|pareto|arch`);
each configuration runs in a fresh `worker` subprocess. `machine` describes the host every result file
records; `plots` draws the PNGs; `stress` finds the longest prompt one step fits in; `gpu` is what
`bench/gpu.sh` runs on one GPU.
"""

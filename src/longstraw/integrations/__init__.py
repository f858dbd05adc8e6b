"""Integrations with other training libraries, each an optional extra imported only when its module is:
`longstraw.integrations.trl` (`pip install longstraw[trl]`) is TRL's GRPOTrainer with LongStraw's backward;
`longstraw.integrations.accelerate_cpu` enables accelerate's FSDP path on CPU processes (the tests and
`python -m benchmarks trl-scale` run FSDP2 over gloo with it).

Nothing here is imported by `import longstraw`.
"""

"""Integrations with other training libraries, each an optional extra imported only when its module is (nothing here
is imported by `import longstraw`): `trl` is TRL's GRPOTrainer with LongStraw's backward (`pip install longstraw[trl]`,
DeepSpeed ZeRO through `deepspeed`), `verl` is verl's actor update with it. The shims that run accelerate's and verl's
paths on CPU processes for the tests and benchmarks live in `benchmarks` (`accelerate_cpu`, `verl_cpu`)."""

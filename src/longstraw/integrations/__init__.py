"""Integrations with other training libraries, each an optional extra imported only when its module is:
`longstraw.integrations.trl` (`pip install longstraw[trl]`) is TRL's GRPOTrainer with LongStraw's backward. The
shims that run accelerate's and verl's paths on CPU processes for the tests and benchmarks live in the `benchmarks`
package (`benchmarks.accelerate_cpu`, `benchmarks.verl_cpu`).

Nothing here is imported by `import longstraw`.
"""

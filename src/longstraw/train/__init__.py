"""The trainer around the engine: rollout and scoring (`sampler.py`), data and config, the optimizer, reporting, run
checkpoints and run directory, stopping, the detach bias meter and `compare`."""

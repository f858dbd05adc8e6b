"""Integrations with other training libraries, each an optional extra imported only when its module is:
`longstraw.integrations.trl` (`pip install longstraw[trl]`) is TRL's GRPOTrainer with LongStraw's backward.

Nothing here is imported by `import longstraw`.
"""

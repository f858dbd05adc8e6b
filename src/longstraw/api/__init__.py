"""The public entry points, above the engine: the argument and architecture checks, then the engine's run.
`group.py`: `backward_group`, `router_counts`, `GroupResult`, `RouterBatch`; `tree.py`: `backward_tree`,
`TreeResult`."""

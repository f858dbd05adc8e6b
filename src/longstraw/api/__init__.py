"""The public entry points, above the engine: the argument and architecture checks, then the engine's run. `group.py`:
`backward_group`, `GroupResult`; `checks.py`: what both check; `tree.py`: `backward_tree`, `TreeResult`."""

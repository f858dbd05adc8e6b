"""The engine: one GRPO group's gradient (`api.backward_group`), its plans, the prompt state and the attention
kernels. It imports nothing from train/, bench/, distributed/ or integrations/ (tests/test_structure.py)."""

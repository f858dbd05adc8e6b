"""The engine: the plans that run one GRPO group's or one prefix tree's gradient, the prompt state and the attention
kernels; the public entry points that check and call it are in `longstraw.api`. It imports nothing from api/, train/,
bench/, distributed/ or integrations/ (tests/test_structure.py)."""

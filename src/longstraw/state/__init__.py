"""Architecture-aware prompt state: what later tokens need from the prompt, captured once.

`attention.py` holds the full-attention K/V state (and the sampler's per-sequence buffer); `capture.py` the
chunked no-grad prefill that fills it.
"""

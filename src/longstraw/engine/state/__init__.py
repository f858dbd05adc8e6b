"""Architecture-aware prompt state: what later tokens need from the prompt, captured once.

`prompt.py` holds the state of every layer kind (K/V, MLA latents, DSA indexer keys, conv and recurrent states) (the
cache object through which transformers' layers read it is `engine.hf.cache`); `response.py` the sampler's per-sequence
state of generated tokens; `capture.py` the chunked no-grad prefill. The expected size of the state per layer kind
(docs/design.md §4) is `planner.state_bytes`, which the tests check against `PromptState.nbytes()` for every family."""

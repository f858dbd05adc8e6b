"""Models: loading (presets, packaged and hub weights, GGUF), the tokenizer, architecture checks before any state."""

"""Models: loading (presets, packaged and hub weights, GGUF), the tokenizer, and the architecture checks the engine
runs before it builds any state."""

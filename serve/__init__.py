"""The runtime: model code, KV cache, speculative decoding, sampling, engine."""

"""AWQ quantization of the draft (llm-compressor); the target is never quantized."""

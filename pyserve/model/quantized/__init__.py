"""Checkpoints quantized by other tools (AWQ, GPTQ, FP8, compressed-tensors),
detected from config.json's `quantization_config` (scheme.py) and read,
one linear layer at a time, into a common form (weights.py): integer
codes with group scales and zero points, or FP8 values with their scales.
The loader gives each layer's dense weight to the model and, where the
CPU's 4-bit mode can hold the codes exactly, the codes themselves."""

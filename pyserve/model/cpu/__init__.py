"""The CPU block-kernel path: Q4_1/Q8_0 layers, native layers, extend attention (rust/kernels)."""

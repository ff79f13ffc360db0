"""Attention backends: one interface (base.AttentionBackend), two
implementations checked against each other: torch_backend.TorchAttention
(CPU, and the reference) and triton_backend.TritonAttention (CUDA)."""

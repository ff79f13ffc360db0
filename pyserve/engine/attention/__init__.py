"""Attention backends: one interface (base.AttentionBackend), several
implementations checked against each other (torch_backend.TorchAttention;
a Triton backend later)."""

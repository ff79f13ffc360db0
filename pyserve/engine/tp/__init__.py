"""Tensor parallelism's processes: the group, the per-step broadcast, the workers."""

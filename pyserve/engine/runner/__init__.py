"""The model runner: the forward thread, each rank's model and KV cache, CUDA graphs."""

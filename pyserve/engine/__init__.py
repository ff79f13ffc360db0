"""The engine: scheduling, KV cache, model runner, sampling."""

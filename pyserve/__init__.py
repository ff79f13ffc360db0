"""pyserve: an OpenAI-compatible LLM inference server."""

__version__ = "0.1.0"

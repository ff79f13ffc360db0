"""pyserve: an OpenAI-compatible LLM inference server."""

__version__ = "0.1.0"

from pyserve.asgi import create_app  # noqa: E402  (light: torch loads when the app starts)

__all__ = ["create_app", "__version__"]

"""pyserve: an OpenAI-compatible LLM inference server.

`from pyserve import create_app` gives the ASGI app factory (pyserve.asgi).
It is looked up on first use, so importing any module of the package does
not import the whole server above it.
"""

__version__ = "0.1.0"
__all__ = ["create_app", "__version__"]


def __getattr__(name: str):
    if name == "create_app":
        from pyserve.asgi import create_app

        return create_app
    raise AttributeError(f"module 'pyserve' has no attribute {name!r}")

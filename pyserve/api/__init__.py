"""The HTTP layer: ASGI app, OpenAI and native routes."""

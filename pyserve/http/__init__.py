"""ASGI plumbing: request and response I/O, SSE, proxies and CORS, the drain, error bodies."""

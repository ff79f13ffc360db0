"""Anthropic's Messages API: routes, the request read onto the chat route, the Message
and its stream events, the error shape."""

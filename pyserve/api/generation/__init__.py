"""What the generation routes share: request context, sampling fields, constraints, logprobs, tools."""

"""OpenAI's chat, completions and embeddings routes and their bodies."""

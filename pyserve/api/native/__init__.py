"""SGLang's and vLLM's native routes: /generate, operations, tokenize, score."""

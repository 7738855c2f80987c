"""The OpenAI-compatible server: `llmpipe serve`."""

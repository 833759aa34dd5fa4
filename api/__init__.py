"""The OpenAI-compatible HTTP API (Quart). The engine knows nothing about it."""

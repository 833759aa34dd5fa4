"""The engine's settings: `EngineConfig` (every setting declared once with `fields.setting`, which
makes run_server.py's flags, the `LLM` keyword arguments and docs/cli.md), what is read from a
checkpoint's files (generation defaults, dtype), speculative decoding's configuration and vLLM's
options that jaxserve takes without a setting of its own. Knows no engine part."""

"""The engine: the step loop (`core.Engine`: schedule, run, update), the engine thread and its
per-request queues (`async_engine.AsyncEngine`), host work around a step (grammar masks,
detokenizing, stop strings), tokenizer and chat templates, prompts in and outputs out, and beam
search on top. Knows nothing about HTTP."""

"""Sampling: `SamplingParams` (vLLM's), the per-row tensors of a batch, the one jitted sampler,
logits processors and llama.cpp's samplers built on them."""

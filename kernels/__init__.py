"""Device kernels, each with a jnp reference that defines its semantics."""

from kernels.paged_attention import paged_attention, write_kv

__all__ = ["paged_attention", "write_kv"]

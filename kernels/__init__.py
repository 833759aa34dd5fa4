"""Device kernels, each with a jnp reference that defines its semantics."""

from kernels.paged_attention import cache_dtype, implementation, paged_attention, write_kv

__all__ = ["cache_dtype", "implementation", "paged_attention", "write_kv"]

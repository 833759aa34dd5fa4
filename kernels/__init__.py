"""Device kernels, each with a jnp reference that defines its semantics."""

from kernels.matmul import matmul_t, matmul_t_many
from kernels.matmul.grouped import grouped_matmul_t
from kernels.paged_attention import AXIS, cache_dtype, implementation, paged_attention, write_kv

__all__ = ["AXIS", "cache_dtype", "grouped_matmul_t", "implementation", "matmul_t", "matmul_t_many", "paged_attention",
           "write_kv"]

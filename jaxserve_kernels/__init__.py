"""Device kernels, each with a jnp reference that defines its semantics."""

from jaxserve_kernels.matmul import live_rows, matmul_t, matmul_t_many
from jaxserve_kernels.matmul.grouped import grouped_matmul_t
from jaxserve_kernels.paged_attention import AXIS, cache_dtype, implementation, paged_attention, write_kv

__all__ = ["AXIS", "cache_dtype", "grouped_matmul_t", "implementation", "live_rows", "matmul_t", "matmul_t_many",
           "paged_attention", "write_kv"]

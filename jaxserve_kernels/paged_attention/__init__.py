"""Ragged paged attention: one call for a batch of prefill chunks and decodes.

`paged_attention` dispatches by backend: TPU -> the Pallas Mosaic kernel (`tpu.py`), GPU -> the
Pallas Triton kernel (`gpu.py`), CPU -> a C++ custom call (`cpu.py`, built on first use; where
no compiler builds it, the query-tiled XLA implementation, `xla.py`). The jnp reference
(`reference.py`) defines the semantics every implementation matches.

`impl=` (tests) or the environment variable JAXSERVE_ATTENTION picks one by name:
"reference", "xla", "cpu", "tpu", "gpu", or "tpu-interpret" / "gpu-interpret" (a Pallas kernel run
by Pallas' interpreter, on any backend: how the kernels are tested on CPU).

Under tensor parallelism the step is traced inside its mesh (`jax.set_mesh`); a Pallas kernel or
the CPU kernel is a custom call XLA cannot split, so it runs per device under `shard_map`: each device attends
with its own query heads and KV heads when the KV heads divide over the mesh, and all of them
otherwise (the cache is then replicated anyway).
"""

from __future__ import annotations

import functools
import logging
import os

import jax
from jax.sharding import PartitionSpec as P

from jaxserve_kernels.paged_attention import cpu
from jaxserve_kernels.paged_attention.gpu import paged_attention_gpu, unsupported_on_gpu
from jaxserve_kernels.paged_attention.reference import cache_dtype, paged_attention_reference, write_kv
from jaxserve_kernels.paged_attention.tpu import paged_attention_tpu
from jaxserve_kernels.paged_attention.xla import paged_attention_tiled

IMPLEMENTATIONS = {"reference": paged_attention_reference, "xla": paged_attention_tiled,
                   "cpu": cpu.paged_attention_cpu, "tpu": paged_attention_tpu, "gpu": paged_attention_gpu}
PALLAS = ("tpu", "gpu")  # (these also run in Pallas' interpreter)
CUSTOM_CALLS = (*PALLAS, "cpu")  # run per device under shard_map
BY_BACKEND = {"tpu": "tpu", "gpu": "gpu", "cpu": "cpu"}  # jax.default_backend() -> implementation
ENV = "JAXSERVE_ATTENTION"
AXIS = "model"  # the mesh axis heads (and every split weight) are split over: the one model axis

log = logging.getLogger(__name__)


def implementation(impl: str | None = None) -> str:
    """The implementation `paged_attention` runs: `impl`, else $JAXSERVE_ATTENTION, else the
    backend's. Resolving "cpu" builds and registers its custom call (`cpu.load`), which must
    happen before a compiled step that calls it is loaded from disk; where it cannot be built,
    the backend's default falls back to "xla" and an explicit "cpu" is an error."""
    chosen = impl or os.environ.get(ENV)
    name = chosen or BY_BACKEND.get(jax.default_backend(), "xla")
    base, _, mode = name.partition("-")
    if base not in IMPLEMENTATIONS or mode not in ("", "interpret") or (mode and base not in PALLAS):
        raise ValueError(f"unknown attention implementation {name!r} (from {'impl' if impl else ENV}); "
                         f"choose from {sorted(IMPLEMENTATIONS)} or tpu-interpret / gpu-interpret")
    if base == "cpu" and jax.default_backend() != "cpu":
        raise ValueError(f"the 'cpu' attention kernel runs on the CPU backend only, not {jax.default_backend()!r}")
    if base == "cpu" and not cpu.load():
        if chosen:
            raise ValueError("the 'cpu' attention kernel could not be built (see the log); choose 'xla'")
        return "xla"
    return name


def paged_attention(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                    impl: str | None = None, row_by_row: bool = False):
    """See `reference.paged_attention_reference` for shapes and semantics. `row_by_row`: every query
    row's numbers as when it is alone in its step (batch-invariant mode), where a kernel's form
    changes with the rows of a sequence (the CPU kernel's blocks of rows)."""
    base, _, mode = implementation(impl).partition("-")
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if base == "cpu":
        options["row_by_row"] = row_by_row
    if base == "gpu" and (reason := unsupported_on_gpu(q.shape[-1], k_pages.shape[1])):
        log.warning("paged attention: %s; using the XLA implementation", reason)
        base = "xla"
    if base not in CUSTOM_CALLS:
        return IMPLEMENTATIONS[base](q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, **options)
    kernel = functools.partial(IMPLEMENTATIONS[base], **options, **({"interpret": True} if mode else {}))
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else mesh.shape.get(AXIS, 1)
    if shards == 1:
        return kernel(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs)
    split = k_pages.shape[2] % shards == 0 and q.shape[1] % shards == 0
    heads, kv_heads = (P(None, AXIS, None), P(None, None, AXIS, None)) if split else (P(), P())
    return jax.shard_map(kernel, mesh=mesh, in_specs=(heads, kv_heads, kv_heads, P(), P(), P(), P()),
                         out_specs=heads, check_vma=False)(
        q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs)


__all__ = ["IMPLEMENTATIONS", "cache_dtype", "implementation", "paged_attention", "paged_attention_reference",
           "write_kv"]

"""A step's LoRA rows and their adapters' products: each token row names an adapter slot, and every
adapted layer adds its slots' low-rank products for all rows at once (`lora_delta`), in grouped
products over the rows sorted by slot or masked. The adapters' stacks are step arguments, not
parameters (`jaxserve.worker.lora`): attached to the layers for one trace (`layers.Linear.lora`)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve_kernels import grouped_matmul_t, matmul_t


@flax.struct.dataclass
class LoraRows:
    """Which adapter slot each token row of a step runs with (S = slots, `--max-loras`), and the same
    as the grouped products take it: the rows sorted by slot, those with no adapter after every
    slot's (no product)."""

    slots: jax.Array  # i32[T] each row's slot; -1: no adapter
    order: jax.Array  # i32[T] the rows sorted by slot
    inverse: jax.Array  # i32[T] the place of each row in `order`
    sizes: jax.Array  # i32[S] rows per slot

    @staticmethod
    def of(slots: np.ndarray, num_slots: int) -> dict:
        """The fields (host arrays) for i32[T] slots of the rows."""
        key = np.where(slots < 0, num_slots, slots)
        order = np.argsort(key, kind="stable").astype(np.int32)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order), dtype=np.int32)
        sizes = np.bincount(key, minlength=num_slots + 1)[:num_slots].astype(np.int32)
        return dict(slots=np.asarray(slots, np.int32), order=order, inverse=inverse, sizes=sizes)


MASKED_MIN_ROWS = 4  # on CPU, LoRA products of steps of this many rows or more are "masked" (`lora_delta`)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, rows: LoraRows, form: str | None = None,
               skip_idle: bool | None = None) -> jax.Array:
    """Each row's adapter's product (x A^T) B^T: x [T, in]; a [S, r, in] and b [S, out, r] the
    slots' stacks (the scale in b) -> [T, out], zeros for rows with no adapter. One pass for all
    slots: "grouped", two grouped products over the rows sorted by slot (`jaxserve_kernels.grouped_matmul_t`:
    `ragged_dot` on TPU and GPU), or "masked", every row through every slot's A at once, masked to
    its own slot's ranks, then through B. `skip_idle`: a step with no adapted row skips them (a
    conditional). The defaults are what measured fastest (bench/RESULTS.md, "LoRA adapters"): on CPU
    masked from MASKED_MIN_ROWS rows and skipping; on GPU masked, not skipping (there a conditional
    costs more than the products); on TPU (not measured) grouped and skipping."""
    sizes = jnp.asarray(rows.sizes)

    def grouped(x):
        sorted_rows = x[rows.order]
        return grouped_matmul_t(grouped_matmul_t(sorted_rows, a, sizes), b, sizes)[rows.inverse]

    def masked(x):
        slots, rank = a.shape[0], a.shape[1]
        h = matmul_t(x, a.reshape(slots * rank, a.shape[2]))  # [T, S * r]
        h = jnp.where(jnp.asarray(rows.slots)[:, None] == jnp.arange(slots * rank) // rank, h, 0)
        return jnp.einsum("tsr,sor->to", h.reshape(-1, slots, rank), b,
                          preferred_element_type=jnp.float32).astype(x.dtype)

    backend = jax.default_backend()
    form = form or ("masked" if backend == "gpu" or (backend == "cpu" and x.shape[0] >= MASKED_MIN_ROWS)
                    else "grouped")
    delta = {"grouped": grouped, "masked": masked}[form]
    if not (backend != "gpu" if skip_idle is None else skip_idle):
        return delta(x)
    return jax.lax.cond(sizes.sum() > 0, delta, lambda x: jnp.zeros((x.shape[0], b.shape[1]), x.dtype), x)

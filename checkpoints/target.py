"""What a checkpoint's weights are loaded into, as the model describes it: checkpoints knows no model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.sharding import Sharding


@dataclasses.dataclass(frozen=True)
class ParamTarget:
    """The parameters a model expects, by path ("layers.0.mlp.up_proj.weight"), and where they go."""

    architecture: str  # named in errors
    shapes: Mapping[str, tuple[int, ...]]  # parameter path -> shape; every one must be loaded
    hf_name_map: Mapping[str, str]  # HF tensor name pattern -> parameter path (`re.sub` template)
    unused: frozenset[str] = frozenset()  # paths a checkpoint may hold that the model leaves out (a tied head)
    sharding: Callable[[str], Sharding] | None = None  # parameter path -> its sharding; None: the default device
    # a host array onto its sharding (the caller's, e.g. one that fills each process's devices itself)
    place: Callable[[np.ndarray, Sharding], jax.Array] = jax.device_put

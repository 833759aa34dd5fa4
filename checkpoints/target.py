"""What a checkpoint's weights are loaded into, as the model describes it: checkpoints knows no model."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from kernels.matmul.quant import QuantizedWeight, quantize


def quantized_paths(path: str) -> tuple[str, str, str]:
    """The paths of a quantized weight's data, scales and mins: "a.weight" -> a.weight, a.scales, a.mins."""
    prefix = path.rpartition(".")[0]
    return path, f"{prefix}.scales", f"{prefix}.mins"


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
    # weight path -> the quantized format it is kept in (kernels.matmul.quant); its scales and mins
    # are parameters of their own (`quantized_paths`)
    formats: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def _part_dtypes(self) -> dict[str, np.dtype]:
        """The dtype of each quantized part, by path."""
        out = {}
        for weight, fmt in self.formats.items():
            data, scales, mins = quantized_paths(weight)
            out.update({data: np.dtype(np.int8 if fmt == "int8" else np.uint8), scales: np.dtype(np.float16),
                        mins: np.dtype(np.float16)})
        return out

    def dtype_of(self, path: str, dtype: str) -> np.dtype:
        """The dtype the parameter at `path` is stored in: `dtype`, or a quantized part's own."""
        return self._part_dtypes.get(path, np.dtype(jnp.dtype(dtype)))

    def put(self, loaded: dict, path: str, value: np.ndarray | QuantizedWeight, dtype: str, source: str) -> None:
        """Check `value` (a float array or quantized blocks, for the parameter at `path`) against the
        shapes expected, bring it to the format the target keeps it in (quantizing a float weight,
        casting to `dtype`), and place each part into `loaded`. `source` names it in errors."""
        if path not in self.shapes:
            raise ValueError(f"tensor {source} does not fit this {self.architecture} config")
        fmt = self.formats.get(path)
        if fmt is not None and not isinstance(value, QuantizedWeight):
            self._check_shape(path, value.shape, source, logical=True)
            value = quantize(value, fmt)
        elif fmt is None and isinstance(value, QuantizedWeight):
            raise ValueError(f"{source}: quantized blocks for {path}, which is kept in floats")
        parts = zip(quantized_paths(path), value) if fmt is not None else [(path, value)]
        for part, array in parts:
            if array is None:
                continue
            self._check_shape(part, array.shape, source)
            array = np.ascontiguousarray(array).astype(self.dtype_of(part, dtype), copy=False)
            loaded[part] = (self.place(array, self.sharding(part)) if self.sharding is not None
                            else jax.numpy.asarray(array))

    def _check_shape(self, path: str, shape: tuple, source: str, logical: bool = False) -> None:
        want = tuple(self.shapes[path]) if not logical else self.logical_shape(path)
        if tuple(shape) != want:
            raise ValueError(f"tensor {source} has shape {tuple(shape)}, expected {want} from config.json")

    def logical_shape(self, path: str) -> tuple[int, ...]:
        """The float shape of the weight at `path` ([out, in] where it is kept as int4 pairs)."""
        shape = tuple(self.shapes[path])
        return (shape[0], 2 * shape[1]) if self.formats.get(path) == "int4" else shape

    def check_complete(self, loaded: Mapping[str, object], source: object) -> None:
        missing = sorted(set(self.shapes) - set(loaded))
        if missing:
            raise ValueError(f"checkpoint {source} lacks {len(missing)} tensors, e.g. {missing[:3]} (decoder paths)")

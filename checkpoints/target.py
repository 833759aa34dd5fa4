"""What a checkpoint's weights are loaded into, as the model describes it: checkpoints knows no model.

A name map's target is a parameter path, or one of two forms for tensors that do not map one to one:
- "a|b|c": a fused tensor (Phi-3's qkv_proj) whose rows are split among the parameters named, in
  the order and the sizes of their first dimensions;
- "a[3]": one slice (along the first dimension) of a stacked parameter (expert 3 of a
  Mixture-of-Experts layer's [experts, out, in] matrix). The slices gather on the host; the
  parameter is placed once all of them are in.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from jaxserve_kernels.matmul.quant import QuantizedWeight, group_rows, quantize

SLICE = re.compile(r"(.+)\[(\d+)\]")


def param_paths(target: str) -> list[str]:
    """The parameters a name map's target (see the module's doc) loads into."""
    return [SLICE.fullmatch(p)[1] if SLICE.fullmatch(p) else p for p in target.split("|")]


@dataclasses.dataclass
class _Stack:
    """A stacked parameter's part (data, scales or mins) while its slices arrive."""

    array: np.ndarray
    filled: set[int] = dataclasses.field(default_factory=set)


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
    skipped: str | None = None  # a pattern of HF tensor names read past, never loaded (a vision tower)
    sharding: Callable[[str], Sharding] | None = None  # parameter path -> its sharding; None: the default device
    # a host array onto its sharding (the caller's, e.g. one that fills each process's devices itself)
    place: Callable[[np.ndarray, Sharding], jax.Array] = jax.device_put
    # weight path -> the quantized format it is kept in (jaxserve_kernels.matmul.quant); its scales and mins
    # are parameters of their own (`quantized_paths`)
    formats: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # paths kept as their bfloat16 values' raw bits (uint16): see `jaxserve_kernels.matmul.grouped.kept_as_bits`
    as_bits: frozenset[str] = frozenset()
    # quantized matrices (weight paths) kept grouped (`jaxserve_kernels.matmul.quant.group_rows`): loaded in
    # rows (`shapes`), then each one array (`group`)
    grouped: frozenset[str] = frozenset()

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

    def _stored(self, path: str, array: np.ndarray, dtype: str) -> np.ndarray:
        """`array` in the form the parameter at `path` is stored in."""
        array = np.ascontiguousarray(array).astype(self.dtype_of(path, dtype), copy=False)
        return array.view(np.uint16) if path in self.as_bits else array

    def group(self, loaded: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """`loaded` (parameters by path, in rows: `shapes`) with each matrix of `grouped` grouped,
        its parts one array at its weight's path (`GroupedRows`), as the model keeps it (a copy)."""
        loaded = dict(loaded)
        for path in self.grouped:
            parts = quantized_paths(path)
            loaded[path] = group_rows(QuantizedWeight(*(loaded.pop(p, None) for p in parts)), jnp).data
        return loaded

    def fits(self, target: str) -> bool:
        """Whether every parameter a name map's target names is one of the model's."""
        return all(p in self.shapes for p in param_paths(target))

    def put(self, loaded: dict, path: str, value: np.ndarray | QuantizedWeight, dtype: str, source: str) -> None:
        """Check `value` (a float array or quantized blocks, for the parameter at `path`, a name
        map's target) against the shapes expected, bring it to the format the target keeps it in
        (quantizing a float weight, casting to `dtype`), and place each part into `loaded`.
        `source` names it in errors."""
        if not self.fits(path):
            raise ValueError(f"tensor {source} does not fit this {self.architecture} config")
        if "|" in path:
            self._put_split(loaded, path.split("|"), value, dtype, source)
            return
        if slice_of := SLICE.fullmatch(path):
            self._put_slice(loaded, slice_of[1], int(slice_of[2]), value, dtype, source)
            return
        for part, array in self._parts(path, value, value.shape, source):
            self._check_shape(part, array.shape, source)
            array = self._stored(part, array, dtype)
            loaded[part] = (self.place(array, self.sharding(part)) if self.sharding is not None
                            else jax.numpy.asarray(array))

    def _parts(self, path: str, value, shape: tuple, source: str) -> list[tuple[str, np.ndarray]]:
        """`value` (of the parameter at `path`, whose float shape is `shape`) in the format the target
        keeps it in, a float weight quantized: (the path of each part, the part)."""
        fmt = self.formats.get(path)
        if fmt is not None and not isinstance(value, QuantizedWeight):
            self._check_shape(path, shape, source, logical=True)
            value = quantize(value, fmt)
        elif fmt is None and isinstance(value, QuantizedWeight):
            raise ValueError(f"{source}: quantized blocks for {path}, which is kept in floats")
        parts = zip(quantized_paths(path), value) if fmt is not None else [(path, value)]
        return [(part, array) for part, array in parts if array is not None]

    def _put_split(self, loaded: dict, paths: list[str], value, dtype: str, source: str) -> None:
        sizes = [self.logical_shape(p)[0] for p in paths]
        rows = (value.data if isinstance(value, QuantizedWeight) else value).shape[0]
        if rows != sum(sizes):
            raise ValueError(f"tensor {source} has {rows} rows, expected {sum(sizes)} ({' + '.join(map(str, sizes))}) "
                             f"from config.json")
        bounds = np.cumsum(sizes)[:-1]
        if isinstance(value, QuantizedWeight):
            parts = [np.split(part, bounds) if part is not None else [None] * len(paths) for part in value]
            pieces = [QuantizedWeight(*each) for each in zip(*parts)]
        else:
            pieces = np.split(value, bounds)
        for path, piece in zip(paths, pieces):
            self.put(loaded, path, piece, dtype, source)

    def _put_slice(self, loaded: dict, path: str, index: int, value, dtype: str, source: str) -> None:
        count = self.shapes[path][0]
        if index >= count:
            raise ValueError(f"tensor {source} is slice {index} of {path}, which has {count} from config.json")
        for part, array in self._parts(path, value, (count, *value.shape), source):
            self._check_shape(part, (count, *array.shape), source)
            stored = self._stored(part, array, dtype)
            stack = loaded.setdefault(part, _Stack(np.empty(self.shapes[part], stored.dtype)))
            if index in stack.filled:
                raise ValueError(f"tensor {source}: slice {index} of {path} is given twice")
            stack.array[index] = stored
            stack.filled.add(index)
            if len(stack.filled) == count:
                loaded[part] = (self.place(stack.array, self.sharding(part)) if self.sharding is not None
                                else jax.numpy.asarray(stack.array))

    def _check_shape(self, path: str, shape: tuple, source: str, logical: bool = False) -> None:
        want = tuple(self.shapes[path]) if not logical else self.logical_shape(path)
        if tuple(shape) != want:
            raise ValueError(f"tensor {source} has shape {tuple(shape)}, expected {want} from config.json")

    def logical_shape(self, path: str) -> tuple[int, ...]:
        """The float shape of the weight at `path` ([..., out, in] where it is kept as int4 pairs)."""
        shape = tuple(self.shapes[path])
        return (*shape[:-1], 2 * shape[-1]) if self.formats.get(path) == "int4" else shape

    def check_complete(self, loaded: Mapping[str, object], source: object) -> None:
        partial = {path: stack for path, stack in loaded.items() if isinstance(stack, _Stack)}
        for path, stack in partial.items():
            absent = sorted(set(range(len(stack.array))) - stack.filled)
            raise ValueError(f"checkpoint {source} lacks {len(absent)} slices of {path}, e.g. {absent[:3]}")
        missing = sorted(set(self.shapes) - set(loaded))
        if missing:
            raise ValueError(f"checkpoint {source} lacks {len(missing)} tensors, e.g. {missing[:3]} (decoder paths)")

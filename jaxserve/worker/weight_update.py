"""New weights for a running engine: what a trainer hands it, in the layout the step keeps them in.

The step takes the weights as an argument, never as constants, so arrays of the same shapes,
dtypes and shardings run in the executables compiled already: an update compiles no step.
`WeightLayout` knows that layout (each leaf's path and `jax.ShapeDtypeStruct`, and the
`ParamTarget` the engine loaded its checkpoint into) and brings new weights into it:

- a trainer's arrays (`from_arrays`), by the model's parameter paths (`param_shapes`: the float
  model's, "layers.0.mlp.up_proj.weight"; `params_from_hf` maps Hugging Face names onto them),
  cast and quantized on their devices, placed onto the engine's mesh (an array already in the
  engine's dtype and sharding is taken as it is: no copy);
- a checkpoint's or a stream's tensors (`from_checkpoint`, `StagedWeights`), loaded exactly as
  the engine's own loader loads them.

Either way the result is a whole set of leaves (`leaves`), swapped in at once between steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Sharding

from checkpoints import ParamTarget, load_params, quantized_paths
from checkpoints.hf import state_path_of
from checkpoints.target import SLICE
from jaxserve.worker.weights import flatten
from jaxserve_kernels.matmul.grouped import BITS
from jaxserve_kernels.matmul.quant import GroupedRows, QuantizedWeight, dequantize, group_rows, quantize


def next_weight_version(current: int, asked: int | None) -> int:
    """The version new weights take: the one asked for, else one more than `current` (the newest)."""
    return current + 1 if asked is None else int(asked)


def leaf_paths(state: nnx.State) -> list[str]:
    """Each leaf's parameter path ("layers.0.mlp.up_proj.weight"), in `jax.tree.flatten(state)`'s order."""
    keyed, _ = jax.tree_util.tree_flatten_with_path(state)
    return [".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)) for path, _ in keyed]


def _sharding_of(x) -> Sharding | None:
    return x.sharding if isinstance(x, jax.Array) else None


class WeightLayout:
    """The weights as the step takes them (see the module's doc)."""

    def __init__(self, state: nnx.State, target: ParamTarget, dtype: str):
        self.target = target
        self.dtype = dtype
        self.paths = leaf_paths(state)
        self.specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in jax.tree.leaves(state)]
        self._spec = dict(zip(self.paths, self.specs))
        parts = {part for weight in target.formats for part in quantized_paths(weight)[1:]}
        # what a trainer gives: the float model's parameters (a quantized matrix as floats)
        self.param_shapes = {path: target.logical_shape(path) for path in self.paths if path not in parts}
        self._converters: dict[tuple, jax.stages.Wrapped] = {}

    def from_arrays(self, params: Mapping) -> dict[str, jax.Array]:
        """A trainer's parameters (by path, flat or nested as `nnx.to_pure_dict` gives them; jax or numpy
        arrays of the float model's shapes, `param_shapes`) -> the engine's leaves by path, on its
        devices: cast to its dtype and quantized where it keeps a matrix quantized (on the device: the
        same values as quantizing on the host), moved or resharded device to device."""
        params = flatten(params)
        self._check_names(params)
        out = {}
        for path, x in params.items():
            if tuple(x.shape) != self.param_shapes[path]:
                raise ValueError(f"update_weights: {path} has shape {tuple(x.shape)}, the model's is "
                                 f"{self.param_shapes[path]}")
            fmt = self.target.formats.get(path)
            parts = quantized_paths(path) if fmt else (path,)
            specs = [self._spec[p] for p in parts if p in self._spec]
            if fmt is None and path not in self.target.as_bits and x.dtype == specs[0].dtype \
                    and _sharding_of(x) == specs[0].sharding:
                out[path] = x  # (already the engine's: taken as it is)
                continue
            x = jax.device_put(x, specs[0].sharding)  # (device to device, or host to device for numpy)
            converted = self._converter(fmt, path in self.target.as_bits, path in self.target.grouped, tuple(specs))(x)
            out.update(zip(parts, converted))
        return out

    def _check_names(self, params: Mapping) -> None:
        unknown = sorted(set(params) - set(self.param_shapes))
        missing = sorted(set(self.param_shapes) - set(params))
        if unknown or missing:
            raise ValueError(f"update_weights takes every parameter of the model by path (`param_shapes`; "
                             f"params_from_hf maps Hugging Face names): unknown {unknown[:3]}, missing {missing[:3]}")

    def _converter(self, fmt: str | None, as_bits: bool, grouped: bool, specs: tuple[jax.ShapeDtypeStruct, ...]):
        """The jitted cast (or quantization, and grouping) of a float weight into its parts' `specs`:
        compiled once per kind of weight, then reused by every update."""
        key = (fmt, as_bits, grouped, specs)
        if key not in self._converters:
            def convert(x):
                if fmt is not None:
                    weight = quantize(x, fmt, jnp)
                    return [part for part in (group_rows(weight, jnp) if grouped else weight) if part is not None]
                if as_bits:
                    return [jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BITS)]
                return [x.astype(specs[0].dtype)]
            self._converters[key] = jax.jit(convert, out_shardings=[s.sharding for s in specs])
        return self._converters[key]

    def from_checkpoint(self, model_dir: str | Path) -> dict[str, jax.Array]:
        """The leaves of a checkpoint (a safetensors directory, Orbax, a GGUF view), loaded as the
        engine loaded its own."""
        return load_params(model_dir, self.target, self.dtype)

    def leaves(self, loaded: Mapping[str, jax.Array]) -> list[jax.Array]:
        """The step's weights from leaves by path: all of them, each of its leaf's shape, dtype and
        sharding (so that the compiled steps run them), in the step's order."""
        if set(loaded) != set(self.paths):
            missing = sorted(set(self.paths) - set(loaded))
            raise ValueError(f"new weights lack {len(missing)} of the model's tensors, e.g. {missing[:3]}")
        for path, spec in zip(self.paths, self.specs):
            x = loaded[path]
            if (x.shape, x.dtype) != (spec.shape, spec.dtype) or not x.sharding.is_equivalent_to(spec.sharding, x.ndim):
                raise ValueError(f"new weight {path}: {x.dtype}{list(x.shape)} on {x.sharding}, the step takes "
                                 f"{spec.dtype}{list(spec.shape)} on {spec.sharding}")
        return [loaded[path] for path in self.paths]

    def to_host(self, leaves: list[jax.Array]) -> list[np.ndarray]:
        """A host copy of the weights (sleep level 1 keeps one)."""
        return jax.device_get(leaves)

    def from_host(self, host: list[np.ndarray]) -> list[jax.Array]:
        return [jax.device_put(x, spec.sharding) for x, spec in zip(host, self.specs)]

    def float_params(self, leaves: list[jax.Array]) -> dict[str, jax.Array]:
        """The weights as the float model's parameters by path (what `from_arrays` takes): quantized
        matrices dequantized (float32), bit-kept stacks as bfloat16, the others the engine's own
        arrays (not copies: a train step that donates its inputs must be given copies)."""
        stored = dict(zip(self.paths, leaves))
        out = {}
        for path in self.param_shapes:
            if path in self.target.formats:
                kind = GroupedRows if path in self.target.grouped else QuantizedWeight
                out[path] = dequantize(kind(*(stored.get(p) for p in quantized_paths(path))))
            elif path in self.target.as_bits:
                out[path] = jax.lax.bitcast_convert_type(stored[path], jnp.bfloat16)
            else:
                out[path] = stored[path]
        return out


def params_from_hf(named: Mapping[str, jax.Array], target: ParamTarget) -> dict[str, jax.Array]:
    """Tensors by Hugging Face name (a trainer's model in transformers' naming) -> the model's
    parameters by path, for `update_weights`. A fused tensor (Phi-3's qkv_proj) is split and an
    expert's slices are stacked, on the arrays' own devices; a tied head the model leaves out is
    dropped."""
    out: dict[str, jax.Array] = {}
    slices: dict[str, dict[int, jax.Array]] = {}
    for name, x in named.items():
        path = state_path_of(name, target, source=repr(name))
        if path is None:
            continue
        if "|" in path:
            paths = path.split("|")
            bounds = np.cumsum([target.logical_shape(p)[0] for p in paths])[:-1]
            out.update(zip(paths, jnp.split(x, bounds)))
        elif match := SLICE.fullmatch(path):
            slices.setdefault(match[1], {})[int(match[2])] = x
        else:
            out[path] = x
    for path, parts in slices.items():
        count = target.logical_shape(path)[0]
        if sorted(parts) != list(range(count)):
            raise ValueError(f"params_from_hf: {path} needs its {count} slices, got {len(parts)}")
        out[path] = jnp.stack([parts[i] for i in range(count)])
    return out


class StagedWeights:
    """Tensors arriving a few at a time (an HTTP stream), loaded as a checkpoint's are, held apart
    until all have come (`leaves`): the engine runs on its old weights meanwhile."""

    def __init__(self, layout: WeightLayout):
        self.layout = layout
        self.loaded: dict = {}

    def put(self, name: str, array: np.ndarray) -> None:
        """One tensor, by parameter path or by Hugging Face name."""
        target = self.layout.target
        path = name if target.fits(name) else state_path_of(name, target, source=repr(name))
        if path is not None:
            target.put(self.loaded, path, array, self.layout.dtype, source=repr(name))

    def leaves(self) -> list[jax.Array]:
        self.layout.target.check_complete(self.loaded, "the weights sent")
        return self.layout.leaves(self.layout.target.group(self.loaded))

"""Logits processors compiled into the step: the public base class `LogitsProcessor` and
`Processors`, the ones an engine runs.

A processor is registered when the engine starts (`LLM(logits_processors=[Cls])`,
`--logits-processors module:Cls`) and is traced into the one jitted step with the rest of the
sampler, so a request that uses it costs no host round trip and no compilation. Requests opt in
through their `extra_args` (HTTP: `vllm_xargs`, or the arguments' names as top-level fields): once
per request, `row_args` turns them into the processor's per-row arguments, which travel to the
device as rows of arrays like every other sampling setting. Rows that do not use a processor keep
its default arguments and are left untouched; a step where no row uses it skips it.

State across steps: `carry` names arguments that `advance` updates after each token is drawn,
which the engine keeps per sequence and sends back with the next step (mirostat's target surprise
is one). `history` and `random` give `apply` more inputs (`LogitsProcessor`).

The engine's built-in processors (llama.cpp's samplers, `jaxserve.sample.llamacpp`) run on the
same mechanism ahead of the registered ones; they read their SamplingParams fields instead of
extra_args (`request_args`).
"""

from __future__ import annotations

import abc
import hashlib
import inspect
import zlib
from collections.abc import Callable
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.plugins import import_class
from jaxserve.sample.params import SamplingParams

ARG_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32), np.dtype(bool))
HISTORY_ARGS = ("history", "num_prompt")  # what `history = True` adds to apply's args
RANDOM_ARG = "key"  # what `random = True` adds to apply's args


def _inputs(proc: LogitsProcessor, args: dict, history: jax.Array, num_prompt: jax.Array, keys: jax.Array) -> dict:
    if proc.history:
        args = {**args, "history": history, "num_prompt": num_prompt}
    if proc.random:  # (folded with the class's name: a stream of its own, apart from the token's draw)
        salt = zlib.crc32(f"{type(proc).__module__}.{type(proc).__qualname__}".encode())
        args = {**args, RANDOM_ARG: jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, np.uint32(salt))}
    return args


class LogitsProcessor(abc.ABC):
    """A logits processor traced into the step. Subclass it and give:

    - `args`: argument name -> a numpy scalar or array giving its dtype (int32, uint32, float32 or
      bool), its shape per row and the value of rows that do not set it, e.g.
      `args = {"token": np.int32(-1)}`;
    - `row_args(extra_args)`: on the host, once per request: the values of its arguments from the
      request's `extra_args` (any of them left out take their default), or None when the request does
      not use the processor; a ValueError is the request's error (HTTP 400);
    - `apply(logits, args, active)`: inside the compiled step: logits f32[rows, vocab], args a dict
      of [rows, ...] arrays, active bool[rows] -> logits of the same shape and dtype (rows not active
      are restored afterwards whatever it returns for them).

    Optional: `history = True` (args then also hold "history" i32[rows, H], prompt + generated ids,
    vocab_size past the end, and "num_prompt" i32[rows]); `carry`, names of scalar arguments that
    `advance` updates after each token is drawn; `random = True` (args then also hold "key", a
    jax.random key per row [rows], a function of the row's seed, the position of the token being
    sampled and the class's name only). The engine makes one instance, `Cls(vocab_size)`, and
    checks it traces when it starts."""

    args: ClassVar[dict[str, np.ndarray | np.generic]] = {}
    history: ClassVar[bool] = False
    carry: ClassVar[tuple[str, ...]] = ()
    random: ClassVar[bool] = False

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    @abc.abstractmethod
    def row_args(self, extra_args: dict) -> dict[str, np.ndarray] | None:
        """The request's arguments from its `extra_args`, or None when it does not use this processor."""

    def request_args(self, params, encode: Callable[[str], list[int]] | None = None) -> dict | None:
        """The arguments of a request with these `SamplingParams`: `row_args` of its extra_args
        (the built-in processors read their own SamplingParams fields instead, and tokenize text
        with `encode`, the engine's text -> token ids)."""
        return self.row_args(params.extra_args or {})

    @property
    def reads_extra_args(self) -> bool:
        """Whether its arguments come from extra_args (`row_args`), so are request fields too."""
        return type(self).request_args is LogitsProcessor.request_args

    @abc.abstractmethod
    def apply(self, logits: jax.Array, args: dict[str, jax.Array], active: jax.Array) -> jax.Array:
        """logits f32[rows, V] -> f32[rows, V], for the rows where `active`."""

    def advance(self, args: dict[str, jax.Array], tokens: jax.Array, logprobs: jax.Array) -> dict[str, jax.Array]:
        """The `carry` arguments for the next token, given the drawn tokens i32[rows] and their
        logprobs f32[rows] under the distribution they were drawn from (0 for greedy rows)."""
        return {}


def load_class(spec) -> type[LogitsProcessor]:
    """A processor class, or its name as `module:Class` or `module.Class` (vLLM's form)."""
    if isinstance(spec, str):
        spec = import_class(spec, "logits processor")
    if not (isinstance(spec, type) and issubclass(spec, LogitsProcessor)):
        raise ValueError(f"logits processor {spec!r} is not a subclass of jaxserve.LogitsProcessor")
    return spec


def fingerprint(classes) -> str:
    """Names and source hashes of processor classes (their whole modules': helpers and constants
    too): part of what a compiled step is keyed by, so an edited processor is never run from a stale
    executable."""
    parts = []
    for cls in (c if isinstance(c, type) else type(c) for c in classes):
        try:
            source = inspect.getsource(inspect.getmodule(cls))
        except (OSError, TypeError):
            source = repr(cls.__dict__)
        parts.append(f"{cls.__module__}.{cls.__qualname__}:{hashlib.sha256(source.encode()).hexdigest()[:16]}")
    return ",".join(parts)


def _uniform(default) -> tuple | None:
    """(shape, fill, dtype) of an argument's default that holds one value throughout, else None."""
    default = np.asarray(default)
    if default.size and np.all(default == default.flat[0]):
        return default.shape, default.flat[0].item(), default.dtype.name
    return None


@flax.struct.dataclass
class ProcessorRows:
    """One processor's inputs to a step (B = padded rows)."""

    args: dict[str, jax.Array]  # name -> [B, ...] of its declared dtype and shape
    active: jax.Array  # bool[B] the rows that use it


class Processors:
    """The processors an engine runs, in order: what turns requests into their rows, applies them in
    the step and reads back what they carry. `classes` may hold instances of built-in processors."""

    def __init__(self, classes, vocab_size: int):
        self.vocab_size = vocab_size
        self.instances: list[LogitsProcessor] = [c if isinstance(c, LogitsProcessor) else load_class(c)(vocab_size)
                                                 for c in classes]
        for proc in self.instances:
            self._check_declaration(proc)
        # (processor index, argument name) of each carried value, in the order they are packed
        self.carried = [(p, name) for p, proc in enumerate(self.instances) for name in proc.carry]
        # per processor, each argument's default as one value (its shape, fill, dtype), or None: read
        # once here, not per step, where every step of rows that use no processor pads them all
        self._uniform = [{name: _uniform(d) for name, d in proc.args.items()} for proc in self.instances]

    @property
    def arg_names(self) -> frozenset[str]:
        """The names of the arguments requests may give (over HTTP, also as top-level fields)."""
        return frozenset(name for proc in self.instances if proc.reads_extra_args for name in proc.args)

    def __len__(self) -> int:
        return len(self.instances)

    @staticmethod
    def _check_declaration(proc: LogitsProcessor) -> None:
        name = type(proc).__name__
        for arg, default in proc.args.items():
            if np.asarray(default).dtype not in ARG_DTYPES:
                raise ValueError(f"logits processor {name}: argument {arg!r} has dtype {np.asarray(default).dtype}; "
                                 "arguments are int32, uint32, float32 or bool")
            # (a processor that reads SamplingParams fields itself, as llama.cpp's do, takes no top-level ones)
            reads_extra_args = type(proc).request_args is LogitsProcessor.request_args
            if reads_extra_args and arg in SamplingParams.__dataclass_fields__:
                raise ValueError(f"logits processor {name}: argument {arg!r} is a SamplingParams field; name it "
                                 "otherwise (over HTTP, arguments are also read as top-level fields)")
            if (arg in HISTORY_ARGS and proc.history) or (arg == RANDOM_ARG and proc.random):
                raise ValueError(f"logits processor {name}: argument {arg!r} is reserved for its history or key")
        for arg in proc.carry:
            if arg not in proc.args or np.asarray(proc.args[arg]).shape != () or \
                    np.asarray(proc.args[arg]).dtype.itemsize != 4:
                raise ValueError(f"logits processor {name}: carried argument {arg!r} must be a 32-bit scalar "
                                 "of its args")

    def check(self, history_len: int, rows: int = 2) -> None:
        """Trace each processor on `rows` rows of default arguments; ValueError naming it where it
        fails or returns the wrong shape: at start, never while serving."""
        logits = jax.ShapeDtypeStruct((rows, self.vocab_size), jnp.float32)
        for p, proc in enumerate(self.instances):
            name = type(proc).__name__
            try:
                proc.row_args({})
            except Exception as e:
                raise ValueError(f"logits processor {name}: row_args({{}}) raised {type(e).__name__}: {e}") from e
            args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.rows([None] * rows, rows)[p])
            history = jax.ShapeDtypeStruct((rows, history_len), jnp.int32)
            num_prompt = jax.ShapeDtypeStruct((rows,), jnp.int32)
            keys = jax.eval_shape(lambda: jax.vmap(jax.random.key)(jnp.zeros(rows, jnp.uint32)))
            try:
                out = jax.eval_shape(lambda lg, a, h, n, k: proc.apply(lg, _inputs(proc, a.args, h, n, k), a.active),
                                     logits, args, history, num_prompt, keys)
                carried = jax.eval_shape(lambda a: proc.advance(a.args, jnp.zeros(rows, jnp.int32),
                                                                jnp.zeros(rows, jnp.float32)), args)
            except Exception as e:
                raise ValueError(f"logits processor {name} does not trace: {type(e).__name__}: {e}") from e
            if not hasattr(out, "shape") or (out.shape, out.dtype) != (logits.shape, logits.dtype):
                raise ValueError(f"logits processor {name}: apply must return float32{list(logits.shape)}, "
                                 f"got {getattr(out, 'dtype', type(out).__name__)}{list(getattr(out, 'shape', []))}")
            if set(carried) != set(proc.carry) or any(carried[k].shape != (rows,) for k in proc.carry):
                raise ValueError(f"logits processor {name}: advance must return {sorted(proc.carry)} with one "
                                 "value per row")

    def request_args(self, params, encode: Callable[[str], list[int]] | None = None
                     ) -> tuple[dict[str, np.ndarray] | None, ...]:
        """Each processor's arguments for a request (None where it does not use it), checked against
        the declarations: ValueError naming the processor for an unknown name or a wrong shape."""
        out = []
        for proc in self.instances:
            given = proc.request_args(params, encode)
            if given is None:
                out.append(None)
                continue
            name = type(proc).__name__
            unknown = set(given) - set(proc.args)
            if unknown:
                raise ValueError(f"logits processor {name}: unknown arguments {sorted(unknown)}")
            args = {}
            for arg, default in proc.args.items():
                default = np.asarray(default)
                value = np.asarray(given.get(arg, default))
                if value.shape != default.shape:
                    raise ValueError(f"logits processor {name}: argument {arg!r} must have shape {default.shape}, "
                                     f"got {value.shape}")
                args[arg] = value.astype(default.dtype)
            out.append(args)
        return tuple(out)

    def rows(self, request_args: list[tuple | None], num_rows: int,
             carried: list[np.ndarray | None] | None = None, unused=None) -> tuple[ProcessorRows, ...]:
        """Host arrays for a step: request_args[b], row b's `request_args` (None: uses none), padded to
        `num_rows`; carried[b], row b's carried values from its last step (`carried` order; None:
        its initial ones). A processor no row uses gets `unused(shape, fill, dtype)` for its inputs
        whose default is one value (`sampling.Padding`, which the runner sends once), where given."""
        out = []
        for p, proc in enumerate(self.instances):
            users = [b for b, row in enumerate(request_args) if row is not None and row[p] is not None]
            if not users and unused is not None:
                out.append(ProcessorRows(args={name: self._unused(d, self._uniform[p][name], num_rows, unused)
                                               for name, d in proc.args.items()},
                                         active=unused((num_rows,), 0, "bool")))
                continue
            args = {name: np.broadcast_to(np.asarray(d), (num_rows, *np.shape(d))).copy()
                    for name, d in proc.args.items()}
            active = np.zeros(num_rows, bool)
            active[users] = True
            for b in users:
                for name, value in request_args[b][p].items():
                    args[name][b] = value
            for c, (q, name) in enumerate(self.carried):
                for b in users if q == p else ():
                    if carried and carried[b] is not None:
                        args[name][b] = carried[b][c:c + 1].view(args[name].dtype)[0]
            out.append(ProcessorRows(args=args, active=active))
        return tuple(out)

    @staticmethod
    def _unused(default, uniform: tuple | None, num_rows: int, unused):
        if uniform is not None:
            shape, fill, dtype = uniform
            return unused((num_rows, *shape), fill, dtype)
        default = np.asarray(default)
        return np.broadcast_to(default, (num_rows, *default.shape)).copy()

    def uses_history(self, request_args: tuple | None) -> bool:
        return request_args is not None and any(a is not None and proc.history
                                                for proc, a in zip(self.instances, request_args))

    def carries(self, request_args: tuple | None) -> bool:
        """Whether a request with these arguments uses a processor that carries state (its next step
        then needs this one's outcome first)."""
        return request_args is not None and any(a is not None and proc.carry
                                                for proc, a in zip(self.instances, request_args))

    def apply(self, logits: jax.Array, rows: tuple[ProcessorRows, ...], history: jax.Array,
              num_prompt: jax.Array, keys: jax.Array) -> jax.Array:
        """Inside the step: each processor in turn, on the rows that use it; skipped where none does.
        `history` i32[B, H] and `num_prompt` i32[B]: the sampler's, for processors that read them;
        `keys` [B]: each row's random key (of its seed and position), for processors that draw."""
        for proc, r in zip(self.instances, rows):
            def run(x, r=r, proc=proc):
                return jnp.where(r.active[:, None], proc.apply(x, _inputs(proc, r.args, history, num_prompt, keys),
                                                               r.active), x)
            logits = jax.lax.cond(jnp.any(r.active), run, lambda x, r=r: x, logits)
        return logits

    def advance(self, rows: tuple[ProcessorRows, ...], tokens: jax.Array, logprobs: jax.Array) -> jax.Array:
        """Inside the step: the carried values after this token, i32[B, C] bit patterns (`carried`
        order; a row that does not use a processor keeps its values)."""
        columns = []
        for p, proc in enumerate(self.instances):
            if not proc.carry:
                continue
            r = rows[p]
            new = proc.advance(r.args, tokens, logprobs)
            for name in proc.carry:
                value = jnp.where(r.active, new[name].astype(r.args[name].dtype), r.args[name])
                columns.append(jax.lax.bitcast_convert_type(value, jnp.int32))
        return jnp.stack(columns, axis=1) if columns else jnp.zeros((tokens.shape[0], 0), jnp.int32)

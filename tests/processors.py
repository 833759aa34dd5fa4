"""Logits processors the tests register (`--logits-processors processors:BanToken`, ...)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import LogitsProcessor


class BanToken(LogitsProcessor):
    """Never sample `ban_token` (extra_args {"ban_token": id})."""

    args = {"ban_token": np.int32(-1)}

    def row_args(self, extra_args):
        if "ban_token" not in extra_args:
            return None
        token = extra_args["ban_token"]
        if not isinstance(token, int) or not 0 <= token < self.vocab_size:
            raise ValueError(f"ban_token must be a token id in [0, {self.vocab_size}), got {token!r}")
        return {"ban_token": token}

    def apply(self, logits, args, active):
        return jnp.where(jnp.arange(logits.shape[-1]) == args["ban_token"][:, None], -jnp.inf, logits)


class Count(LogitsProcessor):
    """Force the tokens start, start + 1, ...: the next one is carried from token to token."""

    args = {"count_from": np.int32(0)}
    carry = ("count_from",)

    def row_args(self, extra_args):
        return {"count_from": extra_args["count_from"]} if "count_from" in extra_args else None

    def apply(self, logits, args, active):
        return jnp.where(jnp.arange(logits.shape[-1]) == args["count_from"][:, None], 0.0, -jnp.inf)

    def advance(self, args, tokens, logprobs):
        return {"count_from": (tokens + 1) % self.vocab_size}


class NoRepeat(LogitsProcessor):
    """Never sample a token the output already holds (read from the token history)."""

    args = {"no_repeat": np.bool_(False)}
    history = True

    def row_args(self, extra_args):
        return {"no_repeat": True} if extra_args.get("no_repeat") else None

    def apply(self, logits, args, active):
        history, num_prompt = args["history"], args["num_prompt"]
        is_output = jnp.arange(history.shape[1])[None, :] >= num_prompt[:, None]
        rows = jnp.arange(logits.shape[0])[:, None]
        seen = jnp.zeros(logits.shape, bool).at[rows, history].max(is_output, mode="drop")
        return jnp.where(seen, -jnp.inf, logits)


class EntropyTemperature(LogitsProcessor):
    """docs/research_sampling.md's second example."""

    args = {"entropy_strength": np.float32(0.0)}

    def row_args(self, extra_args):
        if "entropy_strength" not in extra_args:
            return None
        return {"entropy_strength": float(extra_args["entropy_strength"])}

    def apply(self, logits, args, active):
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        entropy = -jnp.sum(jnp.where(jnp.isfinite(logprobs), jnp.exp(logprobs) * logprobs, 0.0), axis=-1)
        return logits * (1.0 + args["entropy_strength"] * entropy)[:, None]


class Raises(LogitsProcessor):
    def row_args(self, extra_args):
        return None

    def apply(self, logits, args, active):
        raise RuntimeError("broken processor")


class WrongShape(LogitsProcessor):
    def row_args(self, extra_args):
        return None

    def apply(self, logits, args, active):
        return logits[:, :-1]


class FailOnDevice(LogitsProcessor):
    """Fail the step on the device, for a row with extra_args {"fail_on_device": true}: a host callback
    raises while the step runs, so the KV cache it wrote (donated) holds the error."""

    args = {"fail_on_device": np.bool_(False)}

    def row_args(self, extra_args):
        return {"fail_on_device": True} if extra_args.get("fail_on_device") else None

    def apply(self, logits, args, active):
        def check(flags):
            if np.any(flags):
                raise RuntimeError("injected device failure")
            return np.zeros((), np.float32)

        zero = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32), args["fail_on_device"] & active)
        return logits + zero

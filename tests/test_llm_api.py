"""The offline `LLM` API: prompt forms, outputs, and stopping at the model's EOS ids."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shutil
import time

import numpy as np
import pytest
from conftest import SMALL_ENGINE, needs_cpu_backend
from tqdm import tqdm

from checkpoints.default_model import write_byte_tokenizer
from jaxserve import (LLM, EngineArgs, LLMEngine, Logprob, LoRARequest, RequestOutput, RequestOutputKind,
                      SamplingParams, TextPrompt, TokensPrompt)
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.chat_template import loops_over_content
from jaxserve.engine.commands import Abort, Add, Subscriber
from jaxserve.sample.params import RequestSampling
from jaxserve.sched.sequence import FORK_SEED_STRIDE


@pytest.fixture(scope="module")
def default_llm():
    return LLM("jaxserve-tiny", **SMALL_ENGINE)  # the built-in jaxserve-tiny (random weights)


def test_prompt_forms_and_output_shape(default_llm):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = default_llm.tokenizer.encode("hello")
    by_text = default_llm.generate("hello", greedy)
    assert len(by_text) == 1 and by_text[0].prompt == "hello" and by_text[0].prompt_token_ids == ids
    by_ids, by_dict = default_llm.generate([ids, {"prompt_token_ids": ids}], greedy)
    out = by_text[0].outputs[0]
    assert by_ids.outputs[0].token_ids == out.token_ids == by_dict.outputs[0].token_ids
    assert len(out.token_ids) == 6 and out.finish_reason == "length" and by_text[0].finished
    assert out.text == default_llm.tokenizer.decode(ids + out.token_ids)[len(default_llm.tokenizer.decode(ids)):]
    assert out.cumulative_logprob is None  # as vLLM's, without logprobs
    assert out.finished() and by_text[0].outputs[0].finished()
    # numpy's integers, tuples and arrays are token ids too; a dict may hold both forms
    by_numpy = default_llm.generate([np.asarray(ids), {"prompt": "hello", "prompt_token_ids": tuple(np.int64(t) for t in ids)}],
                                    greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_numpy] == [out.token_ids] * 2 and by_numpy[1].prompt == "hello"
    for wrong, match in ((123, "a prompt must be"), ([[1.5, 2]], "a prompt must be"), ({"text": "x"}, "'prompt' or"),
                         ({"prompt": "x", "multi_modal_data": {"image": "y"}}, "text only")):
        with pytest.raises(ValueError, match=match):
            default_llm.generate(wrong, greedy, use_tqdm=False)
    bars = []  # (vLLM's use_tqdm may also be what makes the bar)
    default_llm.generate(["a", "b"], greedy, use_tqdm=lambda **options: bars.append(options) or tqdm(**options))
    assert bars == [{"total": 2, "desc": "generating"}]
    scored = default_llm.generate("hello", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                          logprobs=0))[0].outputs[0]
    assert scored.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(scored.token_ids,
                                                                                       scored.logprobs)), abs=1e-4)


def test_default_max_tokens_is_16_and_list_of_params(default_llm):
    outs = default_llm.generate(["a", "b"], [SamplingParams(ignore_eos=True),
                                             SamplingParams(max_tokens=3, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [16, 3]
    with pytest.raises(ValueError, match="SamplingParams for"):
        default_llm.generate(["a", "b"], [SamplingParams()])


def test_stops_at_any_eos_id_of_generation_config(hf_checkpoint, tmp_path):
    _, src = hf_checkpoint("llama")
    prompt = [5, 6, 7, 8]
    processed = LLM(str(src), logprobs_mode="processed_logprobs", **SMALL_ENGINE)  # (also: vLLM's logprobs_mode)
    free = processed.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    tokens = free[0].outputs[0].token_ids
    pair = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=[3, 9], logprobs=0)
    (drawn,) = processed.generate([prompt], pair)[0].outputs  # the distribution drawn from: two tokens
    assert drawn.logprobs[0][drawn.token_ids[0]].logprob >= math.log(0.5) - 1e-6
    assert len(tokens) == 12  # this checkpoint has no EOS
    eos = tokens[4]
    d = shutil.copytree(src, tmp_path / "with-eos")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [255, eos], "temperature": 0.0,
                                                          "top_k": 50, "do_sample": True, "max_new_tokens": 12}))
    tok = tmp_path / "tokenizer"  # (vLLM's `tokenizer`: the tokenizer and chat template from elsewhere)
    tok.mkdir()
    write_byte_tokenizer(tok)
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tok / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((tok / "tokenizer_config.json").read_text()), "chat_template": template}))
    llm = LLM(str(d), tokenizer=str(tok), **SMALL_ENGINE)
    assert llm.get_tokenizer().chat_template == template
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    first = tokens.index(eos)
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop" and out.stop_reason is None
    (raw,) = llm.generate([prompt], pair)[0].outputs  # the default, raw_logprobs: the model's own distribution
    assert raw.token_ids == drawn.token_ids and raw.logprobs[0][raw.token_ids[0]].logprob < math.log(0.5) - 0.1
    # vLLM's --generation-config auto: the file's sampling settings are the defaults (top_k 50 is
    # transformers' own default, not the model's choice; do_sample is not read)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=12)
    assert llm.generate([prompt])[0].outputs[0].token_ids == out.token_ids
    kept = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert kept.token_ids == tokens and kept.finish_reason == "length"
    stopped = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[tokens[2]]))[0].outputs[0]
    assert stopped.token_ids == tokens[: tokens.index(tokens[2]) + 1] and stopped.stop_reason == tokens[2]
    decode = llm.get_tokenizer().decode
    assert stopped.text == decode(stopped.token_ids[:-1], skip_special_tokens=True)  # the stop token: no text
    with_stop = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                      stop_token_ids=[tokens[2]], include_stop_str_in_output=True))
    assert with_stop[0].outputs[0].text == decode(stopped.token_ids, skip_special_tokens=True) != stopped.text


def test_chat_renders_the_template(default_llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = default_llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == default_llm.get_tokenizer()(out.prompt, add_special_tokens=False).input_ids
    assert len(default_llm.chat([messages, messages[1:]], SamplingParams(max_tokens=2))) == 2


def test_chat_options_as_vllms(default_llm):
    params = SamplingParams(max_tokens=2)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    out = default_llm.chat(messages, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon"  # left open
    template = "{{ messages[0]['content'] }}|{{ tools[0]['function']['name'] }}|{{ mood }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = default_llm.chat(messages[:1], params, chat_template=template, tools=tools,
                           chat_template_kwargs={"mood": "sunny"})[0]
    assert out.prompt == "hi|get_weather|sunny"
    with pytest.raises(ValueError, match="continue_final_message"):
        default_llm.chat(messages, params, continue_final_message=True)  # with add_generation_prompt

    # messages as the server renders them (vLLM's): text parts joined, or kept as parts where the
    # template loops over them; tool-call arguments decoded; the deprecated roles renamed
    parts = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    as_text = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
               "{% for c in m.get('tool_calls', []) %}{{ c['function']['arguments'] | tojson }}{% endfor %};{% endfor %}")
    out = default_llm.chat(parts, params, chat_template=as_text)[0]
    assert out.prompt == 'system:a\nb;assistant:{"x": 1};tool:ok;'
    as_parts = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    assert default_llm.chat(parts, params, chat_template=as_parts)[0].prompt == "[a][b][ok]"  # "auto": parts
    indexed = "{{ messages[0]['content'][1]['text'] }}"  # reads parts without a loop: "auto" says "string"
    assert default_llm.chat(parts, params, chat_template=indexed, chat_template_content_format="openai"
                            )[0].prompt == "b"
    custom = default_llm.chat([{"role": "ipython", "content": "42"}], params, chat_template=as_text)[0]
    assert custom.prompt == "ipython:42;"  # a template's own role, as vLLM passes it
    assert loops_over_content("{% for m in messages %}{% for p in (m.content or []) | list %}{% endfor %}{% endfor %}")
    assert not loops_over_content("{% for m in messages %}{% for l in m['content'].split(',') %}{% endfor %}{% endfor %}")
    with pytest.raises(ValueError, match="text parts"):
        default_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)


@pytest.mark.parametrize("prompt_len", [9, 17])  # last prompt token mid-page (copy-on-write) and page-aligned
def test_n_greedy_choices_equal_the_single_choice(default_llm, prompt_len):
    prompt = list(range(40, 40 + prompt_len))
    greedy = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
    (single,) = default_llm.generate([prompt], SamplingParams(**greedy))
    sched = default_llm.engine.scheduler
    before = sched.num_prompt_tokens_computed
    (multi,) = default_llm.generate([prompt], SamplingParams(n=4, **greedy))
    assert sched.num_prompt_tokens_computed - before == prompt_len - 1 + 4  # the prompt was prefilled once
    assert [o.index for o in multi.outputs] == [0, 1, 2, 3]
    assert all(o.token_ids == single.outputs[0].token_ids for o in multi.outputs)
    (many,) = default_llm.generate([prompt], SamplingParams(n=20, **greedy))  # more than max_num_seqs (8)
    assert [o.token_ids for o in many.outputs] == [single.outputs[0].token_ids] * 20
    sampled = default_llm.generate([prompt], SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=5))[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1  # siblings draw with their own keys
    # sibling k samples with seed 5 + k * stride: alone, that seed gives the same tokens, so the
    # sibling's cache (shared prompt pages, its own copy of the last one) held the right keys and values
    for k, out in enumerate(sampled.outputs):
        alone = default_llm.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0,
                                                              seed=(5 + k * FORK_SEED_STRIDE) % 2**64))
        assert alone[0].outputs[0].token_ids == out.token_ids


def test_stop_strings_logprobs_and_penalties_offline(default_llm):
    prompt = "stop here"
    free = default_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0]
    text = free.text
    stop = text[8:11]
    assert stop and text.find(stop) == 8
    cut = default_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                      stop=[stop, "never-there"]))[0].outputs[0]
    assert cut.text == text[:8] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = default_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop,
                                                       include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:11]
    lp = default_llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                     logprobs=3))[0].outputs[0]
    assert len(lp.logprobs) == 5
    for token, entry in zip(lp.token_ids, lp.logprobs):
        assert entry[token].rank == 1 and len(entry) == 3
    penalised = default_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                            frequency_penalty=2.0, repetition_penalty=1.5))
    assert penalised[0].outputs[0].token_ids != free.token_ids


def test_stop_strings_wait_for_min_tokens_as_in_vllm(default_llm):
    """A stop string counts only where it ends after the text of the first min_tokens tokens."""
    letters = dict(max_tokens=30, temperature=0.0, ignore_eos=True, allowed_token_ids=list(range(97, 123)))
    text = default_llm.generate("zz", SamplingParams(**letters))[0].outputs[0].text  # one letter per token
    stop = text[1:3]
    assert default_llm.generate("zz", SamplingParams(**letters, stop=stop))[0].outputs[0].text == text[:1]
    for min_tokens in (2, 5, 12):
        later = text.find(stop, min_tokens - len(stop) + 1)
        out = default_llm.generate("zz", SamplingParams(**letters, stop=stop, min_tokens=min_tokens))[0].outputs[0]
        assert out.text == (text if later < 0 else text[:later])
        assert out.finish_reason == ("length" if later < 0 else "stop")


def test_truncate_prompt_tokens_and_allowed_token_ids_offline(default_llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True, truncate_prompt_tokens=5,
                            allowed_token_ids=[70, 71])
    (out,) = default_llm.generate([list(range(40, 60))], params, use_tqdm=False)
    assert out.prompt_token_ids == list(range(55, 60)) and set(out.outputs[0].token_ids) <= {70, 71}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        default_llm.generate("x", SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):  # (as vLLM: not taken as "no truncation")
        default_llm.generate("x", SamplingParams(truncate_prompt_tokens=10**6), use_tqdm=False)


def _holds(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_never_appear_in_the_output(default_llm):
    """vLLM's bad_words: a word of two tokens and one of a single token that greedy decoding
    produces are never produced with them banned (in any of their tokenized forms)."""
    tok = default_llm.tokenizer
    greedy = dict(max_tokens=32, temperature=0.0, ignore_eos=True)
    free = default_llm.generate("bad words", SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids

    def word(ids: list[int]) -> bool:  # text that tokenizes back to these ids, without leading spaces
        text = tok.decode(ids)
        return text == text.lstrip() and text.strip() and tok.encode(text, add_special_tokens=False) == ids

    pair = next(free[i:i + 2] for i in range(len(free) - 1) if word(free[i:i + 2]))
    single = next([t] for t in free if [t] != pair[:1] and word([t]))
    for banned in (pair, single):  # one at a time: the output is the free one up to the word
        params = SamplingParams(**greedy, bad_words=[tok.decode(banned)])
        out = default_llm.generate("bad words", params, use_tqdm=False)[0].outputs[0].token_ids
        derived = RequestSampling.of(params, lambda text: tok.encode(text, add_special_tokens=False),
                                     default_llm.engine.model_config.vocab_size)
        assert tuple(banned) in derived.bad_words_token_ids and derived.needs_last_tokens == (len(banned) == 2)
        assert not any(_holds(out, list(ids)) for ids in derived.bad_words_token_ids)
        assert params == SamplingParams(**greedy, bad_words=[tok.decode(banned)])  # generate left it as it was
        first = next(i for i in range(len(free)) if free[i:i + len(banned)] == banned)
        assert out[:first + len(banned) - 1] == free[:first + len(banned) - 1] and len(out) == 32


def test_beam_search_as_vllms(default_llm, monkeypatch):
    """LLM.beam_search: width 1 is greedy decoding; wider, the beams come best first, each with the
    cumulative logprob of its tokens under the model (recomputed here as prompt logprobs), and a
    beam that reaches EOS is complete. A beam's text is that of all its tokens, as in vLLM's."""
    import dataclasses

    from jaxserve import BeamSearchParams

    prompt = [11, 12, 13]
    greedy = default_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                           logprobs=0), use_tqdm=False)[0].outputs[0]
    (one,) = default_llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=6))[0].sequences
    assert one.tokens == prompt + greedy.token_ids and abs(one.cum_logprob - greedy.cumulative_logprob) < 1e-4
    assert one.text == default_llm.tokenizer.decode(one.tokens) and one.finish_reason == "length"
    (out,) = default_llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))
    scores = [s.cum_logprob / len(s.tokens) for s in out.sequences]
    assert len(out.sequences) == 3 and scores == sorted(scores, reverse=True) and len({tuple(s.tokens) for s in out.sequences}) == 3
    for seq in out.sequences:
        (again,) = default_llm.generate([seq.tokens], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        recomputed = sum(entry[t].logprob for t, entry in zip(seq.tokens[3:], again.prompt_logprobs[3:]))
        assert abs(recomputed - seq.cum_logprob) < 1e-3 and len(seq.logprobs) == 6
    eos = greedy.token_ids[2]
    config = default_llm.engine.model_config
    monkeypatch.setattr(default_llm.engine, "model_config", dataclasses.replace(config, eos_token_ids=(eos,)))
    (ended,) = default_llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6))
    stopped = [s for s in ended.sequences if s.finish_reason == "stop"]
    assert stopped and all(s.tokens[-1] == eos and s.stop_reason == eos and len(s.tokens) <= 9 for s in stopped)
    assert all(s.text == default_llm.tokenizer.decode(s.tokens) for s in stopped)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)


def test_structured_outputs_offline_as_vllms(default_llm):
    """vLLM's `SamplingParams(structured_outputs=StructuredOutputsParams(...))`: the output follows
    the choice or regex and the sequence stops once it is complete; exactly one kind per request."""
    import re

    from jaxserve import GuidedDecodingParams, StructuredOutputsParams

    choice, regex = default_llm.generate(["a", "b"], [
        SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        # vLLM's older names, and its backend switches (what jaxserve does anyway)
        SamplingParams(max_tokens=20, seed=1, guided_decoding=GuidedDecodingParams(
            regex="[a-z]{3,6}", disable_any_whitespace=True, disable_additional_properties=True))],
        use_tqdm=False)
    assert choice.outputs[0].text in ("yes", "no") and choice.outputs[0].finish_reason == "stop"
    assert re.fullmatch("[a-z]{3,6}", regex.outputs[0].text) and regex.outputs[0].finish_reason == "stop"
    # allowed tokens the grammar never allows: the drawn token is refused, the sequence ends ("abort") without
    # its text, the text before it kept
    (dead_end,) = default_llm.generate(["c"], SamplingParams(max_tokens=5, allowed_token_ids=[100, 101],
                                                             structured_outputs=StructuredOutputsParams(choice=["yes"])),
                                       use_tqdm=False)
    assert (dead_end.outputs[0].text, dead_end.outputs[0].finish_reason) == ("", "abort")
    assert len(dead_end.outputs[0].token_ids) == 1
    # its fields as a dict; a grammar in GBNF (llama.cpp's, vLLM's default backend's) as well as Lark
    yes_no, gbnf = default_llm.generate(["d", "e"], [
        SamplingParams(max_tokens=20, structured_outputs={"choice": ["yes", "no"]}),
        SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(grammar='root ::= "ab" [0-9]+'))],
        use_tqdm=False)
    assert yes_no.outputs[0].text in ("yes", "no") and re.fullmatch("ab[0-9]+", gbnf.outputs[0].text)
    with pytest.raises(ValueError, match="one kind"):  # (as vLLM's: when it is made)
        StructuredOutputsParams(regex="a", choice=["a"])
    for wrong, match in ((StructuredOutputsParams(), "exactly one"), ({"regexp": "a"}, "regexp"),
                         ("a+", "StructuredOutputsParams or a dict"),
                         (StructuredOutputsParams(regex="a", whitespace_pattern=" "), "whitespace_pattern")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(structured_outputs=wrong)


def test_detokenize_false_gives_token_ids_alone(default_llm):
    """vLLM's `detokenize=False`: the same tokens, no text, logprobs without decoded tokens; stop
    strings (found in the text) need the text."""
    greedy = dict(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    (text,) = default_llm.generate(["hello"], SamplingParams(**greedy), use_tqdm=False)
    (ids,) = default_llm.generate(["hello"], SamplingParams(**greedy, detokenize=False), use_tqdm=False)
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids and text.outputs[0].text
    assert ids.outputs[0].text == "" and all(lp.decoded_token is None for entry in ids.outputs[0].logprobs
                                             for lp in entry.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_vllm_engine_options_and_request_arguments(default_llm, tmp_path):
    """vLLM's engine options and per-request arguments: taken where they change nothing here,
    a ValueError that names what is not supported where they would. And vLLM's profiling: a trace
    of the process between start_profile and stop_profile, written where profiler_config says."""
    llm = LLM("jaxserve-tiny", **SMALL_ENGINE, enforce_eager=True, disable_log_stats=True, swap_space=4, enable_chunked_prefill=True,
              distributed_executor_backend="mp", quantization=None, revision=None, task="generate",
              enable_lora=False, max_logprobs=3, override_generation_config={"temperature": 0.0, "max_new_tokens": 5},
              max_num_partial_prefills=1, long_prefill_token_threshold=4,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    llm.start_profile()
    with pytest.raises(ValueError, match="already being taken"):
        llm.start_profile()
    (out,) = llm.generate("hello", lora_request=None, priority=[0], use_tqdm=False)
    llm.stop_profile()
    with pytest.raises(ValueError, match="no profile is being taken"):
        llm.stop_profile()
    traces = [path.name for path in tmp_path.glob("plugins/profile/*/*")]
    assert any(name.endswith(".xplane.pb") for name in traces)
    assert "perfetto_trace.json.gz" in traces
    with pytest.raises(RuntimeError, match="Profiler is not enabled"):
        default_llm.start_profile()
    # vLLM's LLM.get_metrics(): the engine's figures as its metric reader gives them; the prompt in
    # chunks of at most long_prefill_token_threshold (4) tokens, then a step a token
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:generation_tokens"].value == 5 and metrics["vllm:num_requests_running"].value == 0
    assert metrics["vllm:prompt_tokens"].value == len(out.prompt_token_ids)
    steps = metrics["vllm:iteration_tokens_total"]
    assert steps.sum == len(out.prompt_token_ids) + 4 and steps.count == -(-len(out.prompt_token_ids) // 4) + 4
    assert steps.buckets["8.0"] == steps.count and steps.buckets["+Inf"] == steps.count  # (bounds 1, 8, 16, 32)
    assert metrics["vllm:cache_config_info"].labels["block_size"] == str(SMALL_ENGINE.get("page_size", 16))
    # ... and the requests' own, as vLLM's reader gives them (generate's one request: 5 tokens, "length")
    assert metrics["vllm:request_success"].labels == {"model_name": "jaxserve-tiny", "finished_reason": "length"}
    assert metrics["vllm:request_success"].value == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prefill_time_seconds"):
        assert metrics[f"vllm:{name}"].count == 1 and metrics[f"vllm:{name}"].buckets["+Inf"] == 1
    assert metrics["vllm:e2e_request_latency_seconds"].sum >= metrics["vllm:time_to_first_token_seconds"].sum > 0
    assert metrics["vllm:inter_token_latency_seconds"].count == 4  # (the 4 tokens after the first)
    generated = metrics["vllm:request_generation_tokens"]
    assert (generated.sum, generated.buckets["2.0"], generated.buckets["5.0"]) == (5, 0, 1)
    assert metrics["vllm:request_prompt_tokens"].sum == len(out.prompt_token_ids)
    assert not any(name.startswith("jaxserve:") for name in metrics)
    want = default_llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids and len(want.outputs[0].token_ids) == 5
    assert (out.lora_request, out.metrics, out.encoder_prompt, out.outputs[0].lora_request) == (None,) * 4
    with pytest.raises(ValueError, match="more than max_logprobs"):
        llm.generate("hello", SamplingParams(logprobs=4))
    for options, match in ((dict(quantization="awq"), "quantization='awq' is not supported"),
                           (dict(enable_lora=True, batch_invariant=True), "LoRA|lora"),
                           (dict(pipeline_parallel_size=2), "pipeline"),
                           (dict(task="embed"), "generates text"), (dict(max_logprobs=-2), "max_logprobs"),
                           (dict(override_generation_config={"do_sample": True}), "do_sample"),
                           (dict(max_num_partial_prefills=2), "partial prefills"),
                           (dict(profiler_config={"profiler": "cuda"}), "profiler must be one of torch, jax"),
                           (dict(profiler_config={"profiler": "torch"}), "torch_profiler_dir must name"),
                           (dict(profiler_config={"torch_profiler_with_stack": True}), "'torch_profiler_with_stack' "
                            "not supported")):
        with pytest.raises(ValueError, match=match):
            LLM("jaxserve-tiny", **SMALL_ENGINE, **options)
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(no_such_option=1)
    with pytest.raises(ValueError, match="LoRARequest"):
        default_llm.generate("x", lora_request=object())
    with pytest.raises(ValueError, match="serves no adapters"):
        default_llm.generate("x", lora_request=LoRARequest("a", 1, "/adapters/a"))
    with pytest.raises(ValueError, match="priority scheduling"):
        default_llm.generate(["x", "y"], priority=[0, 1])
    with pytest.raises(ValueError, match="embedding model"):
        default_llm.embed("x")
    for pooling in (default_llm.encode, default_llm.score, default_llm.classify):
        with pytest.raises(ValueError, match="embeddings only"):
            pooling("x")
    # vLLM's prompt types and Logprob
    prompts = [TextPrompt(prompt="hello"), TokensPrompt(prompt_token_ids=[5, 6, 7])]
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)
    assert outs[0].prompt == "hello" and outs[1].prompt_token_ids == [5, 6, 7]
    assert all(isinstance(lp, Logprob) for step in outs[0].outputs[0].logprobs for lp in step.values())


def test_vllm_sampling_fields(default_llm):
    """vLLM's SamplingParams fields that shape how outputs are delivered: generate returns the
    finished outputs whatever `output_kind` is, and the same logprobs with `flat_logprobs`."""
    base = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    want = default_llm.generate("kinds", base, use_tqdm=False)[0].outputs[0]
    for kind in RequestOutputKind:
        params = dataclasses.replace(base, output_kind=kind, flat_logprobs=True, extra_args={"tag": 1})
        got = default_llm.generate("kinds", params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs and got.finished()
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=[1])


def test_a_failing_step_raises_and_the_next_generate_runs(default_llm, monkeypatch):
    from jaxserve.errors import StepFailed

    engine = default_llm.engine
    monkeypatch.setattr(engine.runner, "launch", lambda *step: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(StepFailed, match="injected") as failed:
        default_llm.generate(["a", "b"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert not engine.has_unfinished() and engine.stats.kv_pages_used == 0
    monkeypatch.undo()
    out = default_llm.generate([{"prompt": "a", "cache_salt": "s"}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_request_arriving_while_a_step_computes_joins_the_step_planned_behind_it(default_llm):
    """A server's `arrivals` come once the step in flight has computed; on the CPU the step planned
    behind it is launched only then, with them in it, and each row gets the tokens it gets alone.
    Behind a lone sequence's step the next is launched at once, as without a server."""
    needs_cpu_backend()
    engine = default_llm.engine
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [3, 4], [9, 10, 11]]
    alone = [out.outputs[0].token_ids for out in default_llm.generate(prompts, greedy, use_tqdm=False)]
    computed, seqs = [], []

    def arrivals():
        computed.append(engine._in_flight.launched.samples.is_ready())
        seqs.append(engine.add_request(f"late{len(seqs)}", prompts[len(seqs)], greedy))
        return True
    seqs.append(engine.add_request("running", prompts[0], greedy))
    engine.step(), engine.step()  # (its prompt's step, then its first decode step in flight)
    engine.step(arrivals=arrivals)  # (a lone sequence's step: nothing waits, nothing is added)
    assert computed == [] and len(engine._in_flight.batch.rows) == 1
    seqs.append(engine.add_request("second", prompts[1], greedy))
    engine.step(), engine.step()
    engine.step(arrivals=arrivals)
    assert engine.runner.shares_host and computed == [True]
    rows = engine._in_flight.batch.rows
    assert [(row.seq_id, row.pending_row) for row in rows] == [(seqs[0].seq_id, 0), (seqs[1].seq_id, 1),
                                                               (seqs[2].seq_id, -1)]
    assert engine._in_flight.batch.num_tokens == 5
    while engine.has_unfinished():
        engine.step(arrivals=lambda: False)
    assert [seq.output_token_ids for seq in seqs] == alone


def test_a_server_adds_the_requests_sent_mid_step_up_to_its_first_other_command(default_llm):
    """`AsyncEngine._add_arrivals`: what follows another command waits with it for the step's end, so
    commands apply in the order sent (here an abort between two sends of one request id)."""
    loop = asyncio.new_event_loop()
    server = AsyncEngine(default_llm.engine, default_llm.tokenizer)  # (its thread not started)
    greedy = SamplingParams(max_tokens=2, temperature=0)

    def add(prompt):
        return Add("again", prompt, greedy, Subscriber(loop, asyncio.Queue(), 1))
    for command in (add([5, 6]), Abort("again"), add([7, 8, 9])):
        server._commands.put(command)
    assert server._add_arrivals() and server._deferred == Abort("again")
    assert [seq.prompt_token_ids for seq in default_llm.engine.scheduler.waiting] == [[5, 6]]
    assert not server._add_arrivals()
    server._apply_commands()
    assert [seq.prompt_token_ids for seq in default_llm.engine.scheduler.waiting] == [[7, 8, 9]]
    assert server._deferred is None and server._commands.empty()
    default_llm.engine.abort("again")
    loop.close()


def test_a_step_of_prompts_alone_is_finished_before_the_next_is_planned(default_llm):
    """Its first tokens go out before the next step's host work: the decode step after it is planned
    with each token known; a decode step is still followed by one planned ahead of its token."""
    engine = default_llm.engine
    engine.add_request("alone", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert engine.step() == []  # (the prompt's step launched)
    assert engine._in_flight.batch.prefill_only
    released = engine.step()
    assert len(released) == 1 and engine._in_flight.batch.rows[0].pending_row == -1
    engine.step()
    assert not engine._in_flight.batch.prefill_only and engine._in_flight.batch.rows[0].pending_row == 0
    while engine.has_unfinished():
        engine.step()


def _successes(llm) -> dict[str, int]:
    return {m.labels["finished_reason"]: m.value for m in llm.get_metrics() if m.name == "vllm:request_success"}


def test_llm_engine_steps_requests_as_vllms(default_llm):
    """`LLM.llm_engine`, vLLM's add_request / step loop: the same tokens as `generate`; each request's
    outputs as its output_kind asks (cumulative, deltas that join into the whole, the finished one
    alone); an aborted request gives no more outputs; ids in use and SamplingParams' absence refused."""
    engine = default_llm.llm_engine
    greedy = dict(max_tokens=5, temperature=0.0, ignore_eos=True)
    whole = default_llm.generate("hello", SamplingParams(**greedy, logprobs=1), use_tqdm=False)[0].outputs[0]
    kinds = {"c": RequestOutputKind.CUMULATIVE, "d": RequestOutputKind.DELTA, "f": RequestOutputKind.FINAL_ONLY}
    before = _successes(default_llm)
    for request_id, kind in kinds.items():
        engine.add_request(request_id, "hello", SamplingParams(**greedy, logprobs=1, output_kind=kind))
    engine.add_request("gone", {"prompt": "hello"}, SamplingParams(max_tokens=50, ignore_eos=True))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("c", "hello", SamplingParams())
    with pytest.raises(RuntimeError, match="llm_engine"):
        default_llm.generate("hello", use_tqdm=False)
    seen: dict[str, list] = {request_id: [] for request_id in (*kinds, "gone")}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
        if seen["gone"] and engine.get_num_unfinished_requests() == 4:
            engine.abort_request(["gone", "not-an-id"])
    assert len(seen["gone"]) == 1 and not engine.has_unfinished_requests()
    after = _successes(default_llm)  # (get_metrics counts them: three at their length, one aborted)
    assert [after.get(r, 0) - before.get(r, 0) for r in ("length", "abort")] == [3, 1]
    cumulative, delta, final = (seen[request_id] for request_id in kinds)
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 6)) and cumulative[-1].finished
    assert cumulative[-1].outputs[0].token_ids == whole.token_ids and cumulative[-1].outputs[0].text == whole.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == whole.token_ids
    assert "".join(o.outputs[0].text for o in delta) == whole.text and [o.finished for o in delta][-1]
    assert sum(len(o.outputs[0].logprobs) for o in delta) == 5
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == whole.token_ids
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("x", "hello", None)
    assert default_llm.generate("hello", SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids == \
        whole.token_ids  # (generate runs again once the engine's requests are done)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())  # (vLLM's example's command line)
    flags = ["--model", "jaxserve-tiny", "--enforce-eager",
             *(f"--{name.replace('_', '-')}={value}" for name, value in SMALL_ENGINE.items())]
    args = EngineArgs.from_cli_args(parser.parse_args(flags))
    assert (args.model, args.enforce_eager, args.max_model_len) == ("jaxserve-tiny", True,
                                                                    SMALL_ENGINE["max_model_len"])
    args.max_num_seqs = 4  # (set afterwards: taken too)
    built = LLMEngine.from_engine_args(args)  # (vLLM's other way in)
    assert built.engine.config.max_num_seqs == 4
    built.add_request("0", {"prompt_token_ids": whole.token_ids}, SamplingParams(max_tokens=2))
    while built.has_unfinished_requests():
        outs = built.step()
    assert outs[0].finished and len(outs[0].outputs[0].token_ids) == 2 and built.get_tokenizer() is not None


def test_llm_engine_choices_new_weights_and_failed_steps(default_llm, monkeypatch):
    """llm_engine with n > 1: as vLLM's, a DELTA or CUMULATIVE output per choice that moved, its
    `outputs` that choice alone (the prompt's logprobs in the first); new weights between two steps
    keep what the step in flight released for the next; a failed step ends its requests."""
    from jaxserve.errors import StepFailed

    engine = default_llm.llm_engine
    greedy = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    whole = default_llm.generate("hello", SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    engine.add_request("n", "hello", SamplingParams(**greedy, n=2, logprobs=1, prompt_logprobs=1,
                                                     output_kind=RequestOutputKind.DELTA))
    outs = []
    for k in range(20):
        if k == 2:  # (the rollout engine's weights, the same ones, pushed between two steps)
            default_llm.update_weights(default_llm.get_weights())
        outs += engine.step()
        if not engine.has_unfinished_requests():
            break
    assert all(len(o.outputs) == 1 for o in outs) and outs[-1].finished
    for index in (0, 1):
        assert [t for o in outs if o.outputs[0].index == index for t in o.outputs[0].token_ids] == whole.token_ids
    assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
    engine.add_request("fails", "hello", SamplingParams(max_tokens=8))
    monkeypatch.setattr(default_llm.engine.runner, "launch", lambda *step: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(StepFailed):
        for _ in range(3):
            engine.step()
    assert not engine.has_unfinished_requests()  # (ended: a loop on it stops)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="LoRARequest"):
        engine.add_request("lora", "hello", SamplingParams(), lora_request="adapter")


class RpcExtension:
    """A `worker_extension_cls`, as an RL trainer's: its methods reach the replica and each other."""

    def seed_and_double(self, x):
        return self.config.seed, self.double(x)

    def double(self, x):
        return 2 * x


def test_enqueue_tokenization_and_worker_calls_as_vllms(default_llm, monkeypatch):
    """vLLM 0.32's LLM: enqueue / wait_for_completion (outputs in the order added, a refused prompt
    refusing its call alone), tokenization_kwargs (truncation's sides, add_special_tokens; chat's
    default off), a priority for all prompts, collective_rpc / apply_model on each replica's worker
    (a callable, a method of worker_extension_cls), get_world_size, from_engine_args."""
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    alone = [default_llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in ("hi", "a b")]
    assert all(isinstance(i, str) for i in default_llm.enqueue(["hi"], greedy, use_tqdm=False))
    first = default_llm.enqueue(["a b"], greedy, use_tqdm=False)
    with pytest.raises(ValueError):
        default_llm.enqueue(["hi", 7], greedy, use_tqdm=False)  # (the first of this call is dropped too)
    with pytest.raises(RuntimeError, match="wait_for_completion"):
        default_llm.llm_engine.add_request("x", "hi", greedy)
    outs = default_llm.wait_for_completion(use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone and outs[1].request_id == first[0]
    assert default_llm.wait_for_completion(RequestOutput, use_tqdm=False) == []
    ids = list(range(3, 11))
    cut = {side: default_llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False, priority=0,
                                      tokenization_kwargs={"truncation": True, "max_length": 3,
                                                           "truncation_side": side})[0].prompt_token_ids
           for side in ("right", "left")}
    assert cut == {"right": ids[:3], "left": ids[-3:]}
    flags = []
    encode = default_llm.tokenizer.encode
    monkeypatch.setattr(default_llm.tokenizer, "encode", lambda text, add_special_tokens=True:
                        flags.append(add_special_tokens) or encode(text, add_special_tokens))
    default_llm.generate("hi", greedy, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})
    default_llm.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False)
    default_llm.generate("hi", greedy, use_tqdm=False)
    assert flags == [False, False, True]
    with pytest.raises(ValueError, match="padding"):
        default_llm.generate("hi", tokenization_kwargs={"padding": "longest"})
    with pytest.raises(ValueError, match="priority"):
        default_llm.generate(["hi", "a"], greedy, use_tqdm=False, priority=1)  # (one for both; not enabled)
    assert default_llm.collective_rpc(lambda worker, k: (type(worker).__name__, k), kwargs={"k": 1}) == \
        [("Worker", 1)]
    assert default_llm.apply_model(lambda model: type(model).__name__) == ["LlamaDecoder"]
    with pytest.raises(TimeoutError):
        default_llm.collective_rpc(lambda worker: time.sleep(2), timeout=0.05)
    with pytest.raises(ValueError, match="worker_extension_cls"):
        default_llm.collective_rpc("update_weights")
    assert default_llm.get_world_size() == 1 and default_llm.wake_up() is True
    extended = LLM.from_engine_args(EngineArgs("jaxserve-tiny", **SMALL_ENGINE, seed=5,
                                               worker_extension_cls=f"{__name__}.RpcExtension"))
    assert extended.collective_rpc("seed_and_double", args=(4,), timeout=60) == [(5, 8)]
    with pytest.raises(ValueError, match="cannot be imported"):
        LLM("jaxserve-tiny", **SMALL_ENGINE, worker_extension_cls="no_such_module.Extension")

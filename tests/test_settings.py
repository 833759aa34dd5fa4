"""Settings declared once: EngineConfig's fields make run_server.py's engine flags, `LLM`'s keyword
arguments and docs/cli.md, and the command line keeps every flag and default it had."""

from __future__ import annotations

import argparse
import inspect
import socket

import pytest

import run_server
from jaxserve.config.engine import EngineConfig
from jaxserve.config.fields import fields, flag_name
from jaxserve.config.vllm import VLLM_OPTIONS
from jaxserve.engine.chat_template import check_chat_template
from jaxserve.llm import LLM

# Every flag (option strings) of `python run_server.py` and its default, as they stood when the flags
# were first made from EngineConfig: later changes may add flags, never drop or change one of these.
FLAGS = {
    ("--enable-log-requests", "--no-enable-log-requests"): False,
    ("--disable-log-requests",): True,  # (the store_false action's own; the option's default is False)
    ('--model',): None,
    ('--served-model-name',): None,
    ('--tokenizer',): None,
    ('--host',): '127.0.0.1',
    ('--port',): 8000,
    ('--dtype',): 'auto',
    ('--kv-cache-dtype',): 'auto',
    ('--max-model-len',): None,
    ('--max-num-seqs',): 64,
    ('--max-num-batched-tokens',): 512,
    ('--long-prefill-token-threshold',): 0,
    ('--page-size', '--block-size'): 16,
    ('--num-pages',): None,
    ('--kv-cache-memory-fraction', '--gpu-memory-utilization'): None,
    ('--seed',): 0,
    ('--logprobs-mode',): 'raw_logprobs',
    ('--tensor-parallel-size', '-tp'): 1,
    ('--coordinator-address',): None,
    ('--num-processes',): None,
    ('--process-id',): None,
    ('--distributed',): False,
    ('--distributed-timeout',): 100,
    ('--ray-address',): None,
    ('--ray-hosts-per-replica',): 1,
    ('--ray-bundle',): None,
    ('--kv-events-config',): None,
    ('--profiler-config',): None,
    ('--data-parallel-size', '-dp'): 1,
    ('--data-parallel-backend',): 'thread',
    ('--enable-expert-parallel',): False,
    ('--enable-prefix-caching', '--no-enable-prefix-caching'): True,
    ('--generation-config',): 'auto',
    ('--override-generation-config',): None,
    ('--max-logprobs',): 20,
    ('--warmup',): 'auto',
    ('--page-table-widths',): 'auto',
    ('--batch-invariant',): False,
    ('--enforce-eager',): None,
    ('--disable-custom-all-reduce',): None,
    ('--async-scheduling',): None,
    ('--skip-tokenizer-init', '--no-skip-tokenizer-init'): False,
    ('--enable-lora',): False,
    ('--enable-chunked-prefill', '--no-enable-chunked-prefill'): None,
    ('--max-seq-len-to-capture',): None,
    ('--max-loras',): 1,
    ('--max-lora-rank',): 16,
    ('--max-cpu-loras',): None,
    ('--max-hidden-states-layers',): 8,
    ('--max-steering-slots',): 8,
    ('--steering-vectors',): (),
    ('--control-vector',): (),
    ('--control-vector-scaled',): (),
    ('--control-vector-layer-range',): None,
    ('--lora-modules',): None,
    ('--allow-runtime-lora-updating',): False,
    ('--pipeline-parallel-size', '-pp'): None,
    ('--kv-cache-memory-bytes',): None,
    ('--max-num-partial-prefills',): None,
    ('--max-long-partial-prefills',): None,
    ('--swap-space',): None,
    ('--cpu-offload-gb',): None,
    ('--compilation-config', '-O'): None,
    ('--hf-overrides',): None,
    ('--speculative-config',): None,
    ('--kv-transfer-config',): None,
    ('--mm-processor-kwargs',): None,
    ('--limit-mm-per-prompt',): None,
    ('--download-dir',): None,
    ('--hf-token',): None,
    ('--distributed-executor-backend',): None,
    ('--allowed-local-media-path',): None,
    ('--quantization', '-q'): None,
    ('--revision',): None,
    ('--tokenizer-revision',): None,
    ('--code-revision',): None,
    ('--tokenizer-mode',): None,
    ('--load-format',): None,
    ('--task',): None,
    ('--runner',): 'auto',
    ('--pooler-config',): None,
    ('--convert',): None,
    ('--scheduling-policy',): 'fcfs',  # (was None, read as fcfs: the same default)
    ('--logits-processors',): (),
    ('--chat-template',): None,
    ('--chat-template-content-format',): 'auto',
    ('--trust-request-chat-template',): False,
    ('--log-level',): 'info',
    ('--api-key',): None,
    ('--tool-call-parser',): None,
    ('--return-tokens-as-token-ids',): False,
    ('--response-role',): 'assistant',
    ('--enable-force-include-usage',): False,
    ('--enable-prompt-tokens-details',): False,
    ('--enable-server-load-tracking',): False,
    ('--disable-uvicorn-access-log',): False,
    ('--disable-fastapi-docs',): False,
    ('--disable-playground', '--no-webui'): False,
    ('--disable-frontend-multiprocessing',): False,
    ('--uvicorn-log-level',): None,
    ('--reasoning-parser',): None,
    ('--enable-auto-tool-choice', '--no-enable-auto-tool-choice'): True,
    ('--disable-log-stats',): False,
    ('--config',): None,
    ('--enable-request-id-headers',): False,
    ('--root-path',): None,
    ('--enable-sleep-mode',): False,
    ('--log-stats-interval',): 10.0,
    ('--max-num-queued-reqs',): None,
    ('--max-num-queued-tokens',): None,
    ('--shutdown-timeout',): 0.0,
    ('--allowed-origins',): ['*'],
    ('--allowed-methods',): ['*'],
    ('--allowed-headers',): ['*'],
    ('--allow-credentials',): False,
    ('--max-request-body-bytes',): 16 * 1024 * 1024,
    ('--max-stored-responses',): 1000,
    ('--chat-template-timeout',): 10.0,
    ('--ssl-keyfile',): None,
    ('--ssl-certfile',): None,
    ('--ssl-ca-certs',): None,
    ('--ssl-cert-reqs',): 0,
    ('--trust-remote-code',): False,
}


def _parser_flags() -> dict[tuple[str, ...], object]:
    return {tuple(a.option_strings): a.default for a in run_server.build_parser()._actions if a.option_strings}


def test_command_line_keeps_every_flag_and_default():
    flags = _parser_flags()
    missing = [f for f in FLAGS if f not in flags]
    assert not missing, f"flags dropped: {missing}"
    changed = {f: (FLAGS[f], flags[f]) for f in FLAGS if flags[f] != FLAGS[f]}
    assert not changed, f"defaults changed (before, now): {changed}"
    assert set(flags) - set(FLAGS) - {("-h", "--help")} == set(), "a new flag: add it to FLAGS"


def test_engine_flags_are_engine_config_fields():
    """Each EngineConfig field with a flag: --its-name, its default, parsed into the config."""
    args = run_server.parse_args([])
    assert args.engine == EngineConfig()
    flags = _parser_flags()
    for field in fields(EngineConfig):
        if not field.metadata["setting"]["cli"]:
            continue
        names = next(names for names in flags if flag_name(field.name) in names)
        assert flags[names] == field.default, field.name
    args = run_server.parse_args(["--block-size", "32", "-tp", "2", "--no-enable-prefix-caching",
                                  "--override-generation-config", '{"temperature": 0.5}', "--dtype", "bfloat16"])
    assert args.engine == EngineConfig(page_size=32, tensor_parallel_size=2, enable_prefix_caching=False,
                                       override_generation_config={"temperature": 0.5}, dtype="bfloat16")


def test_a_bad_engine_flag_is_named_as_the_flag(capsys):
    with pytest.raises(SystemExit):
        run_server.parse_args(["--max-logprobs", "-2"])
    assert "--max-logprobs must be -1 (no cap) or >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_server.parse_args(["--quantization", "awq"])
    assert "--quantization='awq' is not supported" in capsys.readouterr().err


def test_vllm_spellings_keys_and_chat_template_paths(capsys, monkeypatch, tmp_path):
    """Flags with underscores (vLLM's parser takes them); several --api-key keys, else $JAXSERVE_API_KEY,
    else vLLM's $VLLM_API_KEY; a --chat-template that looks like a path but names no file, a
    negative --seed: each an error that names the flag, before any model is loaded."""
    args = run_server.parse_args(["--max_model_len", "64", "--served_model_name=a", "--api-key", "k1", "k2"])
    assert args.engine.max_model_len == 64 and args.served_model_name == ["a"]
    assert run_server.api_keys(args) == ["k1", "k2"]
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    assert run_server.api_keys(run_server.parse_args([])) == ["vk"]
    monkeypatch.setenv("JAXSERVE_API_KEY", "jk")
    assert run_server.api_keys(run_server.parse_args([])) == ["jk"]
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert run_server.parse_args(["--chat-template", str(template)]).chat_template == template.read_text()
    assert run_server.parse_args(["--chat-template", "{{ 'x' }}"]).chat_template == "{{ 'x' }}"
    inline = r"{% for m in messages %}{{ m['content'] }}\n{% endfor %}é→"  # (as a shell passes `\n`)
    assert run_server.parse_args(["--chat-template", inline]).chat_template == inline.replace("\\n", "\n")
    for flags, said in ((["--chat-template", str(tmp_path / "missing.jinja")], "--chat-template: "),
                        (["--seed", "-1"], "--seed must be >= 0")):
        with pytest.raises(SystemExit):
            run_server.parse_args(flags)
        assert said in capsys.readouterr().err
    config = tmp_path / "config.yaml"  # (vLLM's --config: its flags, the command line's winning)
    config.write_text("model: jaxserve-tiny\nmax_model_len: 64\nenable_prefix_caching: false\n"
                      "served_model_name: [a, b]\ndisable_log_stats: false\noverride_generation_config: {top_k: 3}\n")
    args = run_server.parse_args(["--config", str(config), "--max-model-len", "128"])
    assert (args.model, args.engine.max_model_len, args.engine.enable_prefix_caching, args.served_model_name,
            args.disable_log_stats, args.override_generation_config) == ("jaxserve-tiny", 128, False, ["a", "b"],
                                                                         False, {"top_k": 3})
    with pytest.raises(SystemExit):
        run_server.parse_args([f"--config={tmp_path / 'missing.yaml'}"])
    assert "--config: " in capsys.readouterr().err
    with pytest.raises(ValueError, match="the chat template does not compile: Encountered unknown tag 'bad'"):
        check_chat_template("{%bad")  # (the tokenizer checks a given template: the server fails as it starts)
    check_chat_template("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}")  # (transformers' tag)


def test_a_port_in_use_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit, match="cannot listen on 127.0.0.1"):
            run_server.check_port("127.0.0.1", taken.getsockname()[1])
    run_server.check_port("127.0.0.1", 0)  # (a free one passes)


def test_llm_keyword_arguments_are_engine_config_fields():
    params = inspect.signature(LLM.__init__).parameters
    for field in fields(EngineConfig):
        if field.metadata["setting"]["cli"]:
            assert params[field.name].default == field.default, field.name
        for alias in field.metadata["setting"]["aliases"]:
            assert alias in params
    assert set(VLLM_OPTIONS) <= set(params)
    assert EngineConfig.from_options(block_size=32, gpu_memory_utilization=0.5, max_num_seqs=None) == \
        EngineConfig(page_size=32, kv_cache_memory_fraction=0.5)
    with pytest.raises(ValueError, match="one setting"):
        EngineConfig.from_options(page_size=16, block_size=32)
    with pytest.raises(TypeError, match="no_such_option"):
        EngineConfig.from_options(no_such_option=1)


def test_cli_reference_is_current():
    """docs/cli.md is made from the parser: `make docs` after changing a flag."""
    assert run_server.CLI_REFERENCE.read_text() == run_server.cli_reference(), "docs/cli.md is stale: make docs"
    for action in run_server.build_parser()._actions:
        if not isinstance(action, argparse._HelpAction):
            assert f"`{(action.option_strings or [action.metavar])[0]}`" in run_server.CLI_REFERENCE.read_text()


def test_step_buckets_hold_a_decode_batch_and_a_prompt_in_half_the_sequence_rows():
    """From 64 tokens on, a token bucket takes its full count of sequence rows, a sixteenth of its
    tokens (a few long chunks) and, with `fine_buckets` (build_engine's on CPU), half the full
    count (the running sequences and a new prompt), where those are fewer and not under the sixteenth;
    under 64 tokens only the full count. `fine_buckets` also puts token buckets halfway between the
    powers of two from 128 on: a decode batch of 31 and a 128-token prompt take 192 rows, not 256."""
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=512)
    assert [config.seqs_buckets(t) for t in config.token_buckets] == [
        (1,), (4,), (16,), (32,), (4, 64), (8, 64), (16, 64), (32, 64)]
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=512, fine_buckets=True)
    assert config.token_buckets == (1, 4, 16, 32, 64, 128, 192, 256, 384, 512)
    assert [config.seqs_buckets(t) for t in config.token_buckets] == [
        (1,), (4,), (16,), (32,), (4, 32, 64), (8, 32, 64), (12, 32, 64), (16, 32, 64), (24, 32, 64), (32, 64)]
    assert EngineConfig(max_num_seqs=6, max_num_batched_tokens=64, fine_buckets=True).seqs_buckets(64) == (4, 6)
    assert EngineConfig(max_num_batched_tokens=600, fine_buckets=True).token_buckets[-4:] == (256, 384, 512, 600)
    wide = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, fine_buckets=True)
    assert wide.seqs_buckets(1024) == (64,) and wide.token_buckets[-3:] == (1024, 1536, 2048)

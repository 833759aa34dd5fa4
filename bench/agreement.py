"""How closely the default model as served (its GGUF blocks kept quantized) follows the float model,
and whether how a prompt is split into steps changes its answers.

    python bench/agreement.py    # 40 chat prompts, 32 tokens each: a JSON object, then bench/RESULTS.md's table

The float reference is the same file dequantized to float32 (`quantization="none"`, which the tests
compare with transformers). Its greedy answer to each prompt, appended to the prompt, is read back
teacher-forced through `prompt_logprobs` (the top 20 at every position) by the engine as served
(bfloat16 activations, quantized products), once with the whole sequence in one step and once split
into steps of 4 tokens (as when a server's first step shapes still compile, or under load). Over
every answer position, near ties included: top-1 agreement with the float model, mean KL(float ||
served) over the float model's top 20 (the rest of each distribution lumped together), and how often
the two splits disagree on the top token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import machine_line  # noqa: E402

PROMPTS = [
    "What is the capital of France?", "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.", "List three prime numbers.", "Hi!", "Explain what a CPU cache is.",
    "Translate 'good morning' into French.", "What is 12 times 7?", "Name a painting by Leonardo da Vinci.",
    "Give me a synonym for happy.", "What colour is the sky on a clear day?", "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?", "Suggest a name for a cat.", "What is the boiling point of water?",
    "Write a Python function that adds two numbers.", "What does HTTP stand for?", "Tell me a short joke.",
    "What is the largest planet in the solar system?", "Describe a sunset in one sentence.",
    "What is photosynthesis?", "How do I make a cup of tea?", "What is the square root of 81?",
    "Name three fruits.", "What language is spoken in Brazil?", "Why is the sea salty?",
    "Give me a tip for better sleep.", "What is the opposite of cold?", "Spell the word 'necessary'.",
    "What year did the first person walk on the Moon?", "What is a noun?", "Recommend a book for children.",
    "What is the chemical symbol for gold?", "How many days are in a leap year?", "What is machine learning?",
    "Write a greeting for a birthday card.", "Which ocean is the largest?", "What do bees make?",
    "Convert 5 kilometres to metres.", "Say something kind.",
]
TOP = 20  # logprobs per position
NEW_TOKENS = 32
SPLIT = 4  # tokens per step of the split reading


def _distributions(llm, sequences: list[list[int]], answer_starts: list[int]) -> list[list[dict[int, float]]]:
    """Per sequence, the top-TOP logprobs at each answer position (those that predict answer tokens)."""
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [[{t: lp.logprob for t, lp in entry.items()} for entry in out.prompt_logprobs[start:]]
            for out, start in zip(outs, answer_starts)]


def _compare(served: list[list[dict]], reference: list[list[dict]]) -> dict:
    agree, kls = [], []
    for got_seq, want_seq in zip(served, reference):
        for got, want in zip(got_seq, want_seq):
            agree.append(max(got, key=got.get) == max(want, key=want.get))
            p = np.array(list(want.values()))
            q = np.array([got.get(t, min(got.values())) for t in want])  # (outside its top 20: at most its 20th)
            rest_p, rest_q = max(1 - np.exp(p).sum(), 1e-12), max(1 - np.exp(q).sum(), 1e-12)
            kls.append(float((np.exp(p) * (p - q)).sum() + rest_p * np.log(rest_p / rest_q)))
    return {"positions": len(agree), "top1_agreement": float(np.mean(agree)), "mean_kl": float(np.mean(kls)),
            "p99_kl": float(np.percentile(kls, 99))}


def _flips(a: list[list[dict]], b: list[list[dict]]) -> float:
    pairs = [(max(x, key=x.get), max(y, key=y.get)) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    return float(np.mean([x != y for x, y in pairs]))


def measure() -> dict:
    from jaxserve import LLM, SamplingParams

    common = dict(max_model_len=512, max_num_seqs=8, max_logprobs=TOP)
    reference = LLM(**common, max_num_batched_tokens=512, dtype="float32", quantization="none")
    tokenizer = reference.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in PROMPTS]
    answers = reference.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                                 use_tqdm=False)
    sequences = [p + a.outputs[0].token_ids[:-1] for p, a in zip(prompts, answers)]
    starts = [len(p) for p in prompts]  # (prompt_logprobs[i]: the distribution token i was drawn from)
    want = _distributions(reference, sequences, starts)
    del reference
    served, readme = {}, {}
    for name, budget in (("whole", 512), (f"steps of {SPLIT}", SPLIT)):
        llm = LLM(**{**common, "max_num_seqs": min(8, budget)}, max_num_batched_tokens=budget)
        started = time.perf_counter()
        served[name] = (_distributions(llm, sequences, starts), time.perf_counter() - started)
        readme[name] = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=16, temperature=0.0),
                                    use_tqdm=False)[0].outputs[0].text
        del llm
    out = {"machine": machine_line(), "prompts": len(PROMPTS), "answer_tokens": NEW_TOKENS}
    for name, (dists, took) in served.items():
        out[name] = {**_compare(dists, want), "seconds": round(took, 1)}
    whole, split = (served[name][0] for name in served)
    out["top1_flips_between_splits"] = _flips(whole, split)
    changed = [prompt for prompt, sa, sb in zip(PROMPTS, whole, split)
               if any(max(x, key=x.get) != max(y, key=y.get) for x, y in zip(sa, sb))]
    out["answers_that_change_with_the_split"] = len(changed)
    out["prompts_whose_answer_changes"] = changed
    out["readme_answer"] = readme  # (generated, not teacher-forced)
    return out


def render(result: dict) -> str:
    readme = ("" if PROMPTS[1] in result["prompts_whose_answer_changes"]
              else ": the README's question is not among them")
    rows = [f"| {name} | {r['positions']} | {r['top1_agreement']:.1%} | {r['mean_kl']:.4f} | {r['p99_kl']:.3f} |"
            for name, r in result.items() if isinstance(r, dict) and "positions" in r]
    return "\n".join([
        f"Measured {result['machine']}: `python bench/agreement.py`. The default model as served (Q4_1 and "
        f"Q8_0 blocks kept quantized, bfloat16 activations) against the same file dequantized to float32, "
        f"teacher-forced on the float model's greedy answers to {result['prompts']} chat prompts "
        f"({result['answer_tokens']} tokens each), every position counted, near ties included.", "",
        "| served as | positions | top-1 agreement | mean KL (nats) | p99 KL |", "| --- | --- | --- | --- | --- |",
        *rows, "",
        f"The two splits disagree on the top token at {result['top1_flips_between_splits']:.1%} of positions; "
        f"{result['answers_that_change_with_the_split']} of {result['prompts']} answers have at least one such "
        f"position{readme}. Generated greedily, the README's question is answered "
        + " and ".join(f"{text!r} ({name})" for name, text in result["readme_answer"].items()) + "."])


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    result = measure()
    print(json.dumps(result, indent=2))
    print(render(result))


if __name__ == "__main__":
    main()

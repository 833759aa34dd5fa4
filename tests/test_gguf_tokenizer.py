"""A GGUF file's tokenizer, built from its metadata without torch (`checkpoints.gguf.gguf_tokenizer`).

Invariant: on 2,000 varied strings (unicode of several scripts, whitespace runs, code, numbers,
special tokens inside text), the ids, the decoded text and the rendered chat template equal those of
transformers' own GGUF tokenizer (which reads the file through torch: the reference), for a BPE
vocabulary (SmolLM2's file, `gpt2` model) and a SentencePiece one (mistral-common's
tokenizer.model.v1 written as llama.cpp's converter writes a Llama 2 / Mistral file, `llama` model).
"""

from __future__ import annotations

import random
from pathlib import Path

import mistral_common
import numpy as np
import pytest

from checkpoints import DEFAULT_MODEL_NAME, resolve_model, view_file
from checkpoints.gguf import model_view
from checkpoints.gguf_metadata import gguf_tokenizer
from jaxserve.engine.tokenizer import Tokenizer

STRINGS = 2000
SPM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

PIECES = ["Hello", "world", "the", "capital", "of", "France", "é", "ß", "naïve", "日本語", "中文", "한국어", "Привет",
          "مرحبا", "שלום", "🎉", "👍🏽", "∑", "λ", "\u200b", "def f(x):", "return x + 1", "{", "}", "[1, 2]", "if (a &&",
          "b)", "0", "42", "3.14159", "1,000,000", "-7e-3", "0x1F", "'s", "'ll", "n't", "http://a.b/c?d=e", "@user",
          "#tag", "...", "—", "«", "»", "\\n", "\"", "'"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n", "    ", ""]


def varied_strings(specials: list[str], count: int = STRINGS, seed: int = 0) -> list[str]:
    """`count` strings of random pieces joined by random whitespace runs, a special token inside one in
    five, and a few of random code points."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 10 == 9:
            out.append("".join(chr(rng.choice([rng.randint(32, 0x2FF), rng.randint(0x370, 0x9FFF),
                                                rng.randint(0x1F300, 0x1FAFF)])) for _ in range(rng.randint(1, 12))))
            continue
        parts = [rng.choice(PIECES) + rng.choice(SPACES) for _ in range(rng.randint(1, 8))]
        if i % 5 == 0:
            parts.insert(rng.randint(0, len(parts)), rng.choice(specials))
        out.append(rng.choice(["", " ", "  "]) + "".join(parts))
    return out


def assert_same_tokenizer(ours, reference, chat: list[dict]) -> None:
    specials = [t for t in reference.all_special_tokens if t]
    strings = varied_strings(specials)
    for text in strings:
        for special in (True, False):
            want = reference(text, add_special_tokens=special).input_ids
            assert ours(text, add_special_tokens=special).input_ids == want, (text, special)
        for skip in (True, False):
            assert ours.decode(want, skip_special_tokens=skip) == reference.decode(want, skip_special_tokens=skip), text
    assert ours.all_special_tokens == reference.all_special_tokens
    assert len(ours) == len(reference)
    for generation in (True, False):
        got = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation)
        assert got == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation)


def reference_tokenizer(file: Path):
    """transformers' tokenizer of a GGUF file (its reader needs torch: the tests have it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)


CHAT = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}]


def test_the_default_models_bpe_tokenizer_equals_transformers_gguf_tokenizer():
    file = view_file(resolve_model(DEFAULT_MODEL_NAME))
    ours = gguf_tokenizer(file)
    assert_same_tokenizer(ours, reference_tokenizer(file), CHAT)
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


def write_sentencepiece_gguf(path: Path) -> Path:
    """mistral-common's SentencePiece model (32000 pieces, byte fallback) as llama.cpp's converter writes
    a Llama 2 / Mistral file: tokenizer model `llama`, pieces with scores and types, special ids,
    add_bos, a chat template, and a tiny model's shape (one embedding tensor)."""
    import gguf
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(
        model_file=str(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"))
    n = sp.get_piece_size()

    def kind(i: int) -> int:  # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 5 unused, 6 byte
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1

    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 32),
                       (writer.add_feed_forward_length, 64), (writer.add_head_count, 2), (writer.add_head_count_kv, 2),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, n),
                       (writer.add_tokenizer_model, "llama"), (writer.add_tokenizer_pre, "default"),
                       (writer.add_token_list, [sp.id_to_piece(i) for i in range(n)]),
                       (writer.add_token_scores, [sp.get_score(i) for i in range(n)]),
                       (writer.add_token_types, [kind(i) for i in range(n)]),
                       (writer.add_bos_token_id, sp.bos_id()), (writer.add_eos_token_id, sp.eos_id()),
                       (writer.add_unk_token_id, sp.unk_id()), (writer.add_add_bos_token, True),
                       (writer.add_add_eos_token, False), (writer.add_chat_template, SPM_TEMPLATE)):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((n, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory) -> Path:
    return write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "mistral-spm.gguf")


def test_a_sentencepiece_tokenizer_equals_transformers_gguf_tokenizer(sentencepiece_gguf):
    assert_same_tokenizer(gguf_tokenizer(sentencepiece_gguf), reference_tokenizer(sentencepiece_gguf), CHAT)


def test_a_sentencepiece_gguf_view_encodes_decodes_and_renders_chats(sentencepiece_gguf, tmp_path, monkeypatch):
    """Through the model view jaxserve serves from: BOS added, text round-trips, the file's template."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tokenizer = Tokenizer(model_view(sentencepiece_gguf))
    ids = tokenizer.encode("Hello world, 日本語 🎉")
    assert ids[0] == 1 and 1 not in ids[1:]
    assert tokenizer.decode(ids) == "Hello world, 日本語 🎉"
    rendered = tokenizer.hf.apply_chat_template(CHAT, tokenize=False)
    assert rendered == "<s>[INST] What is the capital of France? [/INST]Paris.</s>[INST] And of Italy? [/INST]"

"""Incremental detokenization on a real SentencePiece tokenizer and on byte-level BPE tokenizers.

Invariant: the concatenation of the deltas equals the full decode of the
generated ids (in the context of the prompt), and no delta carries U+FFFD for
a character that the full decode has whole.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mistral_common
import numpy as np
import pytest

from checkpoints.default_model import write_byte_tokenizer
from jaxserve.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from jaxserve.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! Ünïcödé façade — naïve café.",
    "日本語のテキストと中文字符，还有한국어도 있어요。",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦🇫🇷 and 🤖!",
    "Combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0333a\u0352l\u0347g\u0344o",
    "  leading spaces,\ttabs\nand newlines\n\n",
]


def sentencepiece_tokenizer(tmp: Path) -> Tokenizer:
    """mistral-common's tokenizer.model.v1 (32000 pieces, byte fallback), loaded by transformers."""
    model = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    shutil.copy(model, tmp / "tokenizer.model")
    (tmp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return Tokenizer(tmp)


def trained_byte_bpe_tokenizer(tmp: Path) -> Tokenizer:
    """A GPT-2-style byte-level BPE with merges, trained on TEXTS (merges span multi-byte characters)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(TEXTS * 5, trainer)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": "<|endoftext|>"}))
    return Tokenizer(tmp)


def byte_tokenizer(tmp: Path) -> Tokenizer:
    write_byte_tokenizer(tmp)
    return Tokenizer(tmp)


@pytest.fixture(params=["sentencepiece", "byte_bpe_merges", "byte_level"], scope="module")
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    build = {"sentencepiece": sentencepiece_tokenizer, "byte_bpe_merges": trained_byte_bpe_tokenizer,
             "byte_level": byte_tokenizer}[request.param]
    return build(tmp_path_factory.mktemp(request.param))


def stream(tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.push([t]) for t in output_ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_of_real_text_rebuild_it(tokenizer, text):
    prompt = tokenizer.encode("Prompt:")
    output = tokenizer.encode(" " + text, add_special_tokens=False)
    deltas = stream(tokenizer, prompt, output)
    full = tokenizer.decode(prompt + output)
    assert "".join(deltas) == full[len(tokenizer.decode(prompt)):]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_random_token_sequences(tokenizer):
    rng = np.random.default_rng(0)
    vocab = len(tokenizer.hf)
    prompt = tokenizer.encode("Hello")
    prompt_text = tokenizer.decode(prompt)
    # random ids, spiced with the ids of emoji, CJK and combining marks
    special = [t for text in TEXTS for t in tokenizer.encode(text, add_special_tokens=False)]
    for _ in range(40):
        ids = [int(rng.choice(special)) if rng.random() < 0.5 else int(rng.integers(0, vocab))
               for _ in range(int(rng.integers(1, 30)))]
        deltas = stream(tokenizer, prompt, ids)
        full = tokenizer.decode(prompt + ids)
        assert full.startswith(prompt_text)
        assert "".join(deltas) == full[len(prompt_text):]
        # a U+FFFD is only ever streamed where the full decode has one
        assert "".join(deltas).count(REPLACEMENT_CHAR) == full.count(REPLACEMENT_CHAR) - prompt_text.count(
            REPLACEMENT_CHAR)


def test_split_multibyte_character_is_held_back(tmp_path):
    tok = byte_tokenizer(tmp_path)  # one token per UTF-8 byte
    detok = IncrementalDetokenizer(tok, tok.encode("a"))
    pieces = [detok.push([b]) for b in "😀!".encode()]
    assert pieces == ["", "", "", "😀", "!"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_spell_the_text(tokenizer, text):
    """Each token's own bytes (used for logprobs) add up to the text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    spelled = b"".join(tokenizer.token_bytes(i) for i in ids).decode()
    assert spelled == text or spelled == " " + text  # SentencePiece marks the first word with a space


def test_added_tokens_in_a_row_are_joined_without_spaces_between_special_tokens(tmp_path):
    """vLLM's `spaces_between_special_tokens=False` (with special tokens kept): an added token right
    after another is its own text, even where the tokenizer's decode (here a stand-in that spaces
    them, as transformers' Python tokenizers did) puts a space between them; other text is as decoded."""
    real = byte_tokenizer(tmp_path)

    class SpacingTokenizer:
        added_tokens_decoder = real.hf.added_tokens_decoder

        def decode(self, ids, skip_special_tokens):
            return " ".join(part for i in ids if (part := real.hf.decode([i], skip_special_tokens=skip_special_tokens)))

    tokenizer = Tokenizer.__new__(Tokenizer)
    tokenizer.hf, tokenizer._added = SpacingTokenizer(), None
    output = [256, 257, 104, 258, 259]  # two added tokens, "h", two added tokens
    for spaces, want in ((True, " <|begin_of_text|> <|end_of_text|> h <|im_start|> <|im_end|>"),
                         (False, " <|begin_of_text|><|end_of_text|> h <|im_start|><|im_end|>")):
        detok = IncrementalDetokenizer(tokenizer, [104], skip_special_tokens=False,
                                       spaces_between_special_tokens=spaces)
        assert "".join(detok.push([t]) for t in output) + detok.flush() == want
    joined = IncrementalDetokenizer(tokenizer, [104], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert joined.push(output) == want  # several tokens in one push

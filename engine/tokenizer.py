"""Byte-level BPE tokenizer built from GGUF `tokenizer.ggml.*` metadata, tokenizing like llama.cpp.

The heavy lifting (regex pre-split, byte-to-unicode mapping, rank-ordered merges, special-token
splitting) is done by Hugging Face `tokenizers` (Rust). This module maps the GGUF metadata onto it
and owns the rules llama.cpp applies around it: which token texts count as special in which mode,
which ids end generation, and how ids turn back into bytes.
"""
from __future__ import annotations

import codecs
import re
from array import array
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from engine.errors import TokenizerError

# llama_token_type values stored in `tokenizer.ggml.token_type`.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_RAW = (CONTROL, UNKNOWN, UNUSED, USER_DEFINED)  # stored as their UTF-8 text, not in the GPT-2 byte alphabet
_RAW_TYPE = re.compile(b"[" + bytes(_RAW) + b"]")
_HIDDEN = bytes(t in (CONTROL, UNKNOWN, UNUSED) for t in range(256))  # type → 1 where decoding can skip it

# Split regexes of llama.cpp's pre-tokenizer types (llama-vocab.cpp). llama.cpp spells the
# contraction group case-insensitively by hand; `(?i:...)` is the same set for Oniguruma.
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's own regex (HF ByteLevel's). llama.cpp drops the final `\s+`, but it also keeps
# unmatched text as its own piece, which is exactly what that alternative matches.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZER_PATTERNS: Mapping[str, str] = {"qwen35": _QWEN35, "qwen2": _QWEN2, "gpt-2": _GPT2}

# llama.cpp marks these texts end-of-generation whatever the metadata says (llama-vocab.cpp:
# the EOT/EOM texts, and the FIM pad/repo/file-separator texts), and forces them to CONTROL.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>",
    "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
})
# Of those, llama.cpp takes each FIM id from its metadata key when present instead of by text.
_FIM_KEYS = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable character table (the alphabet of GGUF gpt2 tokens)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    shift = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:  # whitespace/control/unprintable bytes move above U+00FF so no byte is invisible
            table[b] = chr(256 + shift)
            shift += 1
    return table


BYTE_TO_UNICODE: list[str] = _bytes_to_unicode()
_BYTE_TO_UNICODE = {b: c for b, c in enumerate(BYTE_TO_UNICODE)}  # for str.translate of latin-1 text
_BYTE_OF = np.zeros(max(map(ord, BYTE_TO_UNICODE)) + 1, np.uint8)  # code point of the alphabet → its byte
_BYTE_OF[[ord(c) for c in BYTE_TO_UNICODE]] = np.arange(256)
_NOT_BYTE_ALPHABET = re.compile("[^" + re.escape("".join(BYTE_TO_UNICODE)) + "]")


def _get(md: Mapping[str, Any], key: str, kind: type | tuple[type, ...], *, required: bool) -> Any:
    if key not in md:
        if required:
            raise TokenizerError(f"GGUF metadata lacks {key!r}; the model carries no usable tokenizer")
        return None
    value = md[key]
    if kind is list and hasattr(value, "tolist"):  # numpy arrays from a GGUF reader
        value = value.tolist()
    if kind is int and not isinstance(value, bool) and hasattr(value, "__index__"):
        return value.__index__()  # numpy integer scalars from a GGUF reader
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        want = {int: "an integer", str: "text", list: "an array", bool: "a boolean"}.get(kind, str(kind))  # type: ignore[call-overload]
        raise TokenizerError(f"GGUF metadata {key!r} has type {type(value).__name__}, expected {want}")
    return value


class Tokenizer:
    """Text <-> token ids for a GGUF `gpt2` (byte-level BPE) vocabulary."""

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos: bool
    eog_ids: frozenset[int]
    pre: str

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        model = _get(md, "tokenizer.ggml.model", str, required=True)
        if model != "gpt2":
            raise TokenizerError(
                f"tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported")
        pre = _get(md, "tokenizer.ggml.pre", str, required=True)
        if pre not in PRE_TOKENIZER_PATTERNS:
            raise TokenizerError(
                f"tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(PRE_TOKENIZER_PATTERNS)})")
        tokens: list[str] = _get(md, "tokenizer.ggml.tokens", list, required=True)
        if not tokens or not all(type(t) is str for t in tokens):
            raise TokenizerError("tokenizer.ggml.tokens must be a non-empty list of strings")
        types = _get(md, "tokenizer.ggml.token_type", list, required=False)
        if types is None:
            types = [NORMAL] * len(tokens)
        elif len(types) != len(tokens):
            raise TokenizerError(
                f"tokenizer.ggml.token_type has {len(types)} entries but tokenizer.ggml.tokens has {len(tokens)}")
        bad = next((i for i, t in enumerate(types) if type(t) is not int or not 0 <= t <= BYTE), None)
        if bad is not None:
            raise TokenizerError(f"tokenizer.ggml.token_type[{bad}] = {types[bad]!r} is not a token type (0…{BYTE})")
        merges: list[str] = _get(md, "tokenizer.ggml.merges", list, required=True)
        return cls(md, pre, tokens, list(types), merges)

    def __init__(self, md: Mapping[str, Any], pre: str, tokens: list[str], types: list[int],
                 merges: list[str]) -> None:
        self.pre = pre
        self.n_vocab = n = len(tokens)
        if "" in tokens:  # llama.cpp renames empty entries so every id keeps a distinct text
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

        def token_id(key: str) -> int | None:
            value = _get(md, key, int, required=False)
            if value is not None and not 0 <= value < n:
                raise TokenizerError(f"{key} = {value} is outside the vocabulary (0..{n - 1})")
            return value

        self.bos_id = token_id("tokenizer.ggml.bos_token_id")
        self.eos_id = token_id("tokenizer.ggml.eos_token_id")
        self.pad_id = token_id("tokenizer.ggml.padding_token_id")
        self.add_bos = bool(_get(md, "tokenizer.ggml.add_bos_token", bool, required=False))
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing")

        vocab = {t: i for i, t in enumerate(tokens)}  # a repeated text maps to its last id, as in llama.cpp
        missing = [b for b, c in enumerate(BYTE_TO_UNICODE) if c not in vocab]
        if missing:
            raise TokenizerError(
                f"tokenizer.ggml.tokens lacks {len(missing)} of the 256 byte tokens (e.g. byte {missing[0]:#04x}); "
                "a byte-level vocabulary cannot encode arbitrary text without them")
        # They spell every text: typed control, unused and so on, no text could be written or read back (issue 48:
        # every token typed control loaded and answered "!!!!"). BYTE-typed ones decode as NORMAL ones here.
        odd = [vocab[c] for c in BYTE_TO_UNICODE if types[vocab[c]] not in (NORMAL, BYTE)]
        if odd:
            raise TokenizerError(
                f"tokenizer.ggml.token_type gives {len(odd)} of the 256 byte tokens a type other than normal (e.g. id "
                f"{odd[0]}, {tokens[odd[0]]!r}, type {types[odd[0]]}); a byte-level vocabulary spells text with them")

        # llama.cpp's end-of-generation rule: eos/eot/eom (and FIM pad/repo/sep) ids from the
        # metadata, plus the listed texts, which it also forces to CONTROL so plain text never
        # produces them.
        eog = {token_id(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id", *_FIM_KEYS)}
        texts = set(_EOG_TEXTS)
        for key, fim_texts in _FIM_KEYS.items():
            if key in md:
                texts.difference_update(fim_texts)
        for i in (vocab[t] for t in texts if t in vocab):
            eog.add(i)
            types[i] = CONTROL
        eog.discard(None)
        self.eog_ids = frozenset(eog)  # type: ignore[arg-type]
        # One byte of type per id, and the texts only as their bytes (token_text reads them back): kept as strings
        # beside the Rust tokenizer's own copy, a 248k vocabulary took some 35 MiB more.
        self._types = bytes(types)

        pairs = self._parse_merges(merges)
        self._hf_plain, self._hf_special = self._build_hf(tokens, vocab, pairs)
        self._blob, self._at = self._build_pieces(tokens)
        self._hidden = self._types.translate(_HIDDEN)

    @staticmethod
    def _parse_merges(merges: list[str]) -> list[tuple[str, str]]:
        if not all(type(m) is str for m in merges):
            raise TokenizerError("tokenizer.ggml.merges must be a list of strings")
        pairs: list[tuple[str, str]] = []
        # llama.cpp keeps the first rank of a repeated merge; HF would keep the last.
        for merge in dict.fromkeys(merges):
            cut = merge.find(" ", 1)  # as llama.cpp: a leading space belongs to the left part
            if cut < 0:
                raise TokenizerError(f"tokenizer.ggml.merges entry {merge!r} is not of the form 'left right'")
            pairs.append((merge[:cut], merge[cut + 1:]))
        return pairs

    def _build_hf(self, tokens: list[str], vocab: dict[str, int], pairs: list[tuple[str, str]]
                  ) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
        try:
            # ignore_merges=False: llama.cpp never looks a whole piece up in the vocabulary first,
            # so the few tokens no merge chain builds are never produced from text.
            bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=False)
        except Exception as e:  # HF reports merges naming unknown tokens as a plain Exception
            raise TokenizerError(f"tokenizer.ggml.merges does not fit tokenizer.ggml.tokens: {e}") from e
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS[self.pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])

        def added(i: int) -> AddedToken:
            return AddedToken(tokens[i], special=self._types[i] != USER_DEFINED, normalized=False,
                              lstrip=False, rstrip=False, single_word=False)

        # USER_DEFINED texts are always matched (llama.cpp does so even without parse_special);
        # CONTROL/UNKNOWN only when the caller asks for special parsing.
        user = [added(i) for i, t in enumerate(self._types) if t == USER_DEFINED]
        control = [added(i) for i, t in enumerate(self._types) if t in (CONTROL, UNKNOWN)]
        built = []
        for specials in ([], control):
            hf = tokenizers.Tokenizer(bpe)  # both share the one Rust BPE model
            hf.pre_tokenizer = pre_tok
            hf.decoder = decoders.ByteLevel()
            if user:
                hf.add_tokens(user)
            if specials:
                hf.add_special_tokens(specials)
            built.append(hf)
        return built[0], built[1]

    def _build_pieces(self, tokens: list[str]) -> tuple[bytes, array]:
        """The bytes each id decodes to, all in one buffer, and where each id's bytes begin (n_vocab + 1 offsets)."""
        raw = [m.start() for m in _RAW_TYPE.finditer(self._types)]
        parts: list[bytes] = []
        start = 0
        for end in [*raw, len(tokens)]:
            # A run of byte-level tokens: each character of the GPT-2 byte alphabet stands for one byte.
            run = "".join(tokens[start:end])
            bad = _NOT_BYTE_ALPHABET.search(run)
            if bad:
                culprit = next(i for i in range(start, end) if _NOT_BYTE_ALPHABET.search(tokens[i]))
                raise TokenizerError(
                    f"tokenizer.ggml.tokens[{culprit}] {tokens[culprit]!r} holds {bad.group()!r}, "
                    "which is outside the GPT-2 byte alphabet")
            parts.append(_BYTE_OF[np.frombuffer(run.encode("utf-32-le"), np.uint32)].tobytes())
            if end < len(tokens):  # special and user-defined tokens are stored as their raw text
                parts.append(tokens[end].encode())
            start = end + 1
        sizes = list(map(len, tokens))
        for i in raw:
            sizes[i] = len(tokens[i].encode())
        return b"".join(parts), array("q", accumulate(sizes, initial=0))

    def _bytes(self, ids: Sequence[int], skip_special: bool) -> bytes:
        """The bytes of `ids` (checked), special tokens as nothing with skip_special."""
        blob, at, hidden = self._blob, self._at, self._hidden
        if skip_special:
            return b"".join([blob[at[i]:at[i + 1]] for i in self._checked(ids) if not hidden[i]])
        return b"".join([blob[at[i]:at[i + 1]] for i in self._checked(ids)])

    def encode(self, text: str, *, special: bool = False, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. With special=False, control-token texts in it are plain text."""
        return self.encode_batch([text], special=special, add_bos=add_bos)[0]

    def encode_batch(self, texts: Sequence[str], *, special: bool = False,
                     add_bos: bool | None = None) -> list[list[int]]:
        """`encode` over many texts, in parallel on the tokenizers thread pool."""
        hf = self._hf_special if special else self._hf_plain
        # The _fast variant skips character offsets we never use: ~1.6x less work on long texts.
        encodings = hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._with_bos(e.ids, add_bos) for e in encodings]

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("a BOS token was requested but tokenizer.ggml.bos_token_id is missing")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD. skip_special drops control/unused tokens."""
        return self._bytes(ids, skip_special).decode("utf-8", "replace")

    def _checked(self, ids: Sequence[int]) -> Sequence[int]:
        # Negative ids would silently index from the end of the piece table.
        if len(ids) and (min(ids) < 0 or max(ids) >= self.n_vocab):
            bad = next(i for i in ids if not 0 <= i < self.n_vocab)
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.n_vocab - 1})")
        return ids

    def token_text(self, id: int) -> str:
        """The vocabulary string of `id` (byte-level alphabet for ordinary tokens)."""
        raw = self.token_bytes(id)
        return raw.decode() if self._types[id] in _RAW else raw.decode("latin-1").translate(_BYTE_TO_UNICODE)

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes `id` stands for; special and user-defined tokens give their UTF-8 text."""
        return self._bytes([id], False)

    def token_type(self, id: int) -> int:
        """The `tokenizer.ggml.token_type` value of `id`, after llama.cpp's EOG-to-CONTROL fix-up."""
        return self._types[self._checked([id])[0]]

    def is_control(self, id: int) -> bool:
        return self.token_type(id) == CONTROL

    def control_texts(self) -> list[str]:
        """The texts of every control token (one pass: a 248k vocabulary, not 248k calls)."""
        return [self.token_text(m.start()) for m in re.finditer(bytes([CONTROL]), self._types)]

    def detokenizer(self, *, skip_special: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special=skip_special)


class IncrementalDetokenizer:
    """Streams ids to text without ever emitting half of a multi-byte UTF-8 sequence."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer, self._skip_special = tokenizer, skip_special
        # The stdlib incremental decoder holds an incomplete tail back and turns bytes that can
        # no longer start/continue a valid sequence into U+FFFD, exactly like a one-shot decode.
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, ids: Sequence[int]) -> str:
        """Text completed by `ids` (possibly empty while a character is still incomplete)."""
        return self._decoder.decode(self._tokenizer._bytes(ids, self._skip_special))

    def flush(self) -> str:
        """Whatever is held back, an incomplete final sequence rendered as U+FFFD; then reset."""
        return self._decoder.decode(b"", final=True)

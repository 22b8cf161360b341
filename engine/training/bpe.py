"""Byte-level BPE vocabulary training (HF `tokenizers`), producing GGUF `tokenizer.ggml.*` data."""
from __future__ import annotations

import json
from typing import Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.storage.writer import Vocab

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_bpe(
    texts: Iterable[str], vocab_size: int, *, pattern: str, specials: Sequence[str] = CHATML_SPECIALS,
    extra_plain: Sequence[str] = (), chat_template: str | None = None,
) -> Vocab:
    """Learn merges on `texts` so that tokens + specials = exactly `vocab_size` entries.

    `pattern` is the pre-tokenizer split regex the runtime will use (the model's `tokenizer.ggml.pre`), so
    the learned merges never cross a split boundary. `extra_plain` are user-defined texts such as
    "<think>" that must be single tokens but stay ordinary (not control) tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    n_special = len(specials) + len(extra_plain)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_special, show_progress=False, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    types = [TOKEN_NORMAL] * len(tokens)
    # A corpus too small to learn enough merges leaves unused ids, padded as llama.cpp's converter does.
    while len(tokens) < vocab_size - n_special:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(TOKEN_UNUSED)
    for s in extra_plain:
        tokens.append(s)
        types.append(TOKEN_USER_DEFINED)
    for s in specials:
        tokens.append(s)
        types.append(TOKEN_CONTROL)
    ids = {t: i for i, t in enumerate(tokens)}
    return Vocab(
        tokens=tokens, token_types=types, merges=_merges_of(tok), bos_id=ids[specials[0]],
        eos_id=ids["<|im_end|>"] if "<|im_end|>" in ids else ids[specials[0]],
        pad_id=ids[specials[0]], pre="qwen35", chat_template=chat_template,
    )


def _merges_of(tok: Tokenizer) -> list[str]:
    data = json.loads(tok.to_str())
    merges = data["model"]["merges"]
    return [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in merges]

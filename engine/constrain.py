"""Constrained decoding: output held to a JSON schema by a token mask each step (llguidance compiles the schema).

A `Constraint` (GenerationConfig.constraint) names the schema; each reply gets a `Matcher` over the engine's own
tokenizer (llguidance's vocabulary is built from each id's bytes, once per tokenizer). The sampler masks a logit row
with what the matcher allows (engine.sampling); the reply advances it by every emitted token, and ends when the
output is complete. Speculative decoding drafts from the head's masked rows and verifies with masked rows, the matcher
moved `ahead` over the drafts and then `back`, so that it only ever holds emitted tokens - and a forced run: where the
mask allows one token only, step after step (a key's name, its quotes and colon; most of a schema's punctuation),
`forced` takes the run before the pass, the decoders run it with the last token in one pass and emit it unsampled
(engine.decoding.Reply.forced), the token after it sampled from the pass's last row. Greedy and sampled replies are
what a mask at every step would give (a one-token mask leaves nothing to choose), in far fewer passes.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Mapping

import llguidance
import numpy as np
import torch

from engine.errors import EngineError, InvalidParameterError
from engine.tokenizer import CONTROL, Tokenizer

# One fixed layout, as json.dumps (and a chat template's tojson) writes it: no runs of whitespace for a weak model to
# fill a reply with.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(EngineError):
    """The constraint's state went wrong mid-reply (a token it forbids was emitted): a decoding bug, never data."""


@dataclass(frozen=True)
class Constraint:
    """The output must be JSON text valid for `schema` (the schema as JSON text), or, where `lark` is set, text of
    that grammar (llguidance's Lark dialect: a tool call's markup around its arguments, engine.tools.call_grammar).
    Lazy (`trigger` set: a call the model may or may not make, tool_choice auto): the output is free text, and
    wherever `trigger` appears in it (outside any block between `quiet`'s two markers, a thinking block; the reply
    starts inside one where `quiet_first`) the text after it is held to the grammar until the grammar is done."""

    schema: str
    lark: str | None = None
    trigger: str | None = None
    quiet: tuple[str, str] | None = None
    quiet_first: bool = False

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls('{"type": "object"}')

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> Constraint:
        return cls(json.dumps(schema))

    @classmethod
    def grammar_of(cls, lark: str) -> Constraint:
        return cls("", lark)

    @classmethod
    def lazy(cls, lark: str, trigger: str, quiet: tuple[str, str] | None = None,
             quiet_first: bool = False) -> Constraint:
        return cls("", lark, trigger, quiet, quiet_first)

    def matcher(self, tokenizer: Tokenizer) -> ReplyMatcher:
        """A reply's place in this constraint (InvalidParameterError for a grammar that cannot be compiled)."""
        return Matcher(self, tokenizer) if self.trigger is None else LazyMatcher(self, tokenizer)

    def grammar(self) -> str:
        if self.lark is not None:
            return llguidance.LLMatcher.grammar_from_lark(self.lark)
        return llguidance.LLMatcher.grammar_from_json_schema(self.schema, overrides=JSON_LAYOUT)  # type: ignore[arg-type]

    def check(self) -> None:
        """InvalidParameterError saying why, for a schema llguidance cannot compile (or does not implement)."""
        why = llguidance.LLMatcher.validate_grammar(self.grammar())
        if why:
            raise InvalidParameterError(f"the JSON schema cannot be enforced: {why.strip()[:300]}")


class _Vocabulary:
    """The engine tokenizer as llguidance.TokenizerWrapper reads one: each id's bytes, the control ids, encoding."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
        self.special_token_ids = [i for i in range(tokenizer.n_vocab) if tokenizer.token_type(i) == CONTROL]
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        # llguidance tokenizes the text a schema forces next (a key, its quotes) at most steps, the same few texts
        # in every reply: remembered, a step's mask is no round trip through the tokenizer
        self.encode = functools.lru_cache(maxsize=4096)(self._encode)

    def __call__(self, text: str | bytes) -> list[int]:
        return list(self.encode(text))

    def _encode(self, text: str | bytes) -> tuple[int, ...]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return tuple(self._tokenizer.encode(text, add_bos=False))


@functools.lru_cache(maxsize=4)
def _lltokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for one model (its token trie: built once, shared by every reply)."""
    eog = sorted(tokenizer.eog_ids)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)), n_vocab=tokenizer.n_vocab,
                                  eos_token=eog or None)


class Matcher:
    """One reply's place in its constraint: what may come next, advanced by each emitted token."""

    def __init__(self, constraint: Constraint, tokenizer: Tokenizer):
        """InvalidParameterError for a schema that cannot be compiled."""
        self.n_vocab = tokenizer.n_vocab
        self._m = llguidance.LLMatcher(_lltokenizer(tokenizer), constraint.grammar(), log_level=0)
        if self._m.is_error():
            raise InvalidParameterError(f"the JSON schema cannot be enforced: {self._m.get_error()[:300]}")
        self._eog = tokenizer.eog_ids
        self._ahead, self._ended = 0, False
        self._bits = torch.zeros((self.n_vocab + 31) // 32, dtype=torch.int32)  # llguidance's mask: a bit per id
        # what is known of the current state (a state is asked about more than once): its mask in _bits, its forced text
        self._fresh, self._ff = False, None

    free = False  # a mask holds every token (LazyMatcher.free)

    def allows(self, token: int) -> bool:
        """Whether the mask allows `token`, mostly without computing it: where the grammar forces text, llguidance's mask
        allows only the canonical tokens of it (a space and '[' apart are valid JSON, but where ' [' is forced only
        ' [' is allowed), elsewhere exactly what it would consume (a test walks replies to check it)."""
        if self._fresh or self.forces():
            return bool(self.bits()[token >> 5].item() >> (token & 31) & 1)
        return self._m.validate_tokens([token]) == 1

    def forces(self) -> list[int]:
        """The canonical tokens of the text the grammar forces next (llguidance's fast-forward tokens; often none)."""
        if self._ff is None:
            self._ff = self._m.compute_ff_tokens()
        return self._ff

    def bits(self) -> torch.Tensor:
        """What may come next: a bit per vocabulary id, 32 ids an int32 word (engine.ops.token_mask reads it)."""
        if not self._fresh:
            self._m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
            self._fresh = True
        return self._bits

    def consume(self, token: int) -> None:
        """An emitted token."""
        self._fresh, self._ff = False, None
        if not self._m.consume_token(token):
            raise ConstraintError(f"token {token} was emitted against the constraint: {self._m.get_error()[:300]}")

    def forced(self, limit: int) -> list[int]:
        """The tokens that follow whatever the model says (the only one the constraint allows, step after step: a
        key's name, its quotes and colon), at most `limit`, consumed. Each is checked against the whole mask, so a
        run is exactly what sampling under the mask would choose; llguidance's forced text (its fast-forward
        tokens, ~2 us) is asked first, so a step with a choice costs no mask. The mask of the state the run ends in
        stays for the token sampled there."""
        run: list[int] = []
        while len(run) < limit and not self.done:
            ff = self.forces()
            if not ff or ff[0] in self._eog:
                break
            t = ff[0]
            if not self.only_allows(t):
                break
            self.consume(t)
            run.append(t)
        return run

    def only_allows(self, token: int) -> bool:
        """Whether the mask allows `token` and nothing else."""
        words = self.bits().numpy().view(np.uint32)
        return words[token >> 5] == 1 << (token & 31) and np.count_nonzero(words) == 1

    def ahead(self, token: int) -> None:
        """Move over a token not yet emitted (a draft); `back` undoes every such move. An end token is only noted:
        nothing follows it (and llguidance does not roll one back exactly)."""
        if token in self._eog:
            self._ended = True
            return
        self.consume(token)
        self._ahead += 1

    def back(self) -> None:
        if self._ahead:
            self._m.rollback(self._ahead)
            self._ahead, self._fresh, self._ff = 0, False, None
        self._ended = False

    @property
    def done(self) -> bool:
        """The output is complete (or an end token was taken ahead): nothing but the end may follow."""
        return self._ended or self._m.is_stopped()


class LazyMatcher:
    """A lazy constraint's place in a reply (Constraint.trigger): over free text nothing is masked (`free`: the sampler
    and the drafter skip the mask), and no token is forced; where the trigger is emitted (or taken `ahead` in a draft),
    a Matcher of the grammar over the text after it, until the grammar is done. The same calls as a Matcher, so the
    decoders hold a call the model chooses to make as they hold a forced one - its drafts checked, its forced runs
    taken - and free text costs no mask."""

    def __init__(self, constraint: Constraint, tokenizer: Tokenizer):
        assert constraint.trigger is not None and constraint.lark is not None
        self._tokenizer = tokenizer
        self._grammar = Constraint.grammar_of(constraint.lark)
        # the first call's matcher, made now: a grammar llguidance refuses fails the request, not a reply mid-way
        self._spare: Matcher | None = Matcher(self._grammar, tokenizer)
        self._trigger = constraint.trigger.encode()
        self._quiet = tuple(q.encode() for q in constraint.quiet) if constraint.quiet else None
        self._in_quiet = constraint.quiet_first and self._quiet is not None
        markers = [self._trigger, *(self._quiet or ())]
        self._keep = max(len(m) for m in markers) - 1  # free text's tail kept: a marker split over tokens
        self._tail = b""
        self._inner: Matcher | None = None
        self._saved: tuple[Matcher | None, bytes, bool] | None = None  # before the first `ahead`: what `back` restores

    @property
    def free(self) -> bool:
        return self._inner is None

    @property
    def done(self) -> bool:
        return False  # a reply under a lazy constraint ends as a free one does

    def allows(self, token: int) -> bool:
        return self._inner is None or self._inner.allows(token)

    def bits(self) -> torch.Tensor:
        """Asked only while a call is open: over free text the decoders apply no mask (`free`, `allows`)."""
        if self._inner is None:
            raise ConstraintError("a lazy constraint has no mask over free text")
        return self._inner.bits()

    def forces(self) -> list[int]:
        return [] if self._inner is None else self._inner.forces()

    def only_allows(self, token: int) -> bool:
        return self._inner is not None and self._inner.only_allows(token)

    def forced(self, limit: int) -> list[int]:
        if self._inner is None:
            return []
        run = self._inner.forced(limit)
        if self._inner.done:
            self._inner, self._tail = None, b""
        return run

    def consume(self, token: int) -> None:
        self._step(token, False)

    def ahead(self, token: int) -> None:
        if self._saved is None:
            self._saved = (self._inner, self._tail, self._in_quiet)
        self._step(token, True)

    def back(self) -> None:
        if self._saved is None:
            return
        inner, self._tail, self._in_quiet = self._saved
        if inner is not None:
            inner.back()
        self._inner, self._saved = inner, None

    def _step(self, token: int, ahead: bool) -> None:
        if self._inner is not None:
            (self._inner.ahead if ahead else self._inner.consume)(token)
            if self._inner.done:
                self._inner, self._tail = None, b""
            return
        if token in self._tokenizer.eog_ids:
            return
        text = self._tail + self._tokenizer.token_bytes(token)
        while True:
            if self._in_quiet:
                end = text.find(self._quiet[1])  # type: ignore[index]
                if end < 0:
                    break
                text, self._in_quiet = text[end + len(self._quiet[1]):], False  # type: ignore[index]
                continue
            at = text.find(self._trigger)
            opens = text.find(self._quiet[0]) if self._quiet else -1
            if opens >= 0 and (at < 0 or opens < at):
                text, self._in_quiet = text[opens + len(self._quiet[0]):], True  # type: ignore[index]
                continue
            if at >= 0:
                self._tail = b""
                self._open(text[at + len(self._trigger):])
                return
            break
        self._tail = text[-self._keep:] if self._keep else b""

    def _open(self, rest: bytes) -> None:
        """The grammar's matcher, over the text the token that completed the trigger wrote after it. Where that text
        does not begin what the grammar allows, nothing is held (the call is checked after it is made)."""
        inner, self._spare = self._spare or Matcher(self._grammar, self._tokenizer), None
        try:
            for t in self._tokenizer.encode(rest.decode("utf-8", "replace"), add_bos=False) if rest else ():
                inner.consume(t)
        except ConstraintError:
            return
        self._inner = None if inner.done else inner


ReplyMatcher = Matcher | LazyMatcher  # what Constraint.matcher gives a reply

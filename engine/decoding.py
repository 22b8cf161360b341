"""One reply's decoding: its bookkeeping (`Reply`) and the plain decoder.

A decoder's `step(x, reply, room)` decodes after token x (emitted, not yet run by the trunk) and returns the new last
token, emitted; it yields the reply's events on the way. A step is two halves around one trunk pass: `plan` says
which rows the pass runs (`StepRows`: x alone, or x and drafts to verify) after doing what comes first (a draft), and
its `finish` takes the pass's result; `step` runs the pass itself between them, while a batch of sequences
(engine.batch) runs one pass over the rows of all of them. The plain decoder here and the speculative one
(engine.speculative.verify) share that shape and one seam: the runner's passes, the sequence's cache and an
`advance(tokens, logits)` callback that records what the trunk has processed. Neither knows the Engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Protocol, Sequence

import torch

from engine.cache import Cache
from engine.events import Event, GenerationConfig, Token, TokenLogprob
from engine.models.qwen35 import STEP_ROWS, ForwardResult
from engine.models.runner import Runner
from engine.sampling import Sampler
from engine.tokenizer import Tokenizer

# the trunk processed `tokens` (now in the cache); `logits` are those after the last
Advance = Callable[[list[int], torch.Tensor], None]
# the MTP head told of the trunk's rows: `tokens` and their post-norm hidden rows (MTPDrafter.push)
KeepHead = Callable[[Sequence[int], torch.Tensor], None]
# the most tokens a constraint's forced run adds to a pass (with the last token: a pass the one-call step runs)
FORCED_RUN = STEP_ROWS - 1


class StopStrings:
    """Holds back text that could be the start of a stop string; reports when one completes."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        for s in self.stops:
            i = self.buf.find(s)
            if i >= 0:
                out, self.buf = self.buf[:i], ""
                return out, True
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.buf.endswith(s[:k])), default=0)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, False

    def flush(self, text: str = "") -> str:
        out, self.buf = self.buf + text, ""
        return out


class Reply:
    """Bookkeeping of one generation: emitted ids, streaming text, stop conditions."""

    def __init__(self, prompt: list[int], gen: GenerationConfig, tokenizer: Tokenizer):
        self.gen, self.eog = gen, tokenizer.eog_ids
        self.history = list(prompt)  # the prompt and every emitted token (repetition penalties read it)
        self.out_ids: list[int] = []
        self.detok = tokenizer.detokenizer(skip_special=True)  # control tokens are never shown
        self.stopper = StopStrings(gen.stop_strings)
        # the constraint's place, advanced by each emitted token (the sampler masks with it)
        self.matcher = gen.constraint.matcher(tokenizer) if gen.constraint is not None else None
        self._taken = 0  # tokens `forced` consumed in the matcher, not yet emitted
        self.t_first: float | None = None
        self.reason: str | None = None  # why it ended; None while it goes on

    def emit(self, tokens: list[tuple[int, bool]], logits: torch.Tensor | None = None) -> Generator[Event, None, int]:
        """Emit (token, from a draft) pairs in order until a stop condition; returns how many were kept. `logits`:
        the row (or rows, one per token) each token was chosen from, read when the reply asks for logprobs."""
        rows = logits.reshape(-1, logits.shape[-1]) if logits is not None and self.gen.logprobs is not None else None
        for i, (tok, from_draft) in enumerate(tokens):
            self.out_ids.append(tok)
            self.history.append(tok)
            if self.t_first is None:
                self.t_first = time.perf_counter()
            if tok in self.eog:
                self.reason = "eos"
                return i + 1
            text, hit = self.stopper.push(self.detok.push([tok]))
            complete = self._complete(tok) and not hit
            if complete:  # nothing follows: what was held back (a stop string's start) is output
                text += self.stopper.flush(self.detok.flush())
            if text or not hit:
                yield Token([tok], text, from_draft, () if rows is None else (self._logprob(tok, rows[i]),))
            if hit or complete:
                self.reason = "stop_string" if hit else "eos"
                return i + 1
            if len(self.out_ids) >= self.gen.max_tokens:
                self.reason = "max_tokens"
                return i + 1
        return len(tokens)

    def forced(self, room: int) -> list[int]:
        """The tokens the constraint allows alone after the last emitted one (at most `room`, and no more than the
        reply may still emit), taken from the matcher now: the next pass runs them with the last token, and they are
        emitted, unsampled, before the token sampled after them. Empty where the reply asks for logprobs (each
        token's row would be read): those are sampled one a step."""
        if self.matcher is None or self.gen.logprobs is not None:
            return []
        run = self.matcher.forced(min(room, FORCED_RUN, self.gen.max_tokens - len(self.out_ids)))
        self._taken += len(run)
        return run

    def _complete(self, tok: int) -> bool:
        """Advance the constraint by an emitted token (one `forced` took is there already); True when the output it
        holds to is complete."""
        if self.matcher is None:
            return False
        if self._taken:
            self._taken -= 1
            return not self._taken and self.matcher.done
        self.matcher.consume(tok)
        return self.matcher.done

    def _logprob(self, tok: int, row: torch.Tensor) -> TokenLogprob:
        lp = torch.log_softmax(row.float(), dim=-1)
        top = torch.topk(lp, self.gen.logprobs) if self.gen.logprobs else None
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        return TokenLogprob(tok, float(lp[tok]), pairs)

    def tail(self) -> Iterator[Event]:
        """Text held back at the end (a partial stop string, an unfinished character), unless a stop ended it."""
        if self.reason not in ("stop_string", "eos"):
            text = self.stopper.flush(self.detok.flush())
            if text:
                yield Token([], text)


@dataclass
class StepRows:
    """One decode step's pass (Decoder.plan): the tokens the trunk runs after what the cache holds, whether their GDN
    states are captured (a verify: all their logits are read), and the step's end once they ran: `finish(result,
    seconds)` with the pass's result for these rows and its time, emitting, returns the new last token."""

    tokens: list[int]
    capture: bool
    finish: Callable[[ForwardResult, float], Generator[Event, None, int]]


class Decoder(Protocol):
    def step(self, x: int, reply: Reply, room: int) -> Generator[Event, None, int]: ...

    def plan(self, x: int, reply: Reply, room: int) -> StepRows: ...


class PlainDecoder:
    """One token a step: the trunk over the last token, the next one sampled from its logits."""

    def __init__(self, runner: Runner, cache: Cache, advance: Advance, sampler: Sampler,
                 keep_head: KeepHead | None = None):
        """`keep_head`: the MTP head kept in step with the trunk (for a later reply with MTP on), where there is
        one."""
        self.runner, self.cache, self.advance, self.sampler, self.keep_head = runner, cache, advance, sampler, keep_head

    def settle(self, tokens: list[int], reply: Reply, res: ForwardResult, keep_head: KeepHead | None = None
               ) -> tuple[int, torch.Tensor]:
        """After the trunk ran `tokens` (`res`): tell the head (`keep_head`, else the decoder's own) and the sequence;
        returns the sampled next token, not yet emitted, and the logits it was sampled from."""
        keep = keep_head or self.keep_head
        if keep is not None:
            keep(tokens, res.hidden)
        logits = res.logits[-1]  # type: ignore[index]
        self.advance(tokens, logits)
        return self.sampler.sample(logits, reply.history, reply.matcher), logits

    def run(self, rows: StepRows) -> Generator[Event, None, int]:
        """A step's pass on this sequence alone, then its end."""
        t = time.perf_counter()
        res = self.runner.forward(rows.tokens, self.cache, logit_rows="all" if rows.capture else "last",
                                  capture=rows.capture)
        return (yield from rows.finish(res, time.perf_counter() - t))

    def plan(self, x: int, reply: Reply, room: int) -> StepRows:
        return self.forced(x, reply, room) or StepRows([x], False, lambda res, seconds: self._finish([x], reply, res))

    def forced(self, x: int, reply: Reply, room: int) -> StepRows | None:
        """The step's rows where a constraint forces the tokens after x (x and them, the token after them sampled
        from the pass's last row), else None."""
        run = reply.forced(room)
        if not run:
            return None
        tokens = [x, *run]
        return StepRows(tokens, False, lambda res, seconds: self._finish(tokens, reply, res))

    def _finish(self, tokens: list[int], reply: Reply, res: ForwardResult) -> Generator[Event, None, int]:
        nxt, logits = self.settle(tokens, reply, res)
        yield from reply.emit([(t, False) for t in tokens[1:]] + [(nxt, False)], logits)
        return nxt

    def step(self, x: int, reply: Reply, room: int) -> Generator[Event, None, int]:
        if reply.matcher is not None and not reply.matcher.free:  # a lazy one over free text forces nothing
            return (yield from self.run(self.plan(x, reply, room)))
        res = self.runner.forward([x], self.cache, logit_rows="last")  # plan + run without their objects: a hot path
        return (yield from self._finish([x], reply, res))

"""A served engine whose replies are scripted: the embedded model's file, tokenizer and a chat template of the test's
choosing, and `generate` answering each prompt with the next text of `replies`, token by token through the engine's
own reply bookkeeping (engine.decoding.Reply: detokenizing, stop strings, max_tokens). The tiny embedded model never
writes a tool call of its own; this makes the server's tool-call path testable end to end."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from typing import Any, Iterator

from engine.chat import ChatFormat
from engine.decoding import Reply
from engine.events import Done, Event, GenerationConfig, Stats


class ScriptedEngine:
    def __init__(self, real: Any, template: str | None = None):
        self.mf, self.hp, self.tokenizer, self.n_ctx = real.mf, real.hp, real.tokenizer, real.n_ctx
        self.chat = ChatFormat(template, real.tokenizer) if template is not None else real.chat
        self.drafter = None
        self.notices: list[str] = []
        self.replies: deque[str] = deque()
        self.prompts: list[str] = []  # each prompt as text, special tokens written out
        self.configs: list[GenerationConfig] = []

    def encode_prompt(self, prompt: Any, enable_thinking: bool | None = None) -> list[int]:
        return self.chat.encode(prompt, enable_thinking=enable_thinking)

    def generate(self, prompt: list[int], gen: GenerationConfig = GenerationConfig(),
                 stop: threading.Event | None = None) -> Iterator[Event]:
        self.prompts.append(self.tokenizer.decode(prompt))
        self.configs.append(gen)
        # a lazy constraint (tool_choice auto) holds sampled tokens to a call's grammar; a script's tokens are fixed
        # text, which may split a call's end differently from what the mask allows, and may be an invalid call on
        # purpose: replies here are not held to it (tests/test_server_tools.py holds the embedded model's)
        lazy = gen.constraint is not None and gen.constraint.trigger is not None
        run = Reply(list(prompt), replace(gen, constraint=None) if lazy else gen, self.tokenizer)
        ids = self.tokenizer.encode(self.replies.popleft(), special=True, add_bos=False)
        for tok in ids:
            yield from run.emit([(tok, False)])
            if run.reason is not None:
                break
        yield from run.tail()
        yield Stats(prompt_tokens=len(prompt), prefill_tokens=len(prompt), generated_tokens=len(run.out_ids),
                    ttft_s=0.001, prefill_tok_s=1.0, decode_tok_s=1.0, elapsed_s=0.002, cache_bytes=0, state_bytes=0,
                    final=True)
        yield Done(run.reason or "eos")

"""What callers may count on from an engine, as protocols: `EngineLike` is what a local `Engine` (engine.generate)
and a `RemoteEngine` (engine.remote) both offer, so the command lines and the app's worker drive either;
`ServedEngine` adds what the HTTP server (engine.server) reads besides, which only a local engine has."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, Sequence

from engine.chat import ChatFormat, Message
from engine.events import Event, GenerationConfig

if TYPE_CHECKING:  # types only: engine.tokenizer and the model file are below this seam, not used through it
    from engine.storage.modelfile import HParams, ModelFile
    from engine.tokenizer import Tokenizer

Prompt = Sequence[Message | Mapping[str, Any]] | Sequence[int] | str
"""Chat messages (rendered with the model's template), token ids fed as they are, or raw text."""


class EngineLike(Protocol):
    @property
    def notices(self) -> list[str]:
        """What the user should know about this engine (shown by the command line and the app)."""

    @property
    def n_ctx(self) -> int | None:
        """The context in tokens; None where a remote server does not say."""

    def generate(self, prompt: Prompt, gen: GenerationConfig = ...,
                 stop: threading.Event | None = None) -> Iterator[Event]:
        """The reply to `prompt` as `Token`, `Progress` and `Stats` events, then one `Done`; `stop` set ends it
        within a step."""


class ServedEngine(EngineLike, Protocol):
    """The server tokenizes a prompt and measures it against the context before it queues (a bad or too long
    prompt is a 400 at once), and names the model from its file: it needs the model's own tokenizer, template
    and file, so it serves a local engine only (a remote engine is a server already)."""

    @property
    def n_ctx(self) -> int: ...

    @property
    def mf(self) -> ModelFile:
        """The model file: /v1/models names the model by its `general.name`, else the file's stem."""

    @property
    def hp(self) -> HParams:
        """Its `n_vocab` bounds the ids of a token-id prompt."""

    @property
    def tokenizer(self) -> Tokenizer:
        """A text completion prompt is encoded with special tokens parsed."""

    @property
    def chat(self) -> ChatFormat:
        """The rendered chat prompt says whether the reply starts inside a thinking block."""

    @property
    def drafter(self) -> object | None:
        """Not None where the model has an MTP head (/v1/models' `mtp`)."""

    def encode_prompt(self, prompt: Prompt, enable_thinking: bool | None = None) -> list[int]:
        """The ids `generate` would feed for `prompt`."""

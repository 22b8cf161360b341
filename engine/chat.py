"""Chat template (jinja2, from the GGUF's `tokenizer.chat_template`) → prompt text → token ids.

Security: a user who types "<|im_end|>" must not be able to close their own turn. Before rendering,
every special-token text inside any text field of a message (content, reasoning_content, name, tool-call
arguments: every string but the checked role) is swapped for a nonce placeholder made of
private-use characters; after rendering, the template's own text is tokenized with special tokens
recognised, and each placeholder is tokenized as plain text (the tools' descriptions and schemas alike). Template string operations (strip,
split on "</think>") still see ordinary content, so real templates keep working. The template itself comes
from the model file: it runs in engine.template_sandbox, bounded in output size and time.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2

from engine.errors import ChatTemplateError
from engine.template_sandbox import LimitedSandbox, bounded_join, check_length, limits, render_limited

# Used when a file carries no template: plain ChatML, what Qwen models are trained on.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
ROLES = ("system", "user", "assistant", "tool")
MAX_JSON_INDENT = 64  # tojson(indent=...): the indent repeats once per nesting level on every line
STRFTIME_GROWTH = 12  # the most a strftime directive grows its two characters ('%c': 24)


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def _raise(msg: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {msg}")


def _tojson(value: Any, indent: int | str | None = None, **_: Any) -> str:
    """json.dumps, its text measured as it is made."""
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    if width > MAX_JSON_INDENT:
        raise ChatTemplateError(f"the chat template asked for a JSON indent of {width:,}; the limit is "
                                f"{MAX_JSON_INDENT}")
    return bounded_join(json.JSONEncoder(ensure_ascii=False, indent=indent).iterencode(value))


def _strftime_now(fmt: str) -> str:
    check_length(len(fmt) * STRFTIME_GROWTH, "strftime_now")
    return datetime.now().strftime(fmt)


class ChatFormat:
    """Renders conversations with a model's template and turns them into ids safely."""

    def __init__(self, template: str | None, tokenizer: Any):
        self.tokenizer = tokenizer
        self.source = template if template else CHATML_TEMPLATE
        self.is_fallback = not template
        env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.add_filters({"tojson": _tojson})
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        if not isinstance(self.source, str):
            raise ChatTemplateError("the model's chat template ('tokenizer.chat_template') is not text")
        try:
            with limits():  # compiling folds constant expressions: bounded like a render
                self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the model's chat template has a syntax error (line {e.lineno}): {e.message}") from None
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2's compiler on odd input (constant folding, recursion)
            raise ChatTemplateError(f"the model's chat template cannot be compiled: {type(e).__name__}: {_line(e)}") from None
        specials = tokenizer.control_texts()
        # Longest first, so "<|im_start|>" is not matched as a prefix of a longer marker.
        self._special_re = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))) if specials else None

    def render(self, messages: Sequence[Message | Mapping[str, Any]], *, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text exactly as the template produces it (special markers as text). `tools`: function
        definitions as Hugging Face templates take them ({"type": "function", "function": {name, description,
        parameters}}), handed to the template as `tools`."""
        return self._render(_as_dicts(messages), add_generation_prompt, enable_thinking, tools)

    def encode(self, messages: Sequence[Message | Mapping[str, Any]], *, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Token ids for the conversation; message contents and tools can never produce control tokens."""
        msgs = _as_dicts(messages)
        nonce = secrets.token_hex(4)
        protected: list[str] = []

        def protect(m: re.Match[str]) -> str:
            protected.append(m.group(0))
            return f"\ue000{nonce}:{len(protected) - 1}\ue001"

        if self._special_re is not None:
            pattern = self._special_re

            def shield(v: Any) -> Any:
                if isinstance(v, str):
                    return pattern.sub(protect, v)
                if isinstance(v, Mapping):
                    return {k: shield(x) for k, x in v.items()}
                if isinstance(v, (list, tuple)):
                    return [shield(x) for x in v]
                return v

            msgs = [{k: (v if k == "role" else shield(v)) for k, v in m.items()} for m in msgs]
            tools = shield(tools) if tools else tools
        text = self._render(msgs, add_generation_prompt, enable_thinking, tools)
        ids: list[int] = []
        if self.tokenizer.add_bos and self.tokenizer.bos_id is not None:
            ids.append(self.tokenizer.bos_id)
        pos = 0
        for m in re.finditer(f"\ue000{nonce}:(\\d+)\ue001", text):
            ids += self.tokenizer.encode(text[pos:m.start()], special=True, add_bos=False)
            ids += self.tokenizer.encode(protected[int(m.group(1))], special=False, add_bos=False)
            pos = m.end()
        ids += self.tokenizer.encode(text[pos:], special=True, add_bos=False)
        return ids

    def _render(self, msgs: list[dict[str, Any]], add_generation_prompt: bool, enable_thinking: bool | None,
                tools: Sequence[Mapping[str, Any]] | None) -> str:
        tok = self.tokenizer
        ctx: dict[str, Any] = {
            "messages": msgs,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
        }
        if enable_thinking is not None:
            ctx["enable_thinking"] = enable_thinking
        if tools:
            ctx["tools"] = list(tools)
        # what the conversation brings may be printed a few times over: the size limit grows with it
        extra = sum(len(v) for m in msgs for v in m.values() if isinstance(v, str)) + len(json.dumps(tools or []))
        try:
            return render_limited(self._template, ctx, extra_chars=4 * extra)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"the chat template tried a forbidden operation: {_line(e)}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed to render: {_line(e)}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError, MemoryError) as e:
            raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {_line(e)}") from None


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _as_dicts(messages: Sequence[Message | Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        d = {"role": m.role, "content": m.content} if isinstance(m, Message) else dict(m)
        if d.get("role") not in ROLES:
            raise ChatTemplateError(f"message {i} has role {d.get('role')!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(d.get("content"), str):
            raise ChatTemplateError(f"message {i} content must be text")
        out.append(d)
    return out

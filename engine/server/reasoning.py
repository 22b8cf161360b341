"""Thinking text → `reasoning_content`, the rest → `content` (what llama-server and vLLM answer).

Qwen3.5/3.6 templates open the thinking block in the prompt (`<|im_start|>assistant\\n<think>\\n`), so the
reply starts inside it and only `</think>` appears in the output; other models write `<think>` themselves.
Both tags are ordinary text tokens, so the split is on the streamed text: a tail that could be the start of a
tag is held back until the next piece decides it.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a thinking block open for the reply."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN) and CLOSE not in tail[tail.rfind(OPEN):]


class ReasoningSplitter:
    """Feed streamed text with `push`; it returns (reasoning, content) pieces ready to send."""

    def __init__(self, in_reasoning: bool):
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""
        self.strip = in_reasoning  # drop the newlines that follow a tag

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":  # has the reply opened a thinking block itself?
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state, self.strip = head[len(OPEN):], "reasoning", True
                    continue
                if head and not OPEN.startswith(head):
                    self.state = "content"
                    continue
                return reasoning, content
            if self.strip:
                self.buf = self.buf.lstrip("\n")
                self.strip = not self.buf
            if self.state == "content":
                content += self.buf
                self.buf = ""
                return reasoning, content
            i = self.buf.find(CLOSE)
            if i >= 0:
                reasoning += self.buf[:i].rstrip("\n")
                self.buf, self.state, self.strip = self.buf[i + len(CLOSE):], "content", True
                continue
            keep = max((k for k in range(1, len(CLOSE)) if self.buf.endswith(CLOSE[:k])), default=0)
            body = self.buf[:len(self.buf) - keep]
            keep += len(body) - len(body.rstrip("\n"))  # newlines that may lead up to the closing tag
            reasoning += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end of the reply."""
        out, self.buf = self.buf, ""
        return (out, "") if self.state == "reasoning" else ("", out)

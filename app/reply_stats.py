"""What is stored with a reply and the footer shown under it, in plain words:
"18.8 tok/s · 9 tokens · 10 of 10 drafted tokens accepted · 4.3 tokens per step"."""
from __future__ import annotations

from typing import Any

from app.speedup import SERVER
from engine.events import Stats

STOP_WORDS = {"stopped": "stopped by you", "max_tokens": "reached the reply length limit",
              "context_full": "the context is full", "context_overflow": "the conversation does not fit",
              "error": "stopped by an error", "interrupted": "cut off: the server connection failed"}


def mtp_mode(mtp: bool, draft: str) -> str:
    """How a reply was decoded: "off", "auto" or "K=n" (a fixed draft depth); a remote server that chooses for
    itself: app.speedup.SERVER."""
    return "off" if not mtp else ("auto" if draft == "auto" else f"K={draft}")


def stats_dict(st: Stats | None, reason: str, mode: str, model: str, left_out: int = 0) -> dict[str, Any]:
    """`left_out`: the oldest messages of the conversation the reply was made without (they did not fit)."""
    chosen = st is None or st.mtp or mode == SERVER  # else the model has no MTP head: decoded without
    d: dict[str, Any] = {"stop_reason": reason, "mtp": mode if chosen else "off", "model": model}
    if left_out:
        d["left_out"] = left_out
    if st is None:
        return d
    d.update(ttft_s=round(st.ttft_s, 3), prompt_tok_s=round(st.prefill_tok_s, 1),
             decode_tok_s=round(st.decode_tok_s, 2), tokens=st.generated_tokens,
             context_tokens=st.prompt_tokens + st.generated_tokens)
    if st.speculative:
        d.update(drafted=st.speculative.drafted, accepted=st.speculative.accepted,
                 mean_accepted_length=round(st.speculative.mean_accepted_length, 2))
        if st.speculative.source != "engine":  # a remote engine: where the figures came from
            d.update(source=st.speculative.source, server_wide=st.speculative.server_wide)
    return d


def footer(stats: dict[str, Any]) -> str:
    if not stats:
        return ""
    parts = []
    if "decode_tok_s" in stats:
        parts += [f"{stats['decode_tok_s']:.1f} tok/s", f"{stats['tokens']} tokens"]
    if stats.get("drafted"):
        parts.append(f"{stats['accepted']} of {stats['drafted']} drafted tokens accepted")
        if stats["mean_accepted_length"]:
            parts.append(f"{stats['mean_accepted_length']:.1f} tokens per step")
        if stats.get("source"):
            parts.append(f"from {stats['source']}{' (server-wide)' if stats.get('server_wide') else ''}")
    elif stats.get("mtp") == "off":
        parts.append("MTP off")
    elif stats.get("mtp") == SERVER:
        parts.append("the server's own MTP setting: no drafts reported")
    elif stats.get("mtp"):
        parts.append(f"MTP {stats['mtp']}: nothing drafted")
    reason = STOP_WORDS.get(stats.get("stop_reason", ""))
    if reason:
        parts.append(reason)
    if stats.get("left_out"):
        n = stats["left_out"]
        parts.append(f"made without the {n} oldest message{'s' if n > 1 else ''} (they did not fit the context)")
    return " · ".join(parts)

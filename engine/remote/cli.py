"""`generate --remote URL`: the same JSON line as a local run, from a remote engine.

A reply cut mid-way still prints what arrived (`"partial": true`, `stop_reason` "interrupted"), then the one
`error: …` line, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.consume import collect, reply_stats
from engine.events import GenerationConfig
from engine.output import emit
from engine.remote.engine import RemoteConfig, connect


def generate_remote(args: argparse.Namespace, prompt: Any, gen: GenerationConfig) -> int:
    eng = connect(RemoteConfig(args.remote, api_key=args.api_key, model=args.remote_model))
    reply = collect(eng.generate(prompt, gen), echo=not args.json)
    final, done = reply.final, reply.done
    for notice in eng.notices:
        print(f"note: {notice}", file=sys.stderr)
    # drafted/accepted are unknown (null) unless the server reports them; then they come with their source
    stats: dict[str, Any] = {"drafted": None, "accepted": None, "acceptance_by_depth": [], **reply_stats(final, done)}
    stats["remote"] = {"url": eng.wire.base, "server": eng.server, "model": eng.model}
    partial = done.reason == "interrupted"
    if args.json:
        out: dict[str, Any] = {"tokens": reply.tokens, "text": reply.text,
                               "accepted_draft": [False] * len(reply.tokens), "stats": stats}
        if partial:
            out["partial"] = True
        emit(json.dumps(out))
    elif not partial:
        print(f"\n[{done.reason}] {final.generated_tokens} tokens, {final.decode_tok_s:.1f} tok/s decode, "
              f"TTFT {final.ttft_s * 1000:.0f} ms", file=sys.stderr)
    if partial:
        print(f"{'' if args.json else chr(10)}error: {done.message}", file=sys.stderr)
        return 1
    return 0

"""Held-out accuracy and perplexity of the embedded default model (or any GGUF with its vocabulary).

    python bench/default_model_eval.py [MODEL | --fixture] [--limit N] [--n 240] [--threads 1] [--out bench/results/default_model.json]

MODEL defaults to the embedded model (`engine.generate.load(None)`). Every prompt of
`engine.training.data.eval_prompts` (held out of the training corpus by construction) is answered with
greedy decoding through the engine's public API (`Engine.generate`, `max_tokens` 48) and scored by the
task's automatic checker; accuracy is reported overall and per kind. Perplexity is measured on
`heldout_corpus` (held-out dialogues, Bible chapters and stdlib members), per source and overall.
`--limit N` keeps the first N prompts (they interleave the kinds) and N documents per source.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.chat import Message  # noqa: E402
from engine.generate import Done, EngineConfig, GenerationConfig, Stats, Token, load  # noqa: E402
from engine.training.data import KINDS, EvalItem, eval_prompts, heldout_corpus  # noqa: E402
from engine.training.train import target_weights  # noqa: E402


def answer(eng, item: EvalItem, max_tokens: int, mtp: bool = True,  # type: ignore[no-untyped-def]
           spec: list | None = None) -> tuple[str, str, int]:
    """Greedy reply text, the Done reason and the number of generated tokens. With MTP the drafts are one
    token deep (greedy speculation is lossless, so the text is the same) and the final speculative stats
    are appended to `spec`: their depth-1 acceptance is the head's top-1 agreement with the trunk."""
    parts: list[str] = []
    reason, n = "", 0
    msgs = [Message(m.role, m.content) for m in item.messages]
    for ev in eng.generate(msgs, GenerationConfig(max_tokens=max_tokens, mtp=mtp, draft=1), None):
        if isinstance(ev, Token):
            parts.append(ev.text)
            n += len(ev.ids)
        elif isinstance(ev, Done):
            reason = ev.reason
        elif isinstance(ev, Stats) and ev.final and ev.speculative and spec is not None:
            spec.append(dataclasses.asdict(ev.speculative))
    return "".join(parts), reason, n


def accuracy(eng, items: list[EvalItem], max_tokens: int, mtp: bool = True) -> dict:  # type: ignore[no-untyped-def]
    records = []
    per_kind = {k: {"n": 0, "correct": 0} for k in KINDS}
    spec: list[dict] = []
    t0 = time.perf_counter()
    for item in items:
        reply, reason, n_tok = answer(eng, item, max_tokens, mtp, spec)
        ok = item.check(reply)
        per_kind[item.kind]["n"] += 1
        per_kind[item.kind]["correct"] += int(ok)
        records.append({"kind": item.kind, "sub": item.checker_args["sub"], "turns": sum(m.role == "user" for m in item.messages),
                        "system": any(m.role == "system" for m in item.messages), "question": item.question,
                        "reference": item.checker_args["reference"], "reply": reply, "ok": ok, "done": reason,
                        "tokens": n_tok})
    n = len(records)
    correct = sum(r["ok"] for r in records)
    drafted = sum(x["drafted"] for x in spec)
    accepted = sum(x["accepted"] for x in spec)
    return {
        "n": n, "correct": correct, "accuracy": correct / n if n else None,
        "mtp_depth1": {"drafted": drafted, "accepted": accepted,
                       "acceptance": accepted / drafted if drafted else None} if spec else None,
        "per_kind": {k: {**v, "accuracy": v["correct"] / v["n"] if v["n"] else None} for k, v in per_kind.items()},
        "seconds": time.perf_counter() - t0, "items": records,
    }


@torch.no_grad()
def perplexity(eng, docs: list[tuple[str, str]], max_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    """exp(mean next-token NLL) over each document's first `max_tokens` tokens (special tokens as such).
    Dialogues are scored twice: on every token ("dialogue") and on the assistant replies only
    ("dialogue_replies", the tokens the model was trained to produce; questions are random by design)."""
    sums: dict[str, list[float]] = {}
    im_start, im_end = (eng.tokenizer.encode(t, special=True, add_bos=False)[0] for t in ("<|im_start|>", "<|im_end|>"))
    for source, text in docs:
        ids = eng.tokenizer.encode(text, special=True, add_bos=False)[:min(max_tokens, eng.n_ctx)]
        if len(ids) < 2:
            continue
        res = eng.runner.forward(ids, eng.runner.new_cache(len(ids)), logit_rows="all")
        logits = res.logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device),
                                                reduction="none")
        scored = [(source, torch.ones_like(nll))]
        if source == "dialogue":
            w = torch.tensor(target_weights(ids, eng.tokenizer, im_start, im_end)[1:], device=nll.device)
            scored.append(("dialogue_replies", w))
        for name, w in scored:
            s = sums.setdefault(name, [0.0, 0, 0])
            s[0] += float((nll * w).sum())
            s[1] += int(w.sum())
            s[2] += 1
    out = {src: {"docs": d, "tokens": t, "nll_per_token": nll / t, "perplexity": math.exp(nll / t)}
           for src, (nll, t, d) in sorted(sums.items())}
    whole = [v for k, v in sums.items() if k != "dialogue_replies"]  # each token once
    nll = sum(v[0] for v in whole)
    tok = sum(v[1] for v in whole)
    out["all"] = {"docs": sum(v[2] for v in whole), "tokens": tok,
                  "nll_per_token": nll / tok if tok else None, "perplexity": math.exp(nll / tok) if tok else None}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="GGUF path (default: the embedded model)")
    ap.add_argument("--fixture", action="store_true", help="use the tiny random test fixture (smoke test)")
    ap.add_argument("--n", type=int, default=240, help="evaluation prompts (default 240)")
    ap.add_argument("--seed", type=int, default=20261122, help="evaluation set seed")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts and N documents per source")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ppl-tokens", type=int, default=512, help="tokens per perplexity document")
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--no-mtp", action="store_true", help="plain greedy steps (same text; greedy MTP is lossless)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "default_model.json")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.fixture:
        from tests.fixtures import TINY_MOE, fixture_path
        args.model = str(fixture_path(TINY_MOE))
    t0 = time.perf_counter()
    eng = load(args.model, EngineConfig(n_ctx=args.ctx, n_threads=args.threads))
    load_s = time.perf_counter() - t0
    model_path = Path(args.model) if args.model else None
    if model_path is None:
        from engine.storage.modelfile import default_model_path
        model_path = default_model_path()

    items = eval_prompts(args.n, args.seed)
    if args.limit is not None:
        items = items[:args.limit]
    acc = accuracy(eng, items, args.max_tokens, not args.no_mtp)

    ppl = None
    if not args.no_ppl:
        docs = heldout_corpus()
        if args.limit is not None:
            kept: dict[str, int] = {}
            limited = []
            for src, text in docs:
                if kept.get(src, 0) < args.limit:
                    kept[src] = kept.get(src, 0) + 1
                    limited.append((src, text))
            docs = limited
        ppl = perplexity(eng, docs, args.ppl_tokens)

    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(["default_model_eval.py", *argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.machine(), "threads": args.threads},
        "model": {"file": model_path.name, "bytes": model_path.stat().st_size, "arch": eng.hp.arch,
                  "n_vocab": eng.tokenizer.n_vocab},
        "settings": {"n": args.n, "seed": args.seed, "limit": args.limit, "max_tokens": args.max_tokens,
                     "decoding": "greedy", "mtp": not args.no_mtp, "ppl_tokens": args.ppl_tokens, "ctx": args.ctx},
        "load_s": load_s,
        "accuracy": {k: v for k, v in acc.items() if k != "items"},
        "perplexity": ppl,
        "items": acc["items"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"accuracy {acc['correct']}/{acc['n']} = {acc['accuracy']:.3f}" if acc["n"] else "no prompts")
    for k, v in acc["per_kind"].items():
        if v["n"]:
            print(f"  {k:<11} {v['correct']:>3}/{v['n']:<3} {v['accuracy']:.3f}")
    if ppl:
        for src, v in ppl.items():
            if v["tokens"]:
                print(f"perplexity {src:<9} {v['perplexity']:.2f} ({v['tokens']} tokens)")
    if acc["mtp_depth1"]:
        print(f"MTP depth-1 acceptance (head top-1 = trunk) {acc['mtp_depth1']['acceptance']:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

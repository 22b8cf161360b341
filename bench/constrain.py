"""What constrained decoding (response_format json_schema, engine/constrain.py) costs in decode speed: the same
prompts decoded free and under a nested schema, plain and with MTP, greedy and sampled, in alternating rounds.

    python bench/constrain.py [--rounds 3] [--model PATH] [--cases plain/greedy,...] [--lazy]
                              [--out bench/results/constrain.json]

The embedded model (or --model) on the CPU, 3 chat prompts through the chat template. Each constrained reply runs until its JSON is
complete; the free reply of the same case then decodes exactly as many tokens (EOS ignored), so both time the same
length. Decode tok/s is decode tokens over decode seconds from the final Stats (TTFT excluded), summed over the
prompts and rounds; with MTP the drafted and accepted drafts too. Beside it, the per-step pieces of the mask:
llguidance's bitmask (`bits`) at a mid-reply state (inside a string) and averaged over every token of the first prompt's
constrained greedy reply, one token checked (`allows`, what greedy asks first), the greedy choice among the allowed
ids (`masked_argmax`) and a logit row masked (`mask_logits`, what sampling and MTP's confidence read); and the share
of that reply's tokens the schema forced (the only token its mask allowed: a key, its quotes and colon), which the
decoders run without sampling, several in one pass (engine.constrain.Matcher.forced), so a constrained reply can
decode faster than a free one.

--lazy: instead, what tool_choice auto costs a reply that makes no call (the server's lazy constraint,
engine.constrain.LazyMatcher, over the chat's free text): each prompt decoded LAZY_TOKENS tokens free and as many under
`Constraint.lazy` of a tool's call grammar (EOS ignored on both), the mask pieces left out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import decode  # noqa: E402
from bench.decode import git_info, machine_info, write_result  # noqa: E402
from bench.timing import mean_seconds  # noqa: E402
from engine.constrain import Constraint, Matcher  # noqa: E402
from engine.events import GenerationConfig  # noqa: E402
from engine.generate import load  # noqa: E402
from engine import ops  # noqa: E402
from engine.sampling import SamplingConfig  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "home": {"type": "object",
                 "properties": {"city": {"type": "string", "maxLength": 16},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                "kind": {"enum": ["house", "flat", "tent"]}},
                 "required": ["city", "zip", "kind"], "additionalProperties": False},
    },
    "required": ["name", "age", "colours", "home"],
    "additionalProperties": False,
}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}},
          "required": ["people"], "additionalProperties": False}
PROMPTS = ["Describe three people as JSON.", "Who made the heaven?", "Spell the word banana."]
SAMPLINGS = {"greedy": SamplingConfig(), "t0.8": SamplingConfig(temperature=0.8, seed=7)}
MODES = {"plain": (False, None), "mtp_k2": (True, 2)}
LAZY_TOKENS = 256
TOOL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}


def reply(eng, prompt: str, gen: GenerationConfig) -> dict:  # type: ignore[no-untyped-def]
    eng.reset()
    return decode.run_record(decode.final_stats(eng, [{"role": "user", "content": prompt}], gen))


def lazy_constraint(eng) -> Constraint:  # type: ignore[no-untyped-def]
    """The constraint the server gives a chat with one tool under tool_choice auto."""
    from engine import tools as toolkit
    from engine.server.reasoning import CLOSE, OPEN

    fmt = toolkit.tool_format(eng.chat)
    return Constraint.lazy(toolkit.auto_call_grammar(fmt, {"get_weather": TOOL}), toolkit.CALL_OPEN, (OPEN, CLOSE))


def case(eng, sampling: SamplingConfig, mtp: bool, draft: int | None,  # type: ignore[no-untyped-def]
         lazy: Constraint | None = None) -> dict:
    """One round of one case: every prompt constrained, then free over as many tokens (`lazy`: under it and free, each
    LAZY_TOKENS tokens, EOS ignored)."""
    sums = {"free": [0, 0.0, 0, 0], "schema": [0, 0.0, 0, 0]}
    eog = eng.tokenizer.eog_ids
    for prompt in PROMPTS:
        base = GenerationConfig(max_tokens=LAZY_TOKENS if lazy else 512, sampling=sampling, mtp=mtp, draft=draft,
                                stats_interval_s=3600.0)
        try:
            if lazy:  # neither reply ends before LAZY_TOKENS
                eng.tokenizer.eog_ids = frozenset()
            held = reply(eng, prompt, GenerationConfig(**{**base.__dict__,
                                                          "constraint": lazy or Constraint.json_schema(SCHEMA)}))
            eng.tokenizer.eog_ids = frozenset()  # the free reply decodes exactly as many tokens
            free = reply(eng, prompt, GenerationConfig(**{**base.__dict__, "max_tokens": held["generated_tokens"]}))
        finally:
            eng.tokenizer.eog_ids = eog
        for name, r in (("free", free), ("schema", held)):
            for i, key in enumerate(("decode_tokens", "decode_s", "drafted", "accepted")):
                sums[name][i] += r.get(key, 0)
    return {name: {"decode_tokens": n, "decode_s": round(s, 4), **({"drafted": d, "accepted": a} if mtp else {})}
            for name, (n, s, d, a) in sums.items()}


def mask_costs(eng) -> dict:  # type: ignore[no-untyped-def]
    """Microseconds per call of the mask's pieces, the matcher inside the first person's object; and the bitmask's
    mean over a whole constrained reply (its cost moves with the grammar's state: a forced key, a number, a string)."""
    schema = Constraint.json_schema(SCHEMA)
    m = Matcher(schema, eng.tokenizer)
    for t in eng.tokenizer.encode('{"people": [{"name": "Adam", "age": 93, "colours": ["red"], "home": {"city": "',
                                  add_bos=False):
        m.consume(t)
    row, bits = torch.randn(eng.hp.n_vocab), m.bits()
    reps = 2000
    eng.reset()
    gen = GenerationConfig(max_tokens=512, stats_interval_s=3600.0, constraint=schema)
    toks = [t for ev in eng.generate([{"role": "user", "content": PROMPTS[0]}], gen) for t in getattr(ev, "ids", ())]
    walk, spent, forced = Matcher(schema, eng.tokenizer), 0.0, 0
    for t in toks:
        t0 = time.perf_counter()
        walk.bits()
        spent += time.perf_counter() - t0
        forced += walk.only_allows(t)  # the mask just computed
        walk.consume(t)

    def fresh_bits() -> None:
        m._fresh = False  # the matcher keeps a state's mask once computed: computed again each time here
        m.bits()
    return {"vocab": eng.hp.n_vocab, "bits_us": round(mean_seconds(fresh_bits, reps) * 1e6, 1),
            "bits_over_reply_us": round(spent / max(len(toks), 1) * 1e6, 1), "reply_tokens": len(toks),
            "forced_share": round(forced / max(len(toks), 1), 3),
            "allows_us": round(mean_seconds(lambda: m.allows(100), reps) * 1e6, 1),
            "masked_argmax_us": round(mean_seconds(lambda: ops.masked_argmax(row, bits), reps) * 1e6, 1),
            "mask_logits_us": round(mean_seconds(lambda: ops.mask_logits(row, bits), reps) * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--cases", default=",".join(f"{m}/{s}" for s in SAMPLINGS for m in MODES),
                    help="which of mode/sampling to run (default: every one)")
    ap.add_argument("--lazy", action="store_true", help="tool_choice auto's lazy constraint over free text instead")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "constrain.json"))
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    eng = load(args.model)
    lazy = lazy_constraint(eng) if args.lazy else None
    reply(eng, PROMPTS[0], GenerationConfig(max_tokens=16, stats_interval_s=3600.0))  # warm-up
    result: dict = {"command": "python bench/constrain.py " + " ".join(sys.argv[1:]),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
                    "machine": machine_info(torch.get_num_threads()), "torch": torch.__version__,
                    "model": Path(args.model).name if args.model else "embedded",
                    "schema": SCHEMA, "prompts": PROMPTS, "rounds": [], "summary": {}}
    if lazy is not None:
        result["lazy"] = {"tool": TOOL, "trigger": lazy.trigger, "tokens": LAZY_TOKENS}
    t0 = time.perf_counter()
    totals: dict[str, dict[str, list[float]]] = {}
    for rnd in range(args.rounds):
        for s_name, sampling in SAMPLINGS.items():
            for m_name, (mtp, draft) in MODES.items():
                key = f"{m_name}/{s_name}"
                if key not in cases:
                    continue
                r = case(eng, sampling, mtp, draft, lazy)
                result["rounds"].append({"round": rnd, "case": key, **r})
                for name, v in r.items():
                    acc = totals.setdefault(key, {}).setdefault(name, [0, 0.0])
                    acc[0] += v["decode_tokens"]
                    acc[1] += v["decode_s"]
                print(json.dumps({"round": rnd, "case": key, **r}), flush=True)
    for key, t in totals.items():
        free, held = t["free"][0] / t["free"][1], t["schema"][0] / t["schema"][1]
        result["summary"][key] = {"free_tok_s": round(free, 1), "schema_tok_s": round(held, 1),
                                  "cost_pct": round(100 * (1 - held / free), 1)}
    if lazy is None:
        result["mask_us"] = mask_costs(eng)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result["summary"], indent=1), json.dumps(result.get("mask_us")))
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()

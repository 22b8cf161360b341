"""Render docs/benchmarks.md from bench/results/*.json (figures are copied from the JSON, never typed).

    python bench/report.py
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RES = ROOT / "bench" / "results"


def _load(name: str) -> dict | None:
    p = RES / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


# From 4ac649c until b147b71 the benchmarks' llama.cpp children ran with their OpenMP threads asleep at every
# barrier: bench/decode.py's child imported engine (and with it torch, under engine's passive wait policy, into the
# libgomp llama.cpp shares) before running llama.cpp, and a parent that had imported tests.quantized (whose oracle
# sets OMP_WAIT_POLICY=PASSIVE) passed that on. llama.cpp's figures from those runs are too low.
PEER_HANDICAP = ("4ac649c", "b147b71")
PEER_CHILD_BENCHES = ("bench/sweep.py", "bench/mtp_speedup.py", "bench/scale.py", "bench/decode.py",
                      "bench/quant_mix.py", "bench/mtp_agreement.py", "bench/server_parallel.py")


def _is_ancestor(a: str, b: str) -> bool:
    r = subprocess.run(["git", "merge-base", "--is-ancestor", a, b], cwd=ROOT, capture_output=True)
    return r.returncode == 0


def peer_handicapped(d: dict, is_ancestor: Callable[[str, str], bool] = _is_ancestor) -> bool:
    """Whether this result's llama.cpp runs fall in the PEER_HANDICAP window (`is_ancestor(a, b)`: commit a is b or
    one of its ancestors; git's answer by default)."""
    words = d.get("command", "").split()
    commit = (d.get("git") or {}).get("commit", "")
    if len(words) < 2 or words[1] not in PEER_CHILD_BENCHES or not commit:
        return False
    if words[1] == "bench/server_parallel.py" and all(":" not in c for c in d.get("cases", {})):
        return False  # its own llama.cpp child, whose parent quantizes nothing for the embedded model or `mid`
    first, fixed = PEER_HANDICAP
    return is_ancestor(first, commit) and not is_ancestor(fixed, commit)


PEER_CAVEAT = ("**llama.cpp handicapped in this run**: its process ran (or, where the file was made in the same run, "
               "may have run) under a passive OpenMP wait policy (torch "
               "loaded first by bench/decode.py's child, or the policy inherited from a parent that quantized with "
               "tests.quantized; 4ac649c..b147b71), so its threads slept at every barrier and its figures here are "
               "up to several times too low: ratios against it are not evidence.")


def _quant(d: dict) -> list[str]:
    out = ["## Dequantization and matmul per ggml type (`bench/quant.py`)", "",
           f"Command: `{d.get('command', '')}` ({d.get('date', '')}). Billions of weight elements per second (best run).", "",
           "| type | dequant | matmul x[1,k] | matmul x[8,k] |", "|---|---|---|---|"]
    for row in d["results"]:
        g = [row[k]["elements_per_s"] / 1e9 for k in ("dequant", "matmul_x1", "matmul_x8")]
        out.append(f"| {row['type']} | {g[0]:.2f} | {g[1]:.2f} | {g[2]:.2f} |")
    return out + [""]


def _tokenizer(d: dict) -> list[str]:
    return ["## Tokenizer (`bench/tokenizer.py`)", "", f"Command: `{d.get('command', '')}` ({d.get('date', '')}).", "",
            "```", json.dumps({k: v for k, v in d.items() if k not in ("command", "date")}, indent=1), "```", ""]


def _decode(d: dict) -> list[str]:
    if "cases" not in d:
        return _decode_mid_only(d)
    m, ll, st = d["machine"], d["llama_cpp"], d["settings"]
    flags = ", ".join(m.get("flags", [])) or "?"
    load = " / ".join(f"{x:.2f}" for x in m["load_avg_at_start"])
    if m.get("load_avg_at_end"):
        load += ", at end " + " / ".join(f"{x:.2f}" for x in m["load_avg_at_end"])
    out = ["## Prefill / decode / TTFT vs llama.cpp's server (`bench/decode.py`)", "",
           f"Command: `{d['command']}` ({d['date']}"
           + (f", commit {d['git']['commit'][:10]}{' + local changes' if d['git'].get('dirty') else ''}"
              if d.get("git", {}).get("commit") else "") + ").", "",
           f"Machine: {m.get('cpu_model', m['cpu'])}, {m['cores']} cores ({flags}), {st['threads']} threads per engine, "
           f"load average (1 / 5 / 15 min) at start {load}. Foretell backend: `{d['backend']}`; llama.cpp: {ll['package']} "
           f"(`{ll['system_info']}`), its server in-process, draft-mtp with n_max = K (n_min {ll['draft_n_min']}, "
           f"p_min {ll['draft_p_min']}).", "",
           f"{st['decoding'][:1].upper() + st['decoding'][1:]}; every engine run is a fresh process and load"
           + (", warmed up by 4 untimed tokens" if st["warmup"] else ", first request timed (no warm-up)")
           + f"; best of {st['rounds']} round(s) per setting (highest decode and prefill tok/s, lowest TTFT), the "
           "engines alternating. Decode tok/s = (tokens − 1) / time from the first token to the last; TTFT measured "
           "by the caller; prefill tok/s as each engine reports it (ours includes the MTP head's pass over the "
           "prompt). Ratios are ours / llama.cpp: above 1 is faster for tok/s, slower for TTFT.", ""]
    titles = {"embedded": "Embedded default model, chat", "mid": "Mid-size synthetic MoE",
              "load-mid": "Under load: mid-size synthetic MoE", "load-embedded": "Under load: embedded default model"}
    for case, c in d["cases"].items():
        out += _decode_case(titles.get(case, case), c)
    mem = d.get("load_memory")
    if mem:
        out += [f"Peak RSS after loading the mid model in Foretell: {mem['peak_rss_mib']:.0f} MiB for a "
                f"{mem['file_mib']:.0f} MiB file ({mem['ratio']:.2f}× the file; limit 1.3×).", ""]
    return out


def _setting(name: str) -> str:
    return "plain" if name == "off" else "MTP auto" if name == "auto" else f"MTP K={name.removeprefix('k')}"


def _decode_case(title: str, c: dict) -> list[str]:
    o_all, r_all = c["ours"], c["llama_cpp"]
    out = [f"### {title}", "", f"`{c['model']['file']}` ({c['model']['bytes'] / 2**20:.0f} MiB): {c['workload']}.", "",
           "| setting | Foretell decode tok/s | llama.cpp decode tok/s | × decode | Foretell prefill tok/s | "
           "llama.cpp prefill tok/s | Foretell TTFT ms | llama.cpp TTFT ms | Foretell acceptance | "
           "llama.cpp acceptance |", "|---|---|---|---|---|---|---|---|---|---|"]

    def acc(x: dict | None) -> str:
        return f"{x['acceptance']:.3f}" if x and "acceptance" in x else "–"

    for name, o in o_all.items():
        r = r_all.get(name)
        if r is None:
            out.append(f"| {_setting(name)} | {o['decode_tok_s']:.1f} | – | – | {o['prefill_tok_s']:.0f} | – | "
                       f"{o['ttft_ms']:.1f} | – | {acc(o)} | – |")
        else:
            out.append(f"| {_setting(name)} | {o['decode_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                       f"{o['decode_tok_s'] / r['decode_tok_s']:.3f} | {o['prefill_tok_s']:.0f} | "
                       f"{r['prefill_tok_s']:.0f} | {o['ttft_ms']:.1f} | {r['ttft_ms']:.1f} | {acc(o)} | {acc(r)} |")
    labels = {"plain": "plain vs plain", "mtp_best_vs_llama_mtp_best": "our best MTP vs llama.cpp's best draft-mtp",
              "mtp_auto_vs_llama_mtp_best": "our MTP auto vs llama.cpp's best draft-mtp",
              "mtp_best_vs_llama_plain": "our best MTP vs llama.cpp plain",
              "mtp_auto_vs_llama_plain": "our MTP auto vs llama.cpp plain"}
    n_rounds = len(c.get("rounds", []))
    out += ["", f"| ours / llama.cpp | settings | decode | prefill | TTFT | decode, median of {n_rounds} rounds' ratios |",
            "|---|---|---|---|---|---|"]
    for key, q in c["ratios"].items():
        twin = key.replace("mtp_auto", "mtp_best")
        if twin != key and c["ratios"].get(twin, {}).get("ours") == "auto":
            continue  # the same comparison as the row above
        med = c["ratios_median_of_rounds"].get(key, {}).get("decode")
        out.append(f"| {labels.get(key, key)} | {_setting(q['ours'])} / {_setting(q['llama_cpp'])} | "
                   f"{q['decode']:.3f} | {q['prefill']:.3f} | {q['ttft']:.3f} | "
                   + (f"{med:.3f} |" if med is not None else "– |"))
    slow = c.get("slowdown_vs_unloaded")
    if slow:
        out += ["", f"Plain decode under load / without it: Foretell {slow['ours']:.3f}, "
                f"llama.cpp {slow['llama_cpp']:.3f}."]
    return out + [""]


def _decode_mid_only(d: dict) -> list[str]:
    """The earlier layout of decode.json: the mid model only, llama-cpp-python as the peer."""
    o, r, q = d["ours"], d["llama_cpp"], d["ratio_ours_over_llama"]
    mem = d["load_memory"]
    out = ["## Baseline prefill / decode vs llama.cpp (`bench/decode.py`)", "",
           f"Command: `{d['command']}` ({d['date']}), {d['machine']['threads']} threads, mid-size synthetic MoE "
           f"({d['model']['bytes'] / 2**20:.0f} MiB, Q4_K/Q6_K).", "",
           "| | prefill tok/s (512) | decode tok/s (128) |", "|---|---|---|",
           f"| Foretell | {o['prefill_tok_s']:.1f} | {o['decode_tok_s']:.2f} |",
           f"| llama.cpp | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} |",
           f"| ratio | {q['prefill']:.3f} | {q['decode']:.3f} |"]
    if "rounds" in d:
        m = d["ratio_median_of_rounds"]
        out += [f"| median of the {len(d['rounds'])} rounds' ratios | {m['prefill']:.3f} | {m['decode']:.3f} |", "",
                f"Best of {len(d['rounds'])} rounds per engine, the engines alternating (each round from a fresh "
                "load: our prefill includes packing the weights on first use)."]
    return out + ["", f"Peak RSS after loading: {mem['peak_rss_mib']:.0f} MiB for a {mem['file_mib']:.0f} MiB file "
                  f"({mem['ratio']:.2f}× the file; limit 1.3×).", ""]


def _verify(d: dict) -> list[str]:
    title = "mid-size MoE fixture" if d["model"].get("shape") else f"`{d['model']['file']}`"
    out = [f"## Multi-token passes vs one decode step, {title} (`bench/verify.py`)", "",
           f"Command: `{d['command']}` ({d['date']}). Decode step: {d['decode_step_s'] * 1000:.1f} ms.", "",
           "| N | grouped pass / decode | per-token loop / decode | weight bytes read, grouped / decode | "
           "commit keeping N − 1 / decode |", "|---|---|---|---|---|"]
    for row in d["verify"]:
        commit = f"{row['commit_rerun_over_decode']:.2f}" if "commit_rerun_over_decode" in row else "–"
        out.append(f"| {row['n']} | {row['grouped_over_decode']:.2f} | {row['per_token_over_decode']:.2f} | "
                   f"{row['grouped_bytes_over_decode']:.2f} | {commit} |")
    p = d["prefill_512"]
    out += ["", "| prefill 512 tokens | tok/s | speed-up over per-token loop |", "|---|---|---|",
            f"| per-token loop | {p['per_token_loop']['tok_s']:.2f} | 1 |"]
    for name in ("grouped_sequential_gdn", "grouped_chunked_gdn"):
        out.append(f"| {name.replace('_', ' ')} | {p[name]['tok_s']:.1f} | {p[name]['speedup_over_per_token']:.1f} |")
    if "routed_experts_share" in d:
        out += ["", "Where a pass's time goes (separate instrumented run):", "",
                "| N | pass | share in routed experts | distinct experts per MoE layer |", "|---|---|---|---|"]
        out += [f"| {r['n']} | {r['pass_s'] * 1000:.1f} ms | {r['routed_experts_share']:.2f} | "
                f"{r['distinct_experts_per_layer']:.1f} |" for r in d["routed_experts_share"]]
    return out + [""]


def _q8dot(d: dict) -> list[str]:
    dec = d["decode"]
    out = ["## Q8_0 in integers vs dequantize-then-float (`bench/q8dot.py`)", "",
           f"Command: `{d['command']}` ({d['date']}), {d['machine']['threads']} thread(s), best of rounds, the two "
           "paths alternating.", "",
           f"Decode, {dec['workload']}: integer {dec['integer']['decode_tok_s']:.1f} tok/s, float "
           f"{dec['float']['decode_tok_s']:.1f} tok/s (×{dec['speedup']:.2f}).", "",
           "| weight [out × in] | M rows | integer µs | float µs | × | engine uses |", "|---|---|---|---|---|---|"]
    for r in d["products"]:
        out.append(f"| {r['shape'][0]} × {r['shape'][1]} ({r['weight']}) | {r['rows']} | {r['integer_s'] * 1e6:.0f} | "
                   f"{r['float_s'] * 1e6:.0f} | {r['speedup']:.2f} | "
                   f"{'integer' if r.get('engine_integer', True) else 'float'} |")
    return out + [""]


def _kquant(d: dict) -> list[str]:
    kernels = (", ".join(f"{p} = {b}" for p, b in d["backends"].items()) if "backends" in d
               else d.get("kernels", "?"))
    out = ["## Q4_K / Q6_K / Q8_0 native kernels vs the torch paths (`bench/kquant.py`)", "",
           "torch: dequantize-then-float; for Q8_0 rows of ≤ 512 values the torch integer path "
           "(`engine.ops.torch_int8`).", "",
           f"Command: `{d['command']}` ({d['date']}), {d['threads']} thread(s), kernels: {kernels}, best of "
           f"{d['rounds']} rounds, the two paths alternating.", "",
           "Q4_K, Q6_K and Q8_0 native run packed (16 rows interleaved) for AVX512-VNNI where the CPU has it; *stored* "
           "is the stored block order's kernels (× packed = stored / native).", "",
           "| weight [out × in] | M rows | native ms | torch ms | × | native GB/s of weights | stored ms | × packed |",
           "|---|---|---|---|---|---|---|---|"]
    for r in d["products"]:
        stored = (f"{r['stored_order_ms']:.3f} | {r['packed_speedup']:.2f}" if "stored_order_ms" in r else "– | –")
        out.append(f"| {r['out']} × {r['in']} {r['type']} ({r['what']}) | {r['m']} | {r['native_ms']:.3f} | "
                   f"{r['torch_ms']:.3f} | {r['speedup']:.1f} | {r['native_gb_s']:.1f} | {stored} |")
    return out + [""]


def _attention(d: dict) -> list[str]:
    out = ["## Attention over the KV cache (`bench/attention.py`)", "",
           f"Command: `{d['command']}` ({d['date']}), {d['threads']} thread(s), median of {d['reps']} reps, the three "
           "paths alternating. *plain*: the same kernel's plain C loops (scores one key at a time, outputs loaded and "
           "stored per key); *torch*: the engine's torch path.", "",
           "| heads (q / kv × dim) | context | queries | native ms | plain ms | torch ms | × plain | × torch |",
           "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['shape']}: {r['n_head']} / {r['n_head_kv']} × {r['head_dim']} | {r['context']} | "
                   f"{r['queries']} | {r['native_ms']:.3f} | {r['plain_ms']:.3f} | {r['torch_ms']:.3f} | "
                   f"{r['over_plain']:.2f} | {r['over_torch']:.2f} |")
    return out + [""]


def _thread_choice(d: dict) -> list[str]:
    """bench/thread_choice.py: the fixed all-threads step against the chosen count, by placement."""
    out = [f"## Thread count of a decode step: fixed against chosen, {d['model']} (`bench/thread_choice.py`)", "",
           f"Command: `{d['command']}` ({d['date']}"
           + (f"; summary recomputed by `{d['resummarized']}`" if "resummarized" in d else "")
           + f"), {d['threads']} threads, {d['tokens']}-token greedy replies, the "
           "two alternating (each first in turn), the host's placement measured before each pair (split: "
           f"{d['threads']} threads read over 1.5× one thread's bandwidth; contended: less than one thread, a core "
           "taken by the host's other tenants).", "",
           "| placement | iterations | fixed µs a token | chosen µs a token | chosen / fixed |", "|---|---|---|---|---|"]
    for pl, s in d["summary"].items():
        out.append(f"| {pl} | {s['iterations']} | {s['fixed_us_median']:.1f} | {s['chosen_us_median']:.1f} | "
                   f"{s['chosen_over_fixed']:.3f} |")
    return out + [""]


def _mtp(d: dict) -> list[str]:
    at = f", commit {d['git']['commit'][:9]}" + (f": {d['git']['note']}" if "note" in d["git"] else "") \
        if "git" in d else ""
    out = [f"## MTP speculative decoding (`bench/mtp.py`, {d['machine']['threads']} thread(s))", "",
           f"Command: `{d['command']}` ({d['date']}{at}), greedy, at most {d['max_new_tokens']} new tokens per prompt, "
           f"{d['machine']['threads']} thread(s), best of {d['rounds']} rounds.", ""]
    for model, m in d["models"].items():
        out += [f"**{model}** — {m['workload']}", "",
                "| setting | decode tok/s | × MTP off | × MTP off, all rounds | × MTP off, median round | acceptance | by depth "
                "| mean accepted length | mean TTFT ms |", "|---|---|---|---|---|---|---|---|---|"]
        for name, r in m["settings"].items():
            acc = f"{r['acceptance']:.3f}" if "acceptance" in r else "–"
            depth = " / ".join(f"{a:.2f}" for a in r.get("acceptance_by_depth", [])) or "–"
            mal = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "–"
            every = f"{r['speedup_over_off_all_rounds']:.2f}" if "speedup_over_off_all_rounds" in r else "–"
            ttft = f"{r['ttft_ms_mean']:.1f}" if "ttft_ms_mean" in r else "–"
            med = f"{r['speedup_over_off_median_round']:.2f}" if "speedup_over_off_median_round" in r else "–"
            out.append(f"| {name} | {r['decode_tok_s']:.1f} | {r['speedup_over_off']:.2f} | {every} | {med} | {acc} | "
                       f"{depth} | {mal} | {ttft} |")
        out.append("")
    return out


def default_model_figures(ev: dict, mtp: dict | None) -> list[str]:
    """The model card's measured figures (resources/models/README.md), from the committed JSON."""
    a, p = ev["accuracy"], ev["perplexity"]
    out = [f"From `bench/results/default_model.json` (`{ev['command']}`, {ev['date']}), greedy decoding, "
           f"{a['n']} held-out prompts:", "",
           f"- **accuracy {a['correct']}/{a['n']} = {a['accuracy']:.1%}**; per kind: "
           + ", ".join(f"{k} {v['correct']}/{v['n']}" for k, v in a["per_kind"].items() if v["n"]),
           f"- MTP head top-1 agreement with the trunk (greedy acceptance of 1-token drafts over these replies): "
           f"**{a['mtp_depth1']['acceptance']:.3f}** ({a['mtp_depth1']['accepted']}/{a['mtp_depth1']['drafted']})",
           "- held-out perplexity: " + ", ".join(
               f"{k.replace('_', ' ')} {v['perplexity']:.2f} ({v['tokens']} tokens)" for k, v in p.items()),
           f"- load time (`engine.load(None)`, {ev['machine']['threads']} thread): {ev['load_s']:.2f} s; "
           f"file {ev['model']['bytes'] / 2**20:.1f} MiB"]
    out += _model_facts(ev["model"]["file"])
    emb = None if mtp is None else next((m for k, m in mtp["models"].items() if k == ev["model"]["file"]), None)
    if emb is not None:
        st = emb["settings"]
        best = max((k for k in st if k != "off"), key=lambda k: st[k]["decode_tok_s"])
        speed = st[best]["speedup_over_off"]
        verdict = "" if speed > 1.0 else (" — on this small model a draft and a verify cost more than the tokens "
                                          "they save, so MTP off is the fastest and auto decodes mostly plain")
        out.append(f"- decode speed (`bench/results/mtp.json`, {mtp['machine']['threads']} CPU thread): MTP off "
                   f"{st['off']['decode_tok_s']:.1f} tok/s; fastest MTP setting {best} {st[best]['decode_tok_s']:.1f} "
                   f"tok/s (×{speed:.2f}){verdict}; acceptance by depth at K=4: "
                   + " / ".join(f"{x:.2f}" for x in st["k4"]["acceptance_by_depth"]))
    return out


def _model_facts(file: str) -> list[str]:
    """Parameter counts from the GGUF itself and the training run from its committed log."""
    import re

    from engine.storage.modelfile import open_model

    path = ROOT / "resources" / "models" / file
    if not path.exists():
        return []
    mf = open_model(path)
    pc = mf.param_counts
    out = [f"- parameters: {pc.total / 1e6:.2f} M in all, {pc.mtp / 1e6:.2f} M in the MTP block, "
           f"{pc.active / 1e6:.2f} M active per token; types: "
           + ", ".join(f"{k} {v['tensors']} tensors" for k, v in mf.type_histogram().items())]
    log = path.with_suffix(".train.log")
    if log.exists():
        lines = log.read_text().splitlines()
        corpus = next((ln for ln in lines if ln.startswith("corpus:")), "")
        steps = [re.match(r"step\s+(\d+)\s+loss ([\d.]+)\s+mtp ([\d.]+).*?(\d+) tok/s\s+([\d.]+) min", ln)
                 for ln in lines if ln.startswith("step")]
        steps = [m for m in steps if m]
        if steps:
            last = steps[-1]
            out.append(f"- training run (`{log.name}`): {corpus.removeprefix('corpus: ')}; {last.group(1)} steps in "
                       f"{last.group(5)} min at {int(last.group(4)):,} tokens/s; last logged loss {last.group(2)}, "
                       f"MTP loss {last.group(3)}")
    tune = path.with_suffix(".tune.log")
    if tune.exists():
        steps = [re.match(r"step\s+(\d+)\s+mtp ([\d.]+)\s+by depth \[([^]]*)\].*?(\d+) tok/s\s+([\d.]+) min", ln)
                 for ln in tune.read_text().splitlines() if ln.startswith("step")]
        steps = [m for m in steps if m]
        if steps:
            last = steps[-1]
            out.append(f"- MTP head tuned for chained drafts (`{tune.name}`, trunk frozen and byte-identical): "
                       f"{last.group(1)} steps in {last.group(5)} min at {int(last.group(4)):,} tokens/s (one batch's "
                       "loss by depth is logged every 10 steps; batches mix dialogues and prose, so compare the "
                       "acceptance by depth below rather than single logged losses)")
    return out


def _card(ev: dict, mtp: dict | None) -> None:
    card = ROOT / "resources" / "models" / "README.md"
    text = card.read_text()
    begin, end = "<!-- figures:begin (bench/report.py) -->", "<!-- figures:end -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        card.write_text(head + begin + "\n" + "\n".join(default_model_figures(ev, mtp)) + "\n" + end + tail)


def _quant_mix(d: dict) -> list[str]:
    m, st = d["machine"], d["settings"]
    forms = [f for f in next(iter(d["mixes"].values()))["ours_over_llama_cpp"] if f != "ours"]
    out = ["## Quantization mixes vs llama.cpp (`bench/quant_mix.py`)", "",
           f"Command: `{d['command']}` ({d['date']}). Machine: {m.get('cpu_model', m['cpu'])}, {st['threads']} threads "
           f"per engine; llama.cpp: {d['llama_cpp']}. Model: the `{d['model']['shape']}` synthetic MoE written in F16 "
           f"and quantized by llama.cpp into each mix; {st['decoding']}, {st['prompt']}-token prompt, {st['decode']} "
           f"tokens; best of {st['rounds']} round(s), every run a fresh process. *no native product*: weights our "
           "default backend runs dequantized (engine.ops.coverage, the notice `inspect` prints), share of weight "
           "bytes. Forms this CPU lacks, not run: " + (", ".join(d["our_forms_unavailable_on_this_cpu"]) or "none")
           + ".", "",
           "| mix | MiB | expert gate/up · down · attention · GDN | no native product | llama.cpp decode tok/s | "
           "ours decode tok/s | × | " + " | ".join(f"× {f}" for f in forms) + " | prefill × |",
           "|---|---|---|---|---|---|---|" + "---|" * len(forms) + "---|"]
    for mix, x in d["mixes"].items():
        t, runs, q = x["types"], x["runs"], x["ours_over_llama_cpp"]
        types = " · ".join("/".join(t.get(r, ["–"])) for r in ("expert gate/up", "expert down", "attention", "gdn"))
        fb = ", ".join(f"{f['type']} {f['share']:.0%}" for f in x["products"]["fallback"]) or "none"
        out.append(f"| {mix} | {x['bytes'] / 2**20:.0f} | {types} | {fb} | {runs['llama_cpp']['decode_tok_s']:.1f} | "
                   f"{runs['ours']['decode_tok_s']:.1f} ({runs['ours']['backend']}) | {q['ours']['decode']:.2f} | "
                   + " | ".join(f"{q[f]['decode']:.2f}" for f in forms) + f" | {q['ours']['prefill']:.2f} |")
    return out + [""]


def _sweep_types(t: dict) -> str:
    """A file's types, role by role, as `role TYPES` pieces (bench/sweep.py's file facts)."""
    short = {"expert gate/up": "exp gate/up", "expert down": "exp down", "attention": "attn", "gdn": "GDN",
             "shared expert": "shexp", "dense ffn gate/up": "ffn gate/up", "dense ffn down": "ffn down",
             "output": "head", "token_embd": "embd"}
    return "; ".join(f"{label} {'/'.join(t[role])}" for role, label in short.items() if role in t)


def sweep_section(d: dict) -> list[str]:
    """bench/sweep.py: shapes × llama.cpp's quantizations, ours against llama.cpp per cell, and the summary."""
    m, st, s = d["machine"], d["settings"], d["summary"]
    forms = d["our_forms"]
    load = " / ".join(f"{x:.2f}" for x in m["load_avg_at_start"])
    if m.get("load_avg_at_end"):
        load += ", at end " + " / ".join(f"{x:.2f}" for x in m["load_avg_at_end"])
    out = [f"## Shapes × quantizations vs llama.cpp: {', '.join(d['shapes'])} (`bench/sweep.py`)", "",
           f"Command: `{d['command']}` ({d['date']}, commit {d['git'].get('commit', '?')[:10]}"
           f"{' + local changes' if d['git'].get('dirty') else ''}). Machine: {m.get('cpu_model', m['cpu'])}, "
           f"{m['cores']} cores, {st['threads']} threads per engine, load average (1 / 5 / 15 min) at start {load}. "
           f"llama.cpp: {d['llama_cpp']}. {st['decoding'][:1].upper() + st['decoding'][1:]}, {st['prompt']}-token "
           f"prompt, {st['decode']} tokens; best of {st['rounds']} alternating round(s), every run a fresh process. "
           "Files: the embedded model as shipped, the others written in F16 with random weights and quantized by "
           "llama.cpp itself (UD-Q4_K_XL: llama.cpp's Q4_K_M with the overrides "
           + ", ".join(f"`{k}` {v}" for k, v in d["ud_q4_k_xl_overrides"].items()) + "). × = ours / llama.cpp; "
           "the form columns are our decode forced to each ISA form over llama.cpp's; path: our decode step on the "
           "default backend (one call, or op by op and why). Forms this CPU lacks, not run: "
           + (", ".join(d["our_forms_unavailable_on_this_cpu"]) or "none") + ".", "",
           "| shape | layers | vocab | source |", "|---|---|---|---|"]
    for name, sh in d["shapes"].items():
        layers = f"{sh['n_layer']}" + (f" of {sh['layers_reduced_from']}" if sh.get("layers_reduced_from") else "")
        out.append(f"| {name} | {layers} | {sh['n_vocab']:,} | {sh['source']} |")
    out += ["", "| cell | MiB | types | path | llama.cpp decode tok/s | ours decode tok/s | × decode | "
            f"× decode, median of {st['rounds']} rounds | "
            + " | ".join(f"× {f}" for f in forms) + " | llama.cpp prefill tok/s | ours prefill tok/s | × prefill |",
            "|---|---|---|---|---|---|---|---|" + "---|" * len(forms) + "---|---|---|"]
    failed = []
    for key, c in d["cells"].items():
        if "error" in c:
            failed.append(f"{key}: {c['error'].strip().splitlines()[-1] if c['error'].strip() else '?'}")
            continue
        runs, q = c["runs"], c["ours_over_llama_cpp"]
        by_form = {r["backend"]: n for n, r in runs.items() if n != "llama_cpp"}
        path = c["step_path"].get(runs["ours"]["backend"], "?")
        path = "fused step" if path.startswith("one native call") else path
        cols = [f"{q[by_form[f]]['decode']:.2f}" if f in by_form else "–" for f in forms]
        ll, us = runs["llama_cpp"], runs["ours"]
        out.append(f"| {key} | {c['bytes'] / 2**20:.0f} | {_sweep_types(c['types'])} | {path} | "
                   f"{ll['decode_tok_s']:.1f} | {us['decode_tok_s']:.1f} ({us['backend']}) | "
                   f"{q['ours']['decode']:.2f} | {s['cells'][key]['decode_median_of_rounds']:.2f} | "
                   + " | ".join(cols) + f" | {ll['prefill_tok_s']:.0f} | {us['prefill_tok_s']:.0f} | "
                   f"{q['ours']['prefill']:.2f} |")
    out.append("")
    if s.get("median_cell"):
        forms_line = (f"; AVX2 forms' decode over the AVX512 forms': median {s['avx2_over_avx512_median']:.2f}, least "
                      f"{s['avx2_over_avx512_min']:.2f} (target ≥ 0.85)" if s.get("avx2_over_avx512_median") else "")
        if s.get("avxvnni_over_avx512_median"):
            forms_line += (f"; AVX-VNNI forms' over the AVX512 forms': median {s['avxvnni_over_avx512_median']:.2f}, "
                           f"least {s['avxvnni_over_avx512_min']:.2f}")
        out += [f"Summary over {s['measured']} cell(s): median decode ratio ×{s['median_decode']:.2f} (median cell "
                f"{s['median_cell']}; target ≥ 1.3), median prefill ratio ×{s['median_prefill']:.2f}; cells ≥ 1.0× "
                f"llama.cpp: {s['decode_at_least_1']} in decode ({s['decode_median_of_rounds_at_least_1']} by the "
                f"median of rounds), {s['prefill_at_least_1']} in prefill, "
                f"{s['both_at_least_1']} in both (target: all); slowest decode cell {s['worst_decode_cell']}"
                f"{forms_line}.", ""]
    if failed:
        out += ["Cells that failed: " + "; ".join(failed) + ".", ""]
    return out


def _fuzz_gguf(d: dict) -> list[str]:
    out = ["## Damaged GGUF files (`bench/fuzz_gguf.py`)", "",
           f"Seeded mutations (`tests/gguf_mutate.py`, seed {d['seed']}) through the open path of `inspect`/`load` "
           f"(ModelFile + tokenizer + chat template), before ({d['before_commit']}) and after ({d['after_commit']}) "
           f"the validation of issue 29; a case is a hang past {d['timeout_s']} s. typed = a typed error, same = the "
           "identical model, different = a damaged model loaded silently, untyped = another exception.", ""]
    for name, m in d["models"].items():
        out += [f"### {name} (`{m['file']}`, {m['file_bytes']:,} bytes)", "",
                "| class | before: cases | typed | same | different | untyped | hang | after (same cases): typed "
                "| same | different+untyped+hang | after (all): cases | typed | same | bad | max s |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        b, a, s_ = m["before"]["by_class"], m["after"]["by_class"], m["after_on_before_subset"]["by_class"]
        for cls in a:
            bb, aa, ss = b.get(cls, {}), a[cls], s_.get(cls, {})
            bad = lambda r: r.get("different", 0) + r.get("untyped", 0) + r.get("hang", 0) + r.get("crash", 0)  # noqa: E731
            out.append(f"| {cls} | {bb.get('cases', 0)} | {bb.get('typed', 0)} | {bb.get('same', 0)} | "
                       f"{bb.get('different', 0)} | {bb.get('untyped', 0)} | {bb.get('hang', 0)} | {ss.get('typed', 0)} | "
                       f"{ss.get('same', 0)} | {bad(ss)} | {aa['cases']} | {aa['typed']} | {aa['same']} | {bad(aa)} | "
                       f"{aa['max_s']:.2f} |")
        tb, ta = m["before"]["total"], m["after"]["total"]
        out += ["", f"Before: {tb['cases']} cases, {tb['different']} loaded damaged, {tb['untyped']} untyped, "
                f"{tb['hang']} hung, mean {tb['mean_s']:.3f} s per case. After: {ta['cases']} cases, "
                f"{ta['different']} loaded damaged, {ta['untyped']} untyped, {ta['hang']} hung, "
                f"mean {ta['mean_s']:.3f} s, max {ta['max_s']:.2f} s per case.", ""]
    return out


def _products(d: dict) -> list[str]:
    forms = sorted({r["backend"] for r in d["products"]})
    rows = sorted({r["m"] for r in d["products"]})
    out = ["## Native products per weight type (`bench/products.py`)", "",
           f"`{d['command']}` ({d['date']}, {d['cpu']}): weight GB/s of one [{d['products'][0]['out']} × "
           f"{d['products'][0]['in']}] product per type, {d['products'][0]['threads']} thread(s), best of the rounds"
           + ("; in brackets, the share of the read bandwidth measured in the same rounds." if "share_of_read" in
              d["products"][0] else ".") + (f" {d['label']}." if "label" in d else ""), "",
           "| type | " + " | ".join(f"{f} {m} row{'s' if m > 1 else ''}" for f in forms for m in rows) + " |",
           "|---|" + "---|" * (len(forms) * len(rows))]
    by: dict[str, dict] = {}
    for r in d["products"]:
        share = f" ({r['share_of_read']:.2f})" if "share_of_read" in r else ""
        what = r["type"] if r.get("product", "product") == "product" else f"{r['type']} draft logits (bytes a draft reads)"
        by.setdefault(what, {})[(r["backend"], r["m"])] = f"{r['gb_s']:.2f}{share}"
    for t, v in by.items():
        out.append(f"| {t} | " + " | ".join(v.get((f, m), "–") for f in forms for m in rows) + " |")
    return out + [""]


def _constrain(d: dict) -> list[str]:
    if "lazy" in d:  # tool_choice auto's lazy constraint over replies that make no call
        out = ["## tool_choice auto's lazy constraint over free text (`bench/constrain.py --lazy`)", "",
               f"`{d['command']}` ({d['date']}, commit {d['git']['commit'][:10]}, model {d.get('model', 'embedded')}): "
               f"decode tok/s of the same prompts, {d['lazy']['tokens']} tokens each, free and under the lazy "
               "constraint of a tool's call grammar (never triggered), summed over the prompts and rounds.", "",
               "| case | free tok/s | lazy tok/s | cost |", "|---|---|---|---|"]
        return out + [f"| {k} | {v['free_tok_s']:.1f} | {v['schema_tok_s']:.1f} | {v['cost_pct']:.1f} % |"
                      for k, v in d["summary"].items()] + [""]
    m = d["mask_us"]
    out = ["## Constrained decoding cost (`bench/constrain.py`)", "",
           f"`{d['command']}` ({d['date']}, commit {d['git']['commit'][:10]}, model {d.get('model', 'embedded')}): "
           "decode tok/s of the same replies free and held to a nested JSON schema, summed over the prompts and rounds"
           + ("; forced_share: the reply's tokens the schema forced (run unsampled, several in a pass)."
              if "forced_share" in d["mask_us"] else "."), "",
           "| case | free tok/s | schema tok/s | cost |", "|---|---|---|---|"]
    out += [f"| {k} | {v['free_tok_s']:.1f} | {v['schema_tok_s']:.1f} | {v['cost_pct']:.1f} % |"
            for k, v in d["summary"].items()]
    pieces = ", ".join(f"{k} {v}" for k, v in m.items())
    return out + ["", f"Mask pieces (µs unless named): {pieces}.", ""]


def _sampling(d: dict) -> list[str]:
    out = ["## Sampling per token (`bench/sampling.py`)", "",
           f"`{d['command']}` ({d['date']}, commit {d['git']['commit'][:10]}, {d['machine'].get('cpu_model', '?')}, one "
           "thread): `Sampler.sample` on one random logit row (the candidates only) against the distribution's "
           "definition over the whole row (the whole row sorted for top-p, multinomial over the whole row), same run.",
           "", "| vocabulary | setting | sample µs | whole row µs | × |", "|---|---|---|---|---|"]
    out += [f"| {c['vocab']:,} | {c['setting']} | {c['sample_us']:.0f} | {c['whole_row_us']:.0f} | {c['speedup']:.1f} |"
            for c in d["cases"]]
    return out + [""]


def _server_parallel(d: dict) -> list[str]:
    out = ["## Parallel requests vs llama.cpp's n_parallel (`bench/server_parallel.py`)", "",
           f"`{d.get('command', 'python bench/server_parallel.py')}` ({d.get('date', '?')}, commit "
           f"{d['git']['commit'][:10]}, {d['machine'].get('cpu_model', '?')}, {d['machine']['threads']} threads, "
           f"{d['llama_cpp']}): {d['what']}; aggregate decode tok/s (best round), ours --parallel {d['parallel']}.", "",
           "| model | clients | ours aggregate | ours per request | llama.cpp aggregate | llama.cpp per request | "
           "ours × one client | median ours / llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    mtp = [(name, c) for name, c in d["cases"].items() if "mtp_gain" in c]
    for name, c in d["cases"].items():
        for k, v in c["summary"].items():
            o, ll = v["ours"], v["llama.cpp"]
            out.append(f"| {name} | {k} | {o['aggregate_tok_s']:.1f} | {o['per_request_tok_s_mean']:.1f} | "
                       f"{ll['aggregate_tok_s']:.1f} | {ll['per_request_tok_s_mean']:.1f} | "
                       f"{c['scaling_vs_one_client']['ours'][k]:.2f} | {v['ours_vs_llama_median_ratio']:.2f} |")
    if mtp:
        out += ["", "Our server with MTP on (auto depth; `--mtp`) against ours without, same clients:", "",
                "| model | clients | ours + MTP aggregate | × ours without MTP (best rounds) | median of the rounds |",
                "|---|---|---|---|---|"]
        for name, c in mtp:
            for k, g in c["mtp_gain"].items():
                out.append(f"| {name} | {k} | {c['summary'][k]['ours+mtp']['aggregate_tok_s']:.1f} | "
                           f"{g['mtp_gain']:.2f} | {g['mtp_gain_median_of_rounds']:.2f} |")
    return out + [""]


def _batch_mtp(d: dict) -> list[str]:
    out = ["## MTP among batched sequences (`bench/batch_mtp.py`)", "",
           f"`{d['command']}` ({d['date']}, commit {d['git']['commit'][:10]}, {d['machine'].get('cpu_model', '?')}, "
           f"{d['machine']['threads']} threads, {d['tokens']} tokens a sequence): aggregate decode tok/s of k sequences "
           "in one Batch (best round; × plain: median of the rounds' ratios). verify-*: every batched step verifies the "
           "drafts each sequence's depth controller chose; default-*: VerifyChoice decides (the server's default). "
           "k = 1: a sequence alone.", "",
           "| model | k | " + " | ".join(d["settings"]) + " | VerifyChoice windows, verify / plain tok/s |",
           "|---|---|" + "---|" * len(d["settings"]) + "---|"]
    for name, c in d["cases"].items():
        for k, v in c["by_sequences"].items():
            cells = [f"{v['summary'][s]['tok_s']:.1f} (×{v['summary'][s]['x_plain_median']:.2f})" for s in d["settings"]]
            w = v["verify_choice_window_tok_s"]
            win = " / ".join(", ".join(f"{x:.0f}" for x in w.get(f, [])) or "–" for f in ("verify", "plain"))
            out.append(f"| {name} | {k} | " + " | ".join(cells) + f" | {win} |")
    return out + [""]


def _mtp_ab(d: dict) -> list[str]:
    out = ["## MTP head's pass in one native call, before and after (`bench/mtp.py`, alternating)", "",
           f"{d['what']}. Command: `{d['command']}`.", "",
           "| run | off tok/s | k3 tok/s | k3 × off | auto × off |", "|---|---|---|---|---|"]
    for name, r in d["runs"].items():
        for model, m in r["models"].items():
            st = m["settings"]
            out.append(f"| {name} ({model}) | {st['off']['decode_tok_s']:.0f} | {st['k3']['decode_tok_s']:.0f} | "
                       f"{st['k3']['speedup_over_off']:.2f} | {st['auto']['speedup_over_off']:.2f} |")
    return out + [""]


def _scale(d: dict) -> list[str]:
    out = ["## Real scale: Qwen3.6-35B-A3B and Qwen3.5-9B shapes (`bench/scale.py`)", "",
           f"`{d['command']}` ({d['date']}, {d['machine'].get('cpu_model', '')}, {d['machine']['threads']} threads, "
           f"{d['machine']['ram_gib']:.0f} GiB RAM; peer {d['llama_cpp']}, its draft-mtp at n_max "
           f"{d['llama_draft_n_max']}; context {d['n_ctx']}). Random weights in the published shapes and mixes "
           "(bench/synthetic.py); one run per cell, each engine in its own process. cold: the file dropped from the "
           "page cache first; warm: right after a short run of the same engine and mode; mtp: warm, ours at auto "
           "depth.", ""]
    if "earlier_steps" in d:
        e = d["earlier_steps"]
        out[-1:-1] = [f"The {', '.join(e['kept'])} runs are from `{e['command']}` ({e['date']}, commit "
                      f"{e['git']['commit'][:9]}); the others were re-measured by the command above."]
    for name, m in d["models"].items():
        out += [f"### {name} ({m['file_gib']:.1f} GiB file, {m['state_mib']:.0f} MiB KV/GDN state, "
                f"{m['prompt_tokens']}-token prompt, {m['decode_tokens']} tokens)", "",
                "| run | engine | load s | TTFT s | load + TTFT s | prefill tok/s | decode tok/s | peak RSS MiB | "
                "file cached after MiB |", "|---|---|---|---|---|---|---|---|---|"]
        for step, runs in m["runs"].items():
            if step == "auto":  # ours only, plain and MTP auto in alternating pairs: below the table
                continue
            for eng, r in runs.items():
                dec = f"{r['decode_tok_s']:.2f}" if r["decode_tok_s"] else "–"
                out.append(f"| {step} | {eng} | {r['load_s']:.1f} | {r['ttft_s']:.1f} | {r['load_plus_ttft_s']:.1f} | "
                           f"{r['prefill_tok_s']:.1f} | {dec} | {r['peak_rss_mib']:.0f} | {r['cached_after_mib']:.0f} |")
        ra = m["ratios_ours_over_llama"]
        fmt = lambda v: f"×{v:.2f}" if v else "–"  # noqa: E731
        pairs = m["runs"].get("auto", {}).get("pairs")
        how = f" (median of {len(pairs)} alternating pairs: " + ", ".join(
            f"{p['auto']:.2f}/{p['plain']:.2f}" for p in pairs) + " tok/s)" if pairs else " (single runs)"
        out += ["", f"Ours / llama.cpp: decode {fmt(ra['decode_warm'])}, prefill {fmt(ra['prefill_warm'])}, "
                f"decode with MTP {fmt(ra['decode_mtp'])}, speed of load + first token warm "
                f"{fmt(ra['load_plus_ttft_warm_speed'])}, cold {fmt(ra['load_plus_ttft_cold_speed'])}; our MTP auto / "
                f"plain {fmt(m['ours_mtp_auto_over_plain'])}{how}. Peak RSS: ours {m['rss']['ours_peak_mib']:.0f} MiB, "
                f"llama.cpp {m['rss']['llama_peak_mib']:.0f} MiB, budget 1.1 × (file + state) = "
                f"{m['rss']['budget_mib']:.0f} MiB.", ""]
    return out


def _read_bw(d: dict) -> float:
    return next(r["best_gb_s"] for r in d["read_bandwidth"] if r["threads"] == d["threads"])


def _step_profile(d: dict) -> list[str]:
    """bench/step_profile.py: where a decode step's time goes, this build and (step_profile_before.json) an earlier one
    measured on the same host."""
    runs = [("this build", d)]
    before = _load("step_profile_before")
    if before is not None and before.get("cpu") == d.get("cpu"):  # only figures from the same CPU compare
        runs.insert(0, (f"before ({before.get('label', before['date'])})", before))
    out = ["## One decode step, split (`bench/step_profile.py`)", "",
           f"Command: `{d['command']}` ({d['date']}). Read bandwidth of this machine (torch.sum over a float32 buffer, "
           f"{d['threads']} threads, {d['backend']}): {_read_bw(d):.1f} GB/s at the start; where a case measured it "
           "before and after its passes, its share is of the better of those two (machine GB/s). Shares are of the "
           "plain median pass; idle: the threads' idle share; GB/s: weight bytes read per pass / the pass's wall "
           "time; placement: where the host had put the threads, from their read bandwidth against one thread's "
           "(split: each its own memory path, about twice one thread's; shared: little more than one thread's).", "",
           "| build | model | N | best ms | median ms | kernel | torch | python | idle | weight MB | GB/s | machine GB/s "
           "| of machine | placement |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in runs:
        for mname, m in r["models"].items():
            for n, c in m["cases"].items():
                s, b = c["split"], c["bandwidth"]
                out.append(f"| {label} | {mname} | {n} | {1e3 * c['plain']['best_s']:.2f} | "
                           f"{1e3 * c['plain']['median_s']:.2f} | {100 * s['kernel_share']:.0f}% | "
                           f"{100 * s['torch_outside_share']:.0f}% | {100 * s['python_share']:.0f}% | "
                           f"{100 * s['threads_idle_share']:.0f}% | {b['weight_bytes'] / 1e6:.1f} | "
                           f"{b['per_pass_wall_gb_s']:.1f} | {b['machine_read_gb_s']:.1f} | "
                           f"{100 * b['pass_wall_share_of_machine']:.0f}% | {b.get('placement') or '–'} |")
    sections = [(mname, n, c["native_sections"]) for mname, m in d["models"].items() for n, c in m["cases"].items()
                if c.get("native_sections")]
    if sections:
        names = list(sections[0][2]["sections"])
        out += ["", "Inside the fused layers, this build (`engine/native/trace.c`'s section clock; mean ms per pass, "
                "GB/s where a section reads weights; pool_wait lies inside the other sections; prefetch: the ranges handed "
                "to the pool's workers between products, per pass; outside: embedding, "
                "output head and the Python between layer calls):", "",
                "| model | N | pass ms | " + " | ".join(names) + " | outside |",
                "|---|---|---|" + "---|" * (len(names) + 1)]
        for mname, n, ns in sections:
            cells = [f"{v['marks_per_pass']:.0f} jobs, {v['weight_mb_per_pass']:.1f} MB" if k == "prefetch" else
                     f"{v['ms_per_pass']:.2f}" + (f" ({v['gb_s']:.0f} GB/s)" if v["gb_s"] else "")
                     for k, v in ns["sections"].items()]
            out.append(f"| {mname} | {n} | {ns['mean_pass_ms']:.2f} | " + " | ".join(cells)
                       + f" | {ns['outside_layers_ms']:.2f} |")
    out.append("")
    return out


def _mtp_speedup(d: dict) -> list[str]:
    """Per shape and agreement P: both engines' settings, auto against the best fixed depth, and our gain against
    llama.cpp's (each over its own plain decoding)."""
    m = d["machine"]
    cpu, flags = m.get("cpu_model", m.get("cpu", "?")), ", ".join(m.get("flags", [])) or "?"
    out = ["## MTP speedup by head agreement, ours vs llama.cpp's draft-mtp (`bench/mtp_speedup.py`)", "",
           f"Command: `{d['command']}` ({d['date']}, commit {d['git'].get('commit', '?')[:10]}); {cpu} ({flags}), "
           f"{d['settings']['threads']} threads per engine, {d['settings']['rounds']} alternating rounds, "
           f"{d['settings']['decoding']}. Speedup: over the same engine's plain decode (best rounds; median of the "
           "rounds' paired ratios in brackets). Acceptance by draft position and our verify / draft cost in plain "
           "decode steps are ours.", ""]
    for shape, e in d["shapes"].items():
        out += [f"### {shape} ({e['file']['name']}, {e['file']['bytes'] / 2**30:.2f} GiB, "
                f"{e['tokens_per_prompt']} tokens per prompt)", ""]
        rb = e.get("routed_expert_bytes")
        if rb:
            per = ", ".join(f"{k}: {v['distinct_experts_per_layer']:.1f}" for k, v in rb.items() if k != "bytes_per_expert")
            out += [f"Distinct routed experts per MoE layer a pass reads: {per}.", ""]
        for p, r in e["p"].items():
            ours, ll = r["ours"], r["llama_cpp"]
            out += [f"P = {p}:", "", "| engine | setting | decode tok/s | speedup | acceptance by position | "
                    "verify / draft (steps) |", "|---|---|---|---|---|---|"]
            for eng, side in (("Foretell", ours), ("llama.cpp", ll)):
                for name, v in side.items():
                    acc = " / ".join(f"{a:.2f}" for a in v.get("acceptance_by_position", [])[:8]) or \
                        (f"{v['acceptance']:.2f} overall" if "acceptance" in v else "–")
                    cost = v.get("cost_in_decode_steps")
                    cost_s = f"{cost['verify_steps']:.2f} / {cost['draft_steps']:.2f}" if cost else "–"
                    out.append(f"| {eng} | {name} | {v['decode_tok_s']:.2f} | ×{v['speedup']:.2f} "
                               f"(×{v['speedup_median_of_rounds']:.2f}) | {acc} | {cost_s} |")
            fixed = {k: v["speedup"] for k, v in ours.items() if k.startswith("k")}
            best_k = max(fixed, key=fixed.get) if fixed else None
            ll_fixed = {k: v["speedup"] for k, v in ll.items() if k.startswith("k")}
            ll_best = max(ll_fixed.values()) if ll_fixed else None
            line = f"auto ×{ours['auto']['speedup']:.2f}"
            if best_k:
                line += f"; best fixed {best_k} ×{fixed[best_k]:.2f} (auto / best {ours['auto']['speedup'] / max(fixed[best_k], 1.0):.2f})"
            if ll_best:
                line += f"; llama.cpp's best ×{ll_best:.2f} (our auto's gain / its best gain {ours['auto']['speedup'] / ll_best:.2f})"
            if "auto-warm" in ours:
                warm = ours["auto-warm"]["speedup"]
                line += f"; auto from remembered memory ×{warm:.2f}" + \
                    (f" (/ best {warm / max(fixed[best_k], 1.0):.2f})" if best_k else "")
            out += ["", line + ".", ""]
    return out


def _recurrence(d: dict) -> list[str]:
    forms = list(d["us_per_call"])
    ns = list(d["us_per_call"][forms[0]])
    out = ["## GDN recurrence per instruction-set form (`bench/recurrence.py`)", "",
           f"Command: `{d['command']}` (commit {d['git'].get('commit', '')[:10]}). Microseconds per call (best round), "
           "32 value heads, d_k = d_v = 128.", "", "| form | " + " | ".join(f"n = {n}" for n in ns) + " |",
           "|---|" + "---|" * len(ns)]
    for f in forms:
        out.append(f"| {f} | " + " | ".join(f"{d['us_per_call'][f][n]['best']:.1f}" for n in ns) + " |")
    return out + [""]


def _ab_trees(d: dict) -> list[str]:
    out = ["## Two source trees alternating (`bench/ab_trees.py`)", "",
           f"`{d['command']}` ({d['started']}, commit {d['git']['commit'][:10]}): a = {d['trees']['a']}, "
           f"b = {d['trees']['b']}; microseconds a decoded token, median over the rounds' replies."
           + (f" {d['label']}." if "label" in d else ""), "",
           "| model | a us | b us | b / a | b / a by round (min..max) |", "|---|---|---|---|---|"]
    for model, m in d["models"].items():
        lo, hi = m["b_over_a_spread"]
        out.append(f"| {Path(model).name} | {m['median_us']['a']:.1f} | {m['median_us']['b']:.1f} | "
                   f"{m['b_over_a']:.3f} | {lo:.3f}..{hi:.3f} |")
    return out + [""]


def main() -> None:
    lines = ["# Benchmarks", "", "Generated by `python bench/report.py` from `bench/results/*.json`.", ""]
    for name, fn in (("default_model", lambda d: ["## Embedded default model (`bench/default_model_eval.py`)", ""]
                      + default_model_figures(d, _load("mtp")) + [""]),
                     ("decode", _decode), ("step_profile", _step_profile), ("thread_choice_embedded", _thread_choice),
                     ("thread_choice_embedded_contended", _thread_choice), ("thread_choice_mid", _thread_choice),
                     ("thread_choice_mid_contended", _thread_choice), ("verify", _verify), ("verify_default", _verify), ("mtp", _mtp), ("mtp_1thread", _mtp), ("mtp_auto_embedded_before", _mtp),
                     ("mtp_auto_embedded", _mtp), ("quant_mix", _quant_mix), ("kquant", _kquant), ("attention", _attention), ("q8dot", _q8dot), ("quant", _quant),
                     ("tokenizer", _tokenizer), ("fuzz_gguf", _fuzz_gguf), ("products", _products), ("scale", _scale),
                     ("mtp_speedup", _mtp_speedup), ("mtp_speedup_9b", _mtp_speedup),
                     ("mtp_speedup_p0", _mtp_speedup), ("mtp_speedup_auto", _mtp_speedup),
                     ("mtp_speedup_p09", _mtp_speedup), ("mtp_speedup_p06_08", _mtp_speedup),
                     ("mtp_speedup_35b", _mtp_speedup), ("mtp_speedup_35b_auto", _mtp_speedup),
                     ("mtp_speedup_35b_faults", _mtp_speedup), ("head_product", _products),
                     ("head_draft_before", _products), ("head_draft", _products),
                     ("products_kquant_avx512", _products), ("constrain", _constrain), ("constrain_mid", _constrain),
                     ("sweep", sweep_section), ("sweep_9b", sweep_section), ("sweep_9b_stored_avx512", sweep_section),
                     ("sweep_kquant_avx512", sweep_section),
                     ("sweep_08b", sweep_section), ("sweep_more", sweep_section),
                     ("products_avxvnni", _products), ("sweep_avxvnni", sweep_section), ("sampling", _sampling),
                     ("server_parallel", _server_parallel), ("mtp_fused_draft_ab", _mtp_ab),
                     ("mtp_speedup_p099_fused", _mtp_speedup),
                     ("products_nib_before", _products), ("products_nib", _products),
                     ("products_q5k_before", _products), ("products_q5k", _products),
                     ("products_iq4_xs_before", _products), ("products_iq4_xs", _products),
                     ("products_q23_k_before", _products), ("products_q23_k", _products),
                     ("sweep_nib", sweep_section), ("sweep_packed", sweep_section),
                     ("recurrence_before", _recurrence), ("recurrence", _recurrence),
                     ("sweep_avx2", sweep_section), ("sweep_vocab50k", sweep_section),
                     ("mtp_speedup_warm", _mtp_speedup), ("server_parallel_08b_64", _server_parallel),
                     ("server_parallel_08b_before", _server_parallel), ("server_parallel_08b", _server_parallel),
                     ("batch_mtp", _batch_mtp), ("mtp_speedup_9b_rerun", _mtp_speedup),
                     ("sweep_iq", sweep_section), ("server_parallel_mtp", _server_parallel),
                     ("mtp_speedup_draft_rows", _mtp_speedup), ("mtp_speedup_08b_before", _mtp_speedup),
                     ("mtp_speedup_08b", _mtp_speedup), ("mtp_speedup_9b_draft", _mtp_speedup),
                     ("mtp_auto_embedded_rows", _mtp), ("mtp_auto_embedded_quiet", _mtp),
                     ("mtp_speedup_session10", _mtp_speedup), ("constrain_rerun", _constrain),
                     ("constrain_forced", _constrain), ("constrain_forced_mid", _constrain),
                     ("mtp_speedup_whole", _mtp_speedup), ("mtp_speedup_08b_final", _mtp_speedup),
                     ("mtp_speedup_35b_session11", _mtp_speedup), ("mtp_speedup_35b_64", _mtp_speedup),
                     ("sweep_q23_avx2", sweep_section), ("constrain_forced_mid_mtp", _constrain),
                     ("constrain_forced_mid_mtp_chain", _constrain), ("products_tile_before", _products),
                     ("products_tile_after", _products), ("mtp_speedup_tile", _mtp_speedup),
                     ("step_profile_verify", _step_profile), ("mtp_speedup_mid09_r4", _mtp_speedup),
                     ("server_parallel_post_before", _server_parallel), ("server_parallel_post_after", _server_parallel),
                     ("constrain_lazy_before", _constrain), ("constrain_lazy", _constrain),
                     ("sweep_quick_routing", sweep_section), ("mtp_speedup_mid09_routing", _mtp_speedup),
                     ("mtp_speedup_08b_session13", _mtp_speedup), ("ab_router_plain", _ab_trees),
                     ("ab_router_embedded", _ab_trees), ("ab_router_mtp3", _ab_trees),
                     ("sweep_quick_avx2host", sweep_section), ("sweep_avx2host_mixes", sweep_section),
                     ("sweep_avx2host_vocab50k_q23", sweep_section), ("sweep_avx2host_embd_rows", sweep_section),
                     ("sweep_avx2host_embd_q4_0", sweep_section),
                     ("mtp_speedup_mid09_cleanpeer", _mtp_speedup), ("mtp_speedup_08b_cleanpeer", _mtp_speedup)):
        d = _load(name)
        if d is not None:
            section = fn(d)
            if peer_handicapped(d):  # under the section's heading
                section[1:1] = ["", PEER_CAVEAT]
            lines += section
    (ROOT / "docs" / "benchmarks.md").write_text("\n".join(lines))
    ev = _load("default_model")
    if ev is not None:
        _card(ev, _load("mtp"))


if __name__ == "__main__":
    main()

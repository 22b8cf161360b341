"""Train a small qwen35moe with a jointly trained MTP head, and export it as a GGUF.

    python -m engine.training.train --out resources/models/foretell-demo.gguf [--minutes 80] [--seed 0]
        [--device cuda --seq-len 2048 --batch 1] [--dialogues N]

The trunk loss is next-token cross-entropy; the MTP loss (spec §3.6) predicts token t+2 from the trunk's
post-final-norm hidden at t and the embedding of token t+1, through the same `MTPHead` inference runs.
A Switch-style load-balancing term keeps the router from collapsing onto a few experts. Progress (loss,
MTP loss, tokens/s) is printed while it runs; everything is seeded.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from engine.storage.modelfile import HParams
from engine.training.model import ModelParams
from engine.storage.writer import Vocab, make_hparams, write_gguf


@dataclass(frozen=True)
class TrainConfig:
    n_embd: int = 256
    n_layer: int = 8  # full attention every 4th layer
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    ssm_n_group: int = 4
    ssm_dt_rank: int = 8
    ssm_d_state: int = 32
    n_expert: int = 16
    n_expert_used: int = 4
    n_ff_exp: int = 128
    n_ff_shexp: int = 256
    seq_len: int = 256
    batch: int = 8
    gdn_chunk: int = 64  # chunk of the parallel delta rule (longer chunks: fewer sequential steps on a GPU)
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.5
    # Chained drafting feeds the head its own output as the next hidden: optionally train that too, at these
    # weights for draft depths 2, 3, … (relative to depth 1), with teacher-forced tokens (--mtp-chain 0.6,0.4).
    # The shipped model was trained without it (depth 1 only).
    mtp_chain: tuple[float, ...] = ()
    balance_weight: float = 0.01
    seed: int = 0


def hparams_for(cfg: TrainConfig, n_vocab: int) -> HParams:
    return make_hparams(
        "qwen35moe", n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_vocab=n_vocab, n_head=cfg.n_head,
        n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, ssm_n_group=cfg.ssm_n_group, ssm_dt_rank=cfg.ssm_dt_rank,
        ssm_d_state=cfg.ssm_d_state, n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used,
        n_ff_exp=cfg.n_ff_exp, n_ff_shexp=cfg.n_ff_shexp, n_mtp=1, n_ctx_train=4096,
    )


def target_weights(doc: list[int], tok, im_start: int, im_end: int) -> list[float]:
    """Loss weight of each token as a prediction target: in ChatML dialogues only the assistant's replies
    (and their closing <|im_end|>) are learned — questions are context; plain documents count in full."""
    if im_start not in doc:
        return [1.0] * len(doc)
    w, i, assistant = [0.0] * len(doc), 0, False
    while i < len(doc):
        if doc[i] == im_start:  # role header: up to the token that holds the newline
            j = i + 1
            while j < len(doc) and "\n" not in tok.decode([doc[j]]):
                j += 1
            assistant = tok.decode(doc[i + 1:j + 1]).strip() == "assistant"
            i = j + 1
            continue
        w[i] = 1.0 if assistant else 0.0
        if doc[i] == im_end:
            assistant = False
        i += 1
    return w


def pack(docs: Sequence[list[int]], seq_len: int, sep: int,
         weights: Sequence[list[float]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents joined by `sep`, cut into rows of seq_len + 1 tokens (inputs + shifted targets), with each
    token's weight as a target (default 1)."""
    flat: list[int] = []
    wflat: list[float] = []
    for k, d in enumerate(docs):
        flat += d + [sep]
        wflat += (list(weights[k]) if weights is not None else [1.0] * len(d)) + [1.0]
    n = (len(flat) - 1) // seq_len
    t = torch.tensor(flat[:n * seq_len + 1], dtype=torch.long)
    w = torch.tensor(wflat[:n * seq_len + 1], dtype=torch.float32)
    rows = [slice(i * seq_len, (i + 1) * seq_len + 1) for i in range(n)]
    return torch.stack([t[r] for r in rows]), torch.stack([w[r] for r in rows])


def losses(params: ModelParams, seq: torch.Tensor, cfg: TrainConfig, weights: torch.Tensor | None = None, *,
           trunk_loss: bool = True, per_depth: bool = False) -> tuple[torch.Tensor, ...]:
    """(trunk CE, MTP CE summed over draft depths, load-balance term) for a batch of sequences of seq_len + 1 tokens ([B, T+1], or
    one sequence [T+1]) run in one pass; `weights` are the tokens' weights as targets (see target_weights).
    trunk_loss=False skips the trunk's logits (tuning the head alone: CE is then 0); per_depth=True appends
    the list of the MTP CE of each depth."""
    hp = params.hparams
    seq = seq.view(-1, seq.shape[-1])
    B, T = seq.shape[0], seq.shape[1] - 1
    model = params.build(n_ctx=B * T, gdn_chunk=cfg.gdn_chunk, n_seq=B)
    router_logits: list[torch.Tensor] = []

    def hook(name: str, il: int, t: torch.Tensor) -> None:
        if name == "ffn_moe_logits":
            router_logits.append(t)

    x, y = seq[:, :-1], seq[:, 1:]
    wy = torch.ones(y.shape, device=y.device) if weights is None else weights.view(B, -1)[:, 1:]
    # The B sequences are flattened one after the other; their positions run on from one sequence to the
    # next, which RoPE cannot see (attention scores depend on position differences within a sequence).
    res = model.forward(x, model.new_cache(B * T), logit_rows="all" if trunk_loss else "none", chunked=True, hook=hook)
    ce = _weighted_ce(res.logits, y.reshape(-1), wy.reshape(-1)) if trunk_loss else torch.zeros((), device=seq.device)
    # MTP: the row for position p pairs token x_{p+1} with the trunk's hidden h_p and predicts x_{p+2}.
    head = model.mtp
    assert head is not None
    # Depth j (chained): row p pairs token x_{p+j} with the head's depth-(j−1) output for row p, predicts x_{p+j+1}.
    hidden = res.hidden.view(B, T, -1)[:, :-1]
    mtp_ce = torch.zeros((), device=seq.device)
    depths: list[torch.Tensor] = []
    for j, wj in enumerate((1.0,) + tuple(cfg.mtp_chain), start=1):
        if T - j < 2:
            break
        mres = head.forward(x[:, j:], hidden[:, :T - j].reshape(B * (T - j), -1), head.new_cache(B * T),
                            logit_rows="all")
        ce_j = _weighted_ce(mres.logits, y[:, j:].reshape(-1), wy[:, j:].reshape(-1))
        mtp_ce = mtp_ce + wj * ce_j
        depths.append(ce_j.detach())
        hidden = mres.hidden.view(B, T - j, -1)
    bal = torch.zeros((), device=seq.device)
    for lg in router_logits:  # Switch: E · Σ_e (fraction routed to e) · (mean router prob of e)
        p = torch.softmax(lg, -1)
        frac = torch.zeros(hp.n_expert, device=lg.device).index_add_(
            0, p.topk(hp.n_expert_used, -1).indices.reshape(-1),
            torch.ones(p.shape[0] * hp.n_expert_used, device=lg.device))
        bal = bal + hp.n_expert * (frac / frac.sum() * p.mean(0)).sum()
    if per_depth:
        return ce, mtp_ce, bal / max(len(router_logits), 1), depths
    return ce, mtp_ce, bal / max(len(router_logits), 1)


def _weighted_ce(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum().clamp(min=1.0)


def train(data: tuple[torch.Tensor, torch.Tensor], params: ModelParams, cfg: TrainConfig, seconds: float,
          max_steps: int | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """Train until `seconds` have passed (or max_steps); returns the progress records."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    decay = [p for n, p in params.named_parameters() if p.dim() >= 2]
    other = [p for n, p in params.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    t0 = time.perf_counter()
    history: list[dict] = []
    step, tokens = 0, 0
    est_steps = max_steps or 10**9
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds or (max_steps is not None and step >= max_steps):
            break
        # Cosine schedule over the time budget (or the step budget), after a linear warm-up.
        frac = step / est_steps if max_steps else elapsed / seconds
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        rows = torch.tensor([rng.randrange(len(data[0])) for _ in range(cfg.batch)], device=data[0].device)
        opt.zero_grad(set_to_none=True)
        ce, mtp_ce, bal = losses(params, data[0][rows], cfg, data[1][rows])
        (ce + cfg.mtp_weight * mtp_ce + cfg.balance_weight * bal).backward()
        torch.nn.utils.clip_grad_norm_(params.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += cfg.batch * cfg.seq_len
        if step % 10 == 0 or step == 1:
            el = time.perf_counter() - t0
            rec = {"step": step, "loss": float(ce.detach()), "mtp_loss": float(mtp_ce.detach()), "lr": lr,
                   "tokens": tokens, "tok_s": tokens / el, "elapsed_s": el}
            history.append(rec)
            log(f"step {step:5d}  loss {rec['loss']:.3f}  mtp {rec['mtp_loss']:.3f}  lr {lr:.2e}  "
                f"{rec['tok_s']:.0f} tok/s  {el / 60:.1f} min")
    return history


def export(params: ModelParams, vocab: Vocab, path: str | os.PathLike[str], name: str, extra: dict,
           qtype: str = "Q8_0") -> None:
    """Write the GGUF: Q8_0 matrices, F32 norms/gates/conv (the writer applies llama.cpp's type rules)."""
    from gguf import GGMLQuantizationType as T

    write_gguf(path, params.hparams, params.export_tensors(), vocab, qtype=T[qtype], name=name,
               extra_kv={"foretell.training": json.dumps(extra)})


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=80.0)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the same code on either)")
    ap.add_argument("--seq-len", type=int, default=TrainConfig.seq_len,
                    help="tokens per training sequence (a GPU prefers few long ones: launches, not FLOPs, bound it)")
    ap.add_argument("--batch", type=int, default=TrainConfig.batch, help="sequences per optimizer step")
    ap.add_argument("--gdn-chunk", type=int, default=TrainConfig.gdn_chunk, help="chunk of the parallel delta rule")
    ap.add_argument("--dialogues", type=int, default=24_000, help="generated ChatML dialogues in the corpus")
    ap.add_argument("--mtp-chain", type=lambda v: tuple(float(x) for x in v.split(",") if x), default=(),
                    help="loss weights of chained MTP drafts at depths 2, 3, … (e.g. 0.6,0.4; default: none)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 weights, TF32 products: ample for training
    from engine.chat import CHATML_TEMPLATE
    from engine.tokenizer import PRE_TOKENIZER_PATTERNS, Tokenizer
    from engine.training import data as corpus
    from engine.training.bpe import train_bpe

    cfg = TrainConfig(seed=args.seed, seq_len=args.seq_len, batch=args.batch, gdn_chunk=args.gdn_chunk,
                      mtp_chain=args.mtp_chain)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    t0 = time.perf_counter()
    docs = corpus.build_corpus(seed=cfg.seed, n_dialogues=args.dialogues)
    vocab = train_bpe(docs, args.vocab, pattern=PRE_TOKENIZER_PATTERNS["qwen35"], chat_template=CHATML_TEMPLATE)
    tok = Tokenizer.from_metadata(_vocab_metadata(vocab))
    ids = tok.encode_batch(docs, special=True)
    im_start, im_end = (tok.encode(t, special=True)[0] for t in ("<|im_start|>", "<|im_end|>"))
    data = pack(ids, cfg.seq_len, vocab.bos_id, [target_weights(d, tok, im_start, im_end) for d in ids])
    data = (data[0].to(args.device), data[1].to(args.device))
    print(f"corpus: {len(docs)} documents, {sum(map(len, ids))} tokens, {len(data[0])} rows "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    params = ModelParams(hparams_for(cfg, len(vocab.tokens)), seed=cfg.seed).to(args.device)
    n_params = sum(p.numel() for p in params.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters", flush=True)
    hist = train(data, params, cfg, seconds=args.minutes * 60, max_steps=args.max_steps,
                 log=lambda s: print(s, flush=True))
    extra = {"config": asdict(cfg), "device": args.device, "dialogues": args.dialogues,
             "tokens_seen": hist[-1]["tokens"] if hist else 0, "steps": hist[-1]["step"] if hist else 0,
             "train_seconds": hist[-1]["elapsed_s"] if hist else 0.0, "final_loss": hist[-1]["loss"] if hist else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    export(params, vocab, args.out, "foretell-demo", extra)
    print(f"wrote {args.out}", flush=True)
    return 0


def _vocab_metadata(v: Vocab) -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": v.pre, "tokenizer.ggml.tokens": v.tokens,
            "tokenizer.ggml.token_type": v.token_types, "tokenizer.ggml.merges": v.merges,
            "tokenizer.ggml.bos_token_id": v.bos_id, "tokenizer.ggml.eos_token_id": v.eos_id,
            "tokenizer.ggml.add_bos_token": v.add_bos}


if __name__ == "__main__":
    sys.exit(main())

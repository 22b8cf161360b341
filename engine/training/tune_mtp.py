"""Fine-tune only the MTP head of a trained model for chained drafting; the trunk stays byte-identical.

    python -m engine.training.tune_mtp --model resources/models/foretell-demo.gguf --out OUT.gguf \
        [--minutes 30] [--chain 0.8,0.6,0.4] [--threads 1] [--seq-len 256] [--batch 8] [--lr 5e-4]

Chained drafts feed the head its own post-norm output as the next hidden state. A head trained at depth 1
only sees the trunk's hidden there, so its depth-2+ drafts are poor (acceptance 0.37 / 0.17 on the embedded
model). This trains the head (block L = n_layer: `blk.L.*`) on depth 1 plus chained depths 2, 3, … with
teacher-forced tokens (`train.losses` with `mtp_chain`), reading the frozen trunk exactly as dequantized
from the file. The output is the input file with only block L's tensor bytes replaced (same types, same
sizes), so the trunk, the vocabulary and all metadata are untouched.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from engine.storage.modelfile import ModelFile, expected_tensors, open_model
from engine.tokenizer import Tokenizer
from engine.training import data as corpus
from engine.training.model import ModelParams, _key, _param_name
from engine.training.train import TrainConfig, losses, pack, target_weights


def load_params(mf: ModelFile) -> ModelParams:
    """The file's tensors as float parameters (ssm_a back to A_log)."""
    hp = mf.hparams
    params = ModelParams(hp, tied=not mf.has_tensor("output.weight"))
    with torch.no_grad():
        for name, _, _ in expected_tensors(hp):
            if not (params.has_tensor(name) and mf.has_tensor(name)):
                continue
            val = mf.tensor(name).dequantize().float()
            if name.endswith(".ssm_a"):
                val = torch.log(-val)
            dst = params.p[_key(_param_name(name))]
            dst.copy_(val.reshape(dst.shape))
    return params


def head_prefix(mf: ModelFile) -> str:
    return f"blk.{mf.hparams.n_layer}."


def write_tuned(src: Path, dst: Path, params: ModelParams, prefix: str) -> list[str]:
    """Copy `src` to `dst` with the bytes of the tensors under `prefix` re-quantized from `params`."""
    tmp = dst.with_suffix(dst.suffix + ".part")
    shutil.copyfile(src, tmp)
    reader = GGUFReader(src)
    changed = []
    with open(tmp, "r+b") as f:
        for t in reader.tensors:
            if not t.name.startswith(prefix):
                continue
            name = t.name
            val = (params.tensor(name) if params.has_tensor(name) else None)
            if val is None:
                continue
            arr = val.detach().float().cpu().numpy()
            qt = QT(t.tensor_type)
            if qt == QT.F32:
                blob = arr.astype(np.float32).tobytes()
            elif qt in (QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_K, QT.Q6_K):
                blob = np.ascontiguousarray(gq.quantize(arr, qt)).tobytes()
            else:
                raise ValueError(f"{name}: cannot re-quantize type {qt.name}")
            if len(blob) != t.n_bytes:
                raise ValueError(f"{name}: {len(blob)} bytes instead of {t.n_bytes}")
            f.seek(t.data_offset)
            f.write(blob)
            changed.append(name)
    tmp.replace(dst)
    return changed


def check_trunk_identical(a: Path, b: Path, prefix: str) -> None:
    """Every tensor outside `prefix` and the metadata bytes are identical between the two files."""
    ra, rb = GGUFReader(a), GGUFReader(b)
    first = min(t.data_offset for t in ra.tensors)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        if fa.read(first) != fb.read(first):
            raise AssertionError("metadata differs")
    for ta, tb in zip(ra.tensors, rb.tensors):
        if ta.name != tb.name or (not ta.name.startswith(prefix) and not np.array_equal(ta.data, tb.data)):
            raise AssertionError(f"trunk tensor {ta.name} differs")


def tune(params: ModelParams, data: tuple[torch.Tensor, torch.Tensor], cfg: TrainConfig, prefix: str,
         seconds: float, lr: float, max_steps: int | None = None, log=print) -> list[dict]:  # type: ignore[no-untyped-def]
    """AdamW on the head's parameters only (warm-up, cosine to 10 % over the time or step budget)."""
    head = [p for n, p in params.p.items() if n.startswith(_key(prefix))]
    for p in params.parameters():
        p.requires_grad_(False)
    for p in head:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(head, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(cfg.seed)
    t0, step, hist = time.perf_counter(), 0, []
    while True:
        el = time.perf_counter() - t0
        if el >= seconds or (max_steps is not None and step >= max_steps):
            break
        frac = step / max_steps if max_steps else el / seconds
        cur = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = cur
        rows = torch.tensor([rng.randrange(len(data[0])) for _ in range(cfg.batch)])
        opt.zero_grad(set_to_none=True)
        _, mtp_ce, _, per_depth = losses(params, data[0][rows], cfg, data[1][rows], trunk_loss=False, per_depth=True)
        mtp_ce.backward()
        torch.nn.utils.clip_grad_norm_(head, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            el = time.perf_counter() - t0
            rec = {"step": step, "mtp_loss": float(mtp_ce.detach()), "by_depth": [round(float(x), 4) for x in per_depth],
                   "lr": cur, "tokens": step * cfg.batch * cfg.seq_len, "elapsed_s": el}
            hist.append(rec)
            log(f"step {step:5d}  mtp {rec['mtp_loss']:.3f}  by depth {rec['by_depth']}  lr {cur:.2e}  "
                f"{rec['tokens'] / el:.0f} tok/s  {el / 60:.1f} min")
    if hist and hist[-1]["step"] != step:
        hist.append({"step": step, "mtp_loss": float(mtp_ce.detach()),
                     "by_depth": [round(float(x), 4) for x in per_depth], "lr": cur,
                     "tokens": step * cfg.batch * cfg.seq_len, "elapsed_s": time.perf_counter() - t0})
    return hist


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--chain", type=lambda v: tuple(float(x) for x in v.split(",") if x), default=(0.8, 0.6, 0.4),
                    help="loss weights of chained depths 2, 3, … relative to depth 1")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--dialogues", type=int, default=None, help="default: as the model was trained")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    src, dst = Path(args.model), Path(args.out)
    mf = open_model(src)
    if not mf.hparams.has_mtp:
        sys.exit(f"error: {src.name} has no MTP head")
    trained = json.loads(mf.get("foretell.training") or "{}")
    dialogues = args.dialogues or trained.get("dialogues", 24_000)
    t0 = time.perf_counter()
    tok = Tokenizer.from_metadata(mf.metadata)
    docs = corpus.build_corpus(seed=trained.get("config", {}).get("seed", 0), n_dialogues=dialogues)
    ids = tok.encode_batch(docs, special=True)
    im_start, im_end = (tok.encode(t, special=True)[0] for t in ("<|im_start|>", "<|im_end|>"))
    bos = mf.get("tokenizer.ggml.bos_token_id")
    data = pack(ids, args.seq_len, bos, [target_weights(d, tok, im_start, im_end) for d in ids])
    print(f"corpus: {len(docs)} documents, {len(data[0])} rows of {args.seq_len} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    cfg = TrainConfig(seq_len=args.seq_len, batch=args.batch, mtp_chain=args.chain, seed=args.seed)
    params = load_params(mf)
    prefix = head_prefix(mf)
    hist = tune(params, data, cfg, prefix, args.minutes * 60, args.lr, args.max_steps,
                log=lambda s: print(s, flush=True))
    dst.parent.mkdir(parents=True, exist_ok=True)
    changed = write_tuned(src, dst, params, prefix)
    check_trunk_identical(src, dst, prefix)
    print(f"wrote {dst}: {len(changed)} tensors of {prefix}* replaced, everything else byte-identical "
          f"({hist[-1]['step'] if hist else 0} steps)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`foretell-cli` / `python -m engine`: inspect and tokenize (the contract in docs/DESIGN.md).

Every failure prints one line `error: …` on stderr and exits 1 (2 for bad arguments).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from engine.errors import EngineError

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "resources" / "models"


def default_model_path() -> Path:
    """The embedded default model shipped in resources/models/ (the newest .gguf there)."""
    found = sorted(EMBEDDED_DIR.glob("*.gguf")) if EMBEDDED_DIR.is_dir() else []
    if not found:
        raise EngineError(f"no MODEL given and no embedded model found in {EMBEDDED_DIR}; pass a GGUF path")
    return found[-1]


def _model_arg(value: str | None) -> Path:
    return Path(value) if value else default_model_path()


def cmd_inspect(args: argparse.Namespace) -> int:
    from engine.modelfile import open_model

    mf = open_model(_model_arg(args.model))
    hp = mf.hparams
    pc = mf.param_counts
    info: dict[str, Any] = {
        "file": str(mf.path),
        "file_bytes": mf.file_size,
        "name": mf.get("general.name"),
        "architecture": hp.arch,
        "hparams": {
            "trunk_layers": hp.n_layer, "mtp_layers": hp.n_mtp, "n_embd": hp.n_embd, "n_vocab": hp.n_vocab,
            "context_length": hp.n_ctx_train, "attention_heads": hp.n_head, "kv_heads": hp.n_head_kv,
            "head_dim": hp.head_dim_k, "rope_dims": hp.n_rot, "rope_base": hp.rope_base,
            "rope_sections": list(hp.rope_sections), "full_attention_interval": hp.full_attention_interval,
            "gdn_k_heads": hp.ssm_n_group, "gdn_v_heads": hp.ssm_dt_rank, "gdn_head_dim": hp.ssm_d_state,
            "conv_kernel": hp.ssm_conv_kernel, "experts": hp.n_expert, "experts_used": hp.n_expert_used,
            "expert_ffn": hp.n_ff_exp, "shared_expert_ffn": hp.n_ff_shexp, "dense_ffn": hp.n_ff,
            "rms_eps": hp.rms_eps,
        },
        "layer_pattern": mf.layer_pattern(),
        "recurrent_layers": list(hp.recurrent_layers),
        "attention_layers": list(hp.attention_layers),
        "mtp": hp.has_mtp,
        "params": {"total": pc.total, "trunk": pc.trunk, "active_per_token": pc.active, "mtp": pc.mtp},
        "tensor_types": mf.type_histogram(),
        "state_bytes_per_sequence": {
            "gdn_conv": 4 * hp.conv_state_floats() * len(hp.recurrent_layers),
            "gdn_recurrent": 4 * hp.ssm_state_floats() * len(hp.recurrent_layers),
            "kv_per_token": 4 * 2 * hp.n_head_kv * hp.head_dim_k * len(hp.attention_layers),
        },
    }
    if args.tensors:
        info["tensors"] = [
            {"name": t.name, "type": t.qtype.name, "shape": list(t.shape), "bytes": t.n_bytes}
            for t in mf.tensors.values()
        ]
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_inspect(info)
    return 0


def _print_inspect(info: dict[str, Any]) -> None:
    hp, pc = info["hparams"], info["params"]
    print(f"{info['file']}  ({_size(info['file_bytes'])})")
    print(f"  name          {info['name'] or '-'}")
    print(f"  architecture  {info['architecture']}   MTP block: {'yes' if info['mtp'] else 'no'}")
    print(f"  layers        {hp['trunk_layers']} trunk + {hp['mtp_layers']} MTP   pattern {info['layer_pattern']}"
          "  (R = Gated DeltaNet, A = gated attention, M = MTP)")
    print(f"  hidden        {hp['n_embd']}   vocab {hp['n_vocab']}   context {hp['context_length']}")
    print(f"  attention     {hp['attention_heads']} q / {hp['kv_heads']} kv heads × {hp['head_dim']}, "
          f"rope {hp['rope_dims']} dims, base {hp['rope_base']:g}")
    print(f"  gated delta   {hp['gdn_k_heads']} k / {hp['gdn_v_heads']} v heads × {hp['gdn_head_dim']}, conv {hp['conv_kernel']}")
    if hp["experts"]:
        print(f"  MoE           {hp['experts']} experts, top-{hp['experts_used']}, expert FFN {hp['expert_ffn']}, "
              f"shared FFN {hp['shared_expert_ffn']}")
    else:
        print(f"  FFN           dense, {hp['dense_ffn']}")
    print(f"  parameters    {_count(pc['total'])} total, {_count(pc['trunk'])} trunk, "
          f"{_count(pc['active_per_token'])} active per token, {_count(pc['mtp'])} MTP")
    st = info["state_bytes_per_sequence"]
    print(f"  state         GDN {_size(st['gdn_conv'] + st['gdn_recurrent'])} per sequence, "
          f"KV {_size(st['kv_per_token'])} per token (f32)")
    print("  tensor types")
    for name, row in info["tensor_types"].items():
        print(f"    {name:<8} {row['tensors']:>5} tensors  {_count(row['elements']):>8}  {_size(row['bytes']):>10}")
    for t in info.get("tensors", []):
        print(f"    {t['name']:<40} {t['type']:<7} {str(tuple(t['shape'])):<22} {_size(t['bytes'])}")


def cmd_tokenize(args: argparse.Namespace) -> int:
    from engine.modelfile import open_model
    from engine.tokenizer import Tokenizer

    mf = open_model(_model_arg(args.model))
    tok = Tokenizer.from_metadata(mf.metadata)
    try:
        text = Path(args.text_file).read_text(encoding="utf-8")
    except OSError as e:
        raise EngineError(f"cannot read {args.text_file}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise EngineError(f"{args.text_file} is not UTF-8 text") from None
    ids = tok.encode(text, special=True, add_bos=False)
    if args.json:
        print(json.dumps({"ids": ids, "n_tokens": len(ids)}))
    else:
        print(" ".join(str(i) for i in ids))
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="foretell-cli", description="Foretell engine command line")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("inspect", help="metadata, layer pattern, tensor types and sizes, parameter counts")
    s.add_argument("model", nargs="?", help="GGUF file (default: the embedded model)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--tensors", action="store_true", help="also list every tensor")
    s.set_defaults(func=cmd_inspect)
    s = sub.add_parser("tokenize", help="token ids of a text file (no BOS added, special tokens parsed)")
    s.add_argument("model", nargs="?", help="GGUF file (default: the embedded model)")
    s.add_argument("--text-file", required=True)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_tokenize)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0

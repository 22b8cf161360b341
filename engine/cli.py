"""`foretell-cli` / `python -m engine`: inspect and tokenize (the contract in docs/DESIGN.md).

Every failure prints one line `error: …` on stderr and exits 1 (2 for bad arguments: argparse's own complaints
and every parameter out of range, checked by engine.validate before a model is opened). Output that cannot be
written (standard output closed, a full disk) is a failure too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from engine import validate
from engine.errors import EngineError, InvalidParameterError
from engine.output import OutputError, drop_stdout, emit, stdout
from engine.server.run import add_arguments as serve_arguments


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (`error: …`, exit 2) like every other failure."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if len(message) > 300:  # argparse quotes a value whole, however long
            message = message[:299] + "…"
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _model_arg(value: str | None) -> Path:
    from engine.storage.modelfile import default_model_path

    return Path(value) if value else default_model_path()


def cmd_inspect(args: argparse.Namespace) -> int:
    from engine.storage.modelfile import open_model

    from engine.generate import text_side

    _check_engine_args(args, args.ctx)
    mf = open_model(_model_arg(args.model))
    text_side(mf)  # the same checks as `load`: a file inspect accepts is one load accepts
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
    from engine.placement import ModelSizes, PlacementConfig, free_device_bytes, plan_placement

    pcfg = PlacementConfig(args.device, args.gpu_layers, args.cpu_moe, args.expert_cache, miss_policy=args.miss_policy)
    info["placement"] = plan_placement(ModelSizes.from_model(mf, min(args.ctx, hp.n_ctx_train)), pcfg,
                                       free_device_bytes(args.device)).as_dict()
    cov, info["decode_path"] = _bound(mf)
    info["products"] = cov.as_dict()
    info["notices"] = [n for n in (cov.notice(),) if n is not None]
    if args.tensors:
        info["tensors"] = [
            {"name": t.name, "type": t.qtype.name, "shape": list(t.shape), "bytes": t.n_bytes}
            for t in mf.tensors.values()
        ]
    emit(json.dumps(info, indent=2) if args.json else "\n".join(_inspect_lines(info)))
    return 0


def _bound(mf):  # type: ignore[no-untyped-def]
    """Which weights would miss a native product, and how a decode step would run: the model bound on the CPU to
    the default backend, as `load` binds it (weights stay views of the file; nothing is dequantized but the small
    vectors)."""
    from engine import ops
    from engine.models.build import load_model
    from engine.ops.coverage import product_coverage

    backend = ops.default_backend()
    runner = load_model(mf, n_ctx=16, backend=backend)
    return product_coverage(runner, backend.name), runner.step_path()


def _inspect_lines(info: dict[str, Any]) -> list[str]:
    hp, pc = info["hparams"], info["params"]
    out: list[str] = []
    line = out.append
    line(f"{info['file']}  ({_size(info['file_bytes'])})")
    line(f"  name          {info['name'] or '-'}")
    line(f"  architecture  {info['architecture']}   MTP block: {'yes' if info['mtp'] else 'no'}")
    line(f"  layers        {hp['trunk_layers']} trunk + {hp['mtp_layers']} MTP   pattern {info['layer_pattern']}"
          "  (R = Gated DeltaNet, A = gated attention, M = MTP)")
    line(f"  hidden        {hp['n_embd']}   vocab {hp['n_vocab']}   context {hp['context_length']}")
    line(f"  attention     {hp['attention_heads']} q / {hp['kv_heads']} kv heads × {hp['head_dim']}, "
          f"rope {hp['rope_dims']} dims, base {hp['rope_base']:g}")
    line(f"  gated delta   {hp['gdn_k_heads']} k / {hp['gdn_v_heads']} v heads × {hp['gdn_head_dim']}, conv {hp['conv_kernel']}")
    if hp["experts"]:
        line(f"  MoE           {hp['experts']} experts, top-{hp['experts_used']}, expert FFN {hp['expert_ffn']}, "
              f"shared FFN {hp['shared_expert_ffn']}")
    else:
        line(f"  FFN           dense, {hp['dense_ffn']}")
    line(f"  parameters    {_count(pc['total'])} total, {_count(pc['trunk'])} trunk, "
          f"{_count(pc['active_per_token'])} active per token, {_count(pc['mtp'])} MTP")
    st = info["state_bytes_per_sequence"]
    line(f"  state         GDN {_size(st['gdn_conv'] + st['gdn_recurrent'])} per sequence, "
          f"KV {_size(st['kv_per_token'])} per token (f32)")
    line("  tensor types")
    for name, row in info["tensor_types"].items():
        line(f"    {name:<8} {row['tensors']:>5} tensors  {_count(row['elements']):>8}  {_size(row['bytes']):>10}")
    line(f"  placement     {info['placement']['summary']}")
    fallback = info["products"]["fallback"]
    line(f"  products      {info['products']['backend']}: " + (
        "every quantized weight has a native product" if not fallback else "no native product for " + ", ".join(
            f"{f['type']} ({f['tensors']} tensors, {f['share']:.0%} of weights: dequantized)" for f in fallback)))
    line(f"  decode step   {info['decode_path']}")
    for t in info.get("tensors", []):
        line(f"    {t['name']:<40} {t['type']:<7} {str(tuple(t['shape'])):<22} {_size(t['bytes'])}")
    return out


def cmd_tokenize(args: argparse.Namespace) -> int:
    from engine.storage.modelfile import open_model
    from engine.tokenizer import Tokenizer

    text = _read_text(args.text_file)
    mf = open_model(_model_arg(args.model))
    tok = Tokenizer.from_metadata(mf.metadata)
    ids = tok.encode(text, special=True, add_bos=False)
    emit(json.dumps({"ids": ids, "n_tokens": len(ids)}) if args.json else " ".join(str(i) for i in ids))
    return 0


def _read_text(path: str) -> str:
    """A text file's exact characters: its bytes decoded as UTF-8, line ends as they are ("\\r\\n" stays), at most
    MAX_TEXT_FILE_BYTES of them (a device such as /dev/zero is refused after that much, not read to the end)."""
    limit = validate.MAX_TEXT_FILE_BYTES
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise EngineError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise InvalidParameterError(f"{path} is over {limit >> 20} MiB: tokenize at most that much text at once")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EngineError(f"{path} is not UTF-8 text (byte {e.start} is not)") from None


def _output_path(path: str) -> Path:
    """Where a command will write, checked before any work: its folder must exist and it must not be one."""
    out = Path(path)
    if out.is_dir():
        raise InvalidParameterError(f"--out {path} is a folder: give a file name")
    if not out.parent.is_dir():
        raise InvalidParameterError(f"--out {path}: the folder {out.parent} does not exist")
    return out


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise InvalidParameterError(f"token ids must be comma-separated integers, got {text[:40]!r}") from None
    if not ids:
        raise InvalidParameterError("no token ids given")
    neg = next((i for i in ids if i < 0), None)
    if neg is not None:
        raise InvalidParameterError(f"token id {neg} is negative: ids count from 0")
    return ids


def _engine_config(args: argparse.Namespace, n_ctx: int):
    from engine.events import EngineConfig
    from engine.speculative import default_dir

    memory = getattr(args, "auto_memory", None) or default_dir()
    return EngineConfig(
        n_ctx=n_ctx, device=args.device, n_threads=args.threads, gpu_layers=args.gpu_layers, cpu_moe=args.cpu_moe,
        expert_cache=args.expert_cache, miss_policy=args.miss_policy,
        auto_memory_dir=None if memory == "off" else memory)


def _check_engine_args(args: argparse.Namespace, n_ctx: int) -> None:
    validate.validate_engine_config(_engine_config(args, n_ctx))


def _engine(args: argparse.Namespace, n_ctx: int):
    """The loaded engine; on a terminal a progress line while it loads, then its notices (stderr)."""
    from engine.generate import load

    progress = _progress_line if sys.stderr.isatty() else None
    eng = load(_model_arg(args.model), _engine_config(args, n_ctx), progress=progress)
    if progress is not None:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    for notice in eng.notices:
        if getattr(args, "mtp", True) or notice != eng.no_mtp_notice:  # that one matters only when MTP was asked for
            print(f"note: {notice}", file=sys.stderr)
    return eng


def _progress_line(fraction: float, message: str) -> None:
    print(f"\r\033[Kloading {fraction:4.0%} {message}", end="", file=sys.stderr, flush=True)


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    ids = _parse_ids(args.tokens)
    out = _output_path(args.out)
    eng = _engine(args, n_ctx=max(len(ids), 16))
    validate.token_ids(ids, eng.hp.n_vocab)
    res = eng.runner.forward(ids, eng.cache, logit_rows="all", chunked=args.chunked)
    try:
        with out.open("wb") as f:  # the path as given (np.save would add ".npy" to a name without it)
            np.save(f, res.logits.float().numpy())
    except OSError as e:
        raise EngineError(f"cannot write {args.out}: {e.strerror or e}") from None
    emit(json.dumps({"out": args.out, "shape": list(res.logits.shape)}))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.chat import Message
    from engine.consume import collect, reply_stats
    from engine.events import GenerationConfig
    from engine.sampling import SamplingConfig

    if args.prompt is None and args.prompt_tokens is None:
        raise InvalidParameterError("give --prompt TEXT or --prompt-tokens 1,2,3")
    if args.prompt_tokens is not None:
        prompt: Any = _parse_ids(args.prompt_tokens)  # against the vocabulary: by the engine, once it is loaded
    elif args.raw:
        prompt = validate.text("--prompt", args.prompt)
    else:
        prompt = [Message("user", validate.text("--prompt", args.prompt))]
    if args.schema and args.remote:
        raise InvalidParameterError("--schema holds a local model's reply (a remote server's own response_format "
                                    "support differs): drop --remote or --schema")
    gen = GenerationConfig(
        max_tokens=args.max_tokens,
        sampling=SamplingConfig(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                repeat_penalty=args.repeat_penalty, seed=args.seed),
        stop_strings=tuple(args.stop or ()),
        mtp=args.mtp,
        draft=args.draft,
        constraint=_schema(args.schema) if args.schema else None,
    )
    validate.validate_generation(gen)  # every range checked before the model is opened
    if (args.api_key or args.remote_model) and not args.remote:
        raise InvalidParameterError("--api-key and --remote-model go with --remote URL")
    if args.remote:
        from engine.remote.cli import generate_remote

        return generate_remote(args, prompt, gen)
    _check_engine_args(args, args.ctx)
    eng = _engine(args, n_ctx=args.ctx)
    reply = collect(eng.generate(prompt, gen), echo=not args.json)
    final, done = reply.final, reply.done
    stats = reply_stats(final, done)
    stats["placement"] = eng.plan.as_dict()
    if final.expert_cache:
        stats["expert_cache"] = {str(k): v for k, v in final.expert_cache.items()}
    if args.json:
        emit(json.dumps({"tokens": reply.tokens, "text": reply.text, "accepted_draft": reply.accepted_draft,
                         "stats": stats}))
    else:
        print(f"\n[{done.reason}] {final.generated_tokens} tokens, {final.decode_tok_s:.1f} tok/s decode, "
              f"TTFT {final.ttft_s * 1000:.0f} ms", file=sys.stderr)
    return 0


def _schema(path: str) -> Any:
    """--schema FILE: the JSON schema a reply is held to, checked before the model is opened (why, where it is not one
    llguidance can enforce)."""
    from engine import tools as toolkit

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InvalidParameterError(f"--schema: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise InvalidParameterError(f"--schema: {path} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidParameterError(f"--schema: {path} must hold a JSON schema object")
    try:
        return toolkit.schema_constraint(schema)
    except InvalidParameterError as e:
        raise InvalidParameterError(f"--schema {path}: {e}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.server.run import defaults, serve

    gen = defaults(args)
    _check_engine_args(args, args.ctx)
    return serve(args, _engine(args, n_ctx=args.ctx), gen)


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
    p = _Parser(prog="foretell-cli", description="Foretell engine command line")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("inspect", help="metadata, layer pattern, tensor types and sizes, parameter counts")
    s.add_argument("model", nargs="?", help="GGUF file (default: the embedded model)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--tensors", action="store_true", help="also list every tensor")
    s.add_argument("--ctx", type=int, default=4096, help="context length the placement plan assumes")
    _device_args(s)
    s.set_defaults(func=cmd_inspect)
    s = sub.add_parser("tokenize", help="token ids of a text file (no BOS added, special tokens parsed)")
    s.add_argument("model", nargs="?", help="GGUF file (default: the embedded model)")
    s.add_argument("--text-file", required=True)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_tokenize)
    s = sub.add_parser("logits", help="float32 logits [n_tokens, n_vocab] of one pass over the tokens, as .npy")
    s.add_argument("model", nargs="?", help="GGUF file (default: the embedded model)")
    s.add_argument("--tokens", required=True, help="comma-separated token ids")
    s.add_argument("--out", required=True, help="output .npy path")
    s.add_argument("--chunked", action="store_true", help="chunk-parallel Gated DeltaNet (as a long prefill)")
    _device_args(s)
    s.set_defaults(func=cmd_logits)
    s = sub.add_parser("generate", help="generate a reply; --json prints tokens, text and stats")
    s.add_argument("model", nargs="?", help="GGUF file (default: the embedded model)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="one user message, rendered with the chat template (see --raw)")
    g.add_argument("--prompt-tokens", help="comma-separated prompt token ids, fed as-is")
    s.add_argument("--raw", action="store_true", help="feed --prompt text as-is, without the chat template")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repeat-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--schema", metavar="FILE", help="hold the reply to the JSON schema in FILE (constrained decoding)")
    s.add_argument("--ctx", type=int, default=4096, help="context length")
    s.add_argument("--mtp", dest="mtp", action="store_true", default=True,
                   help="speculative decoding with the model's MTP head (default when the model has one)")
    s.add_argument("--no-mtp", dest="mtp", action="store_false", help="plain decoding")
    s.add_argument("--draft", default="auto", type=validate.draft_arg,
                   help=f"draft depth 1-{validate.MAX_DRAFT} or 'auto' (default)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--remote", metavar="URL", help="generate on an OpenAI-compatible server (llama-server, vLLM, "
                   "SGLang, Foretell) at this base URL instead of a local model")
    s.add_argument("--api-key", default=None, help="with --remote: the server's API key")
    s.add_argument("--remote-model", default=None, help="with --remote: a model id from its /v1/models (default: the first)")
    _device_args(s)
    s.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server on the model (/v1/chat/completions, ...)")
    s.add_argument("model", nargs="?", help="GGUF file (default: the embedded model)")
    serve_arguments(s)
    _device_args(s)
    s.set_defaults(func=cmd_serve)
    return p


def _device_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--device", default="cpu", help="compute device: cpu (default) or cuda[:N] (CPU/GPU hybrid)")
    s.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    s.add_argument("--gpu-layers", type=validate.gpu_layers_arg, default=None,
                   help="trunk layers on the GPU (the last ones), or 'auto' (default: fit free VRAM)")
    s.add_argument("--cpu-moe", action="store_true", help="keep routed experts on the CPU (hot ones cached on the GPU)")
    s.add_argument("--expert-cache", default=None, type=validate.expert_cache_arg,
                   help="GPU expert cache: experts per layer (64) or a total size (2048MiB); default: what is left")
    s.add_argument("--miss-policy", default="load", choices=["load", "cpu"],
                   help="expert-cache miss: load it to the GPU (default) or compute it on the CPU")
    s.add_argument("--auto-memory", default=None, metavar="DIR",
                   help="where auto draft depth keeps what it learned of a model for the next run "
                        "(default: the user's cache folder; 'off': not kept)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        writes = args.command != "serve"  # the others' result goes to standard output
        if writes:
            stdout()  # closed: refused before the work, which would be lost
        rc = int(args.func(args))
        if writes:
            emit("", end="", flush=True)  # a full disk shows here, not at exit
        return rc
    except OutputError as e:
        drop_stdout()
        print(f"error: {e}", file=sys.stderr)
        return 1
    except InvalidParameterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug, not a user error: still one line, the traceback on request
        if os.environ.get("FORETELL_DEBUG"):
            raise
        print(f"error: internal error ({type(e).__name__}: {e}); set FORETELL_DEBUG=1 for a traceback",
              file=sys.stderr)
        return 1

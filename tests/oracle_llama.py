"""llama.cpp (via llama-cpp-python's low-level ctypes API) as a reference oracle for the tests.

    llama_logits(path, tokens)        -> float32 [len(tokens), n_vocab], ONE batch decode, logits at every position
    llama_greedy(path, prompt, n_new) -> (argmax continuation, the logit rows it was chosen from [n_new, n_vocab])
    llama_tokenize(path, text, special) -> llama.cpp's tokenizer on the GGUF vocab (no BOS added)
    llama_detokenize(path, ids)       -> the bytes llama.cpp renders for ids
    llama_trace(path, tokens, match)  -> (logits, {graph tensor name: array}) for locating a divergence
    llama_mtp / llama_mtp_rows / llama_mtp_draft -> the MTP head through an LLAMA_CONTEXT_TYPE_MTP context

Settings, chosen so that F32 fixtures give logits as close to plain float32 math as llama.cpp allows
(checked against a float64 recomputation of the attention layer from captured Q/K/V: F32 KV + flash
attention off has relative error 1.5e-7; flash attention on, even with an F32 cache, 3.4e-4, as much
as an F16 cache; logits move by ~1e-3 either way):
CPU only, `n_threads` threads, model read into memory (no mmap), no weight repacking (the plain ggml
vec-dot kernels), F32 K/V cache (llama.cpp's default is F16, which rounds K and V), flash attention
off (the plain mul_mat + soft_max path, F32 throughout), one sequence, n_batch = n_ubatch = n_ctx so
the whole sequence is one ubatch. A fresh context is made per call (models are cached per path), so
no state leaks between calls.

llama.cpp's log goes into a ring buffer, not to stderr; any failure raises `LlamaOracleError` with the
captured log tail. Set FORETELL_LLAMA_VERBOSE=1 to echo the log live.
"""
from __future__ import annotations

import collections
import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ggml's CPU backend uses OpenMP barriers; with the default (spinning) wait policy a barrier stalls for
# ~1 s whenever another process holds a core. Must be set before llama_cpp loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import llama_cpp as L  # noqa: E402

__all__ = ["llama_logits", "llama_greedy", "llama_tokenize", "llama_detokenize", "llama_trace", "TensorCapture",
           "llama_mtp", "llama_mtp_rows", "llama_mtp_draft", "MtpRun", "LlamaOracleError", "load_model",
           "new_context", "log_tail"]


class LlamaOracleError(RuntimeError):
    """llama.cpp failed; the message carries the tail of llama.cpp's own log."""


# ---------------------------------------------------------------------------------------------------
# logging: capture everything, show it only on failure (or with FORETELL_LLAMA_VERBOSE=1)

_LOG: collections.deque[str] = collections.deque(maxlen=4000)
_LOG_TOTAL = [0]  # pieces ever logged; a "mark" is this count before a call (the deque drops old pieces)
_VERBOSE = os.environ.get("FORETELL_LLAMA_VERBOSE", "") not in ("", "0")


@L.llama_log_callback
def _log_cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover - called from C
    s = text.decode("utf-8", errors="replace") if text else ""
    _LOG.append(s)
    _LOG_TOTAL[0] += 1
    if _VERBOSE:
        sys.stderr.write(s)


L.llama_log_set(_log_cb, ctypes.c_void_p(0))  # keep `_log_cb` referenced at module level (ctypes callback)
L.llama_backend_init()


def log_tail(n_chars: int = 6000) -> str:
    """The last `n_chars` characters of llama.cpp's log (everything since the process started)."""
    return "".join(_LOG)[-n_chars:]


def _mark() -> int:
    return _LOG_TOTAL[0]


def _fail(what: str, mark: int | None = None) -> LlamaOracleError:
    """An error carrying what llama.cpp logged since `mark` (from _mark() before the failing call), or
    the recent log when there is no mark; it is also written to stderr."""
    new = len(_LOG) if mark is None else min(len(_LOG), _LOG_TOTAL[0] - mark)
    lines = list(_LOG)[len(_LOG) - new:] if new > 0 else []
    if not "".join(lines).strip() and mark is not None:
        lines = list(_LOG)[-40:]  # nothing new: show the recent context instead
    log = "".join(lines)[-8000:]
    msg = f"{what}\n--- llama.cpp log ---\n{log}" if log.strip() else f"{what} (llama.cpp logged nothing)"
    sys.stderr.write(msg + "\n")
    return LlamaOracleError(msg)


# ---------------------------------------------------------------------------------------------------
# models (cached per path) and contexts (fresh per call)

@dataclass
class _Model:
    ptr: L.llama_model_p
    vocab: L.llama_vocab_p
    n_vocab: int
    path: str

    def __del__(self):  # pragma: no cover - interpreter shutdown
        try:
            if self.ptr:
                L.llama_model_free(self.ptr)
                self.ptr = None
        except Exception:
            pass


_MODELS: dict[tuple, _Model] = {}


def load_model(model_path: str | os.PathLike[str], *, load_mtp: bool = True, repack: bool = False) -> _Model:
    """Load (once per path, file identity and options) a model on the CPU, read into memory."""
    p = Path(model_path).resolve()
    st = p.stat()
    key = (str(p), st.st_mtime_ns, st.st_size, load_mtp, repack)
    m = _MODELS.get(key)
    if m is not None:
        return m
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.load_mode = L.LLAMA_LOAD_MODE_NONE  # read into memory: no mmap of a file a test may rewrite
    mp.use_extra_bufts = repack
    mp.check_tensors = True
    mp.load_mtp = load_mtp
    mark = _mark()
    ptr = L.llama_model_load_from_file(str(p).encode(), mp)
    if not ptr:
        raise _fail(f"llama.cpp failed to load {p}", mark)
    vocab = L.llama_model_get_vocab(ptr)
    m = _Model(ptr=ptr, vocab=vocab, n_vocab=L.llama_vocab_n_tokens(vocab), path=str(p))
    _MODELS[key] = m
    return m


class _Context:
    """A llama_context, freed on exit."""

    def __init__(self, model: _Model, n_ctx: int, n_threads: int, *, kv_type: int = L.GGML_TYPE_F32,
                 flash_attn: int = L.LLAMA_FLASH_ATTN_TYPE_DISABLED, ctx_type: int = 0, ctx_other=None,
                 cb_eval=None):
        cp = L.llama_context_default_params()
        n_ctx = max(16, int(n_ctx))
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx
        cp.n_seq_max = 1
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        cp.type_k = kv_type
        cp.type_v = kv_type
        cp.flash_attn_type = flash_attn
        cp.offload_kqv = False
        cp.op_offload = False
        cp.no_perf = True
        cp.embeddings = False
        cp.ctx_type = ctx_type
        if ctx_other is not None:
            cp.ctx_other = ctx_other
        if cb_eval is not None:
            cp.cb_eval = cb_eval
            self._cb_eval = cb_eval  # keep the ctypes callback alive as long as the context
        mark = _mark()
        self.ptr = L.llama_init_from_model(model.ptr, cp)
        if not self.ptr:
            raise _fail(f"llama.cpp failed to create a context for {model.path} (n_ctx={n_ctx})", mark)
        self.model = model
        self.n_ctx = L.llama_n_ctx(self.ptr)

    def decode(self, tokens: list[int], pos0: int, outputs: list[bool]) -> None:
        n = len(tokens)
        if pos0 + n > self.n_ctx:
            raise LlamaOracleError(f"sequence of {pos0 + n} tokens exceeds n_ctx={self.n_ctx}")
        bad = [t for t in tokens if not 0 <= int(t) < self.model.n_vocab]
        if bad:
            raise LlamaOracleError(f"token ids out of range [0, {self.model.n_vocab}): {bad[:5]}")
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = int(t)
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if outputs[i] else 0
            batch.n_tokens = n
            mark = _mark()
            rc = L.llama_decode(self.ptr, batch)
            if rc != 0:
                raise _fail(f"llama_decode returned {rc} ({n} tokens at pos {pos0})", mark)
        finally:
            L.llama_batch_free(batch)

    def logits_row(self, i: int) -> np.ndarray:
        ptr = L.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise _fail(f"llama_get_logits_ith({i}) returned NULL", None)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).astype(np.float32, copy=True)

    def close(self) -> None:
        if self.ptr:
            L.llama_free(self.ptr)
            self.ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


def new_context(model_path, n_ctx: int, n_threads: int = 2, **kw) -> _Context:
    """A fresh context on the cached model (for experiments; close it or use it as a context manager)."""
    return _Context(load_model(model_path), n_ctx, n_threads, **kw)


# ---------------------------------------------------------------------------------------------------
# the oracle API

def llama_logits(model_path, tokens: list[int], n_threads: int = 2, n_ctx: int | None = None,
                 **ctx_kw) -> np.ndarray:
    """Logits at every position of `tokens` [len(tokens), n_vocab] (float32), from one batch decode.

    `ctx_kw` (kv_type=, flash_attn=) overrides the oracle settings, for experiments only."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("tokens must not be empty")
    with _Context(load_model(model_path), n_ctx or len(tokens), n_threads, **ctx_kw) as ctx:
        ctx.decode(tokens, 0, [True] * len(tokens))
        return np.stack([ctx.logits_row(i) for i in range(len(tokens))])


def llama_greedy(model_path, prompt: list[int], n_new: int, n_threads: int = 2,
                 **ctx_kw) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation: the prompt in one batch, then one token per decode.

    Returns the `n_new` argmax tokens (first index on ties, as np.argmax) and the logit rows they were
    chosen from, [n_new, n_vocab]. EOS does not stop it."""
    prompt = [int(t) for t in prompt]
    if not prompt or n_new < 1:
        raise ValueError("need a non-empty prompt and n_new >= 1")
    out: list[int] = []
    rows: list[np.ndarray] = []
    with _Context(load_model(model_path), len(prompt) + n_new, n_threads, **ctx_kw) as ctx:
        ctx.decode(prompt, 0, [False] * (len(prompt) - 1) + [True])
        pos = len(prompt)
        while True:
            row = ctx.logits_row(-1)
            rows.append(row)
            out.append(int(np.argmax(row)))
            if len(out) == n_new:
                break
            ctx.decode([out[-1]], pos, [True])
            pos += 1
    return out, np.stack(rows)


def llama_tokenize(model_path, text: str, special: bool) -> list[int]:
    """llama.cpp's tokenizer on the GGUF vocabulary; no BOS/EOS added; `special` parses <|...|> tokens."""
    m = load_model(model_path)
    data = text.encode("utf-8")
    n_max = len(data) + 16
    buf = (L.llama_token * n_max)()
    n = L.llama_tokenize(m.vocab, data, len(data), buf, n_max, False, special)
    if n < 0:  # buffer too small: -n is the size needed
        n_max = -n
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(m.vocab, data, len(data), buf, n_max, False, special)
    if n < 0:
        raise _fail(f"llama_tokenize failed ({n})", None)
    return [int(buf[i]) for i in range(n)]


def llama_detokenize(model_path, tokens: list[int], special: bool = True) -> bytes:
    """The bytes llama.cpp renders for `tokens` (token_to_piece, concatenated)."""
    m = load_model(model_path)
    out = bytearray()
    buf = ctypes.create_string_buffer(256)
    for t in tokens:
        n = L.llama_token_to_piece(m.vocab, int(t), buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(m.vocab, int(t), buf, len(buf), 0, special)
        out += buf.raw[:n]
    return bytes(out)


# ---------------------------------------------------------------------------------------------------
# intermediate tensors (ggml's scheduler eval callback), for locating a divergence layer by layer

class _GGMLTensor(ctypes.Structure):
    """`struct ggml_tensor` of the bundled ggml.h (GGML_MAX_DIMS 4, MAX_OP_PARAMS 64, MAX_SRC 10, MAX_NAME 64)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_NP_OF_GGML = {L.GGML_TYPE_F32: np.float32, L.GGML_TYPE_F16: np.float16, 26: np.int32}  # 26 = GGML_TYPE_I32


def _tensor_to_numpy(t: _GGMLTensor) -> np.ndarray | None:
    """A copy of a host tensor's data in numpy order (reversed ne), or None for other types / no data."""
    dt = _NP_OF_GGML.get(t.type)
    if dt is None or not t.data:
        return None
    shape = tuple(int(x) for x in reversed(t.ne))
    if 0 in shape:
        return np.zeros(shape, dtype=np.float32 if dt is np.float16 else dt)
    strides = tuple(int(x) for x in reversed(t.nb))
    extent = sum((n - 1) * b for n, b in zip(shape, strides)) + np.dtype(dt).itemsize
    raw = (ctypes.c_char * extent).from_address(t.data)
    arr = np.ndarray(shape=shape, dtype=dt, buffer=raw, strides=strides)
    return np.array(arr, dtype=np.float32 if dt is np.float16 else dt)


class TensorCapture:
    """A ggml eval callback that copies the graph's named tensors; pass `.cb` as `cb_eval` of a context.

    `match(name) -> bool` selects tensors by graph name (llama.cpp names them "<what>-<layer>", e.g.
    "attn_norm-3", "result_norm", "result_output"); None captures all. `.tensors` maps name -> array in
    numpy order = reversed ggml ne (a [n_tokens, n_embd] activation is shape (1, 1, n_tokens, n_embd));
    a repeated name gets "#k" appended. Only F32/F16/I32 tensors with host data are copied.
    """

    def __init__(self, match=None):
        self.match = match
        self.tensors: dict[str, np.ndarray] = {}

        @L.ggml_backend_sched_eval_callback
        def cb(tp, ask, user_data):  # pragma: no cover - called from C
            t = _GGMLTensor.from_address(tp)
            name = t.name.decode("utf-8", errors="replace")
            want = bool(name) and (self.match is None or self.match(name))
            if ask:
                return want
            if want:
                a = _tensor_to_numpy(t)
                if a is not None:
                    key, k = name, 1
                    while key in self.tensors:
                        key, k = f"{name}#{k}", k + 1
                    self.tensors[key] = a
            return True

        self.cb = cb


def llama_trace(model_path, tokens: list[int], match=None, n_threads: int = 2,
                **ctx_kw) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Run `tokens` as one batch (like llama_logits) and capture the graph's named tensors.

    Returns (logits, tensors); see TensorCapture for `match` and the layout. Slower than llama_logits
    (the scheduler stops after every observed node) but gives the same logits bit for bit."""
    tokens = [int(t) for t in tokens]
    cap = TensorCapture(match)
    with _Context(load_model(model_path), len(tokens), n_threads, cb_eval=cap.cb, **ctx_kw) as ctx:
        ctx.decode(tokens, 0, [True] * len(tokens))
        logits = np.stack([ctx.logits_row(i) for i in range(len(tokens))])
    return logits, cap.tensors


# ---------------------------------------------------------------------------------------------------
# the MTP head (llama.cpp's LLAMA_CONTEXT_TYPE_MTP context, as common/speculative.cpp "draft-mtp" drives it)
#
# Verified on TINY_MOE F32 with llama_trace-style captures: an MTP-context row (token x, embedding h)
# computes eh_proj([enorm(token_embd[x]) ; hnorm(h)]), rotates with the row's position, attends causally
# over the MTP context's own KV cache, and ends with shared_head_norm (output_norm when the file has
# none) and the shared LM head. The trunk's nextn embedding is the post-output_norm hidden state (the
# LM-head input); the MTP context's nextn embedding is its post-shared_head_norm state (fed back when
# chaining drafts). llama.cpp pairs rows as: MTP position k = (x_k, h_{k-1}), with h_{-1} = 0.

def _ext():
    from llama_cpp import llama_cpp_ext  # experimental bindings of llama-ext.h (llama_set_embeddings_nextn ...)
    return llama_cpp_ext


def _nextn_rows(ctx: _Context, rows: list[int]) -> np.ndarray:
    ext = _ext()
    d = L.llama_model_n_embd_out(ctx.model.ptr)
    out = []
    for i in rows:
        ptr = ext.llama_get_embeddings_nextn_ith(ctx.ptr, i)
        if not ptr:
            raise _fail(f"llama_get_embeddings_nextn_ith({i}) returned NULL", None)
        out.append(np.ctypeslib.as_array(ptr, shape=(d,)).astype(np.float32, copy=True))
    return np.stack(out)


def _mtp_decode(ctx: _Context, tokens: list[int], hidden: np.ndarray, pos0: int) -> None:
    """One llama_process on an MTP context: row j = (tokens[j], hidden[j]) at position pos0 + j, all output."""
    d = L.llama_model_n_embd_inp(ctx.model.ptr)
    hidden = np.ascontiguousarray(hidden, dtype=np.float32)
    if hidden.shape != (len(tokens), d):
        raise ValueError(f"hidden must be [{len(tokens)}, {d}], got {hidden.shape}")
    batch = L.llama_batch_ext_init(ctx.ptr)
    if not batch:
        raise _fail("llama_batch_ext_init failed", None)
    try:
        for j, t in enumerate(tokens):
            idx = L.llama_batch_ext_add_token(batch, 0, int(t))
            if idx < 0:
                raise LlamaOracleError(f"llama_batch_ext_add_token failed ({idx}) at row {j}")
            ok = L.llama_batch_ext_set_pos(batch, idx, (L.llama_pos * 1)(pos0 + j))
            # the token's "embd" slot carries h (set_embd_state is a stub that returns false in this build)
            row = hidden[j]
            ok = ok and L.llama_batch_ext_set_embd_token(
                batch, idx, L.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, d))
            ok = ok and L.llama_batch_ext_set_output_logits(batch, idx, True)
            if not ok:
                raise LlamaOracleError(f"llama_batch_ext_set_* failed at row {j}")
        mark = _mark()
        rc = L.llama_process(ctx.ptr, L.LLAMA_PROCESS_TYPE_DECODE, batch)
        if rc != 0:
            raise _fail(f"llama_process(MTP) returned {rc} ({len(tokens)} rows at pos {pos0})", mark)
    finally:
        L.llama_batch_ext_free(batch)


def _check_mtp(model: _Model) -> None:
    if L.llama_model_n_layer_nextn(model.ptr) < 1:
        raise LlamaOracleError(f"{model.path} has no MTP (nextn) block")


@dataclass
class MtpRun:
    logits: np.ndarray       # [n, V] trunk logits (row k predicts x_{k+1})
    hidden: np.ndarray       # [n, d] trunk post-norm hidden h_k (the MTP input)
    mtp_logits: np.ndarray   # [n, V] MTP row k = head(x_k, h_{k-1}) at position k, h_{-1} = 0; predicts x_{k+1}
    mtp_hidden: np.ndarray   # [n, d] the MTP rows' post-shared_head_norm state


def llama_mtp(model_path, tokens: list[int], n_threads: int = 2, **ctx_kw) -> MtpRun:
    """Trunk over `tokens` (one batch), then the MTP head over the whole sequence (one batch), paired as
    llama.cpp's draft-mtp catch-up pairs them. mtp_logits[k] (k >= 1) is the head's guess for x_{k+1}
    from (h_{k-1}, x_k); compare it with logits[k], the trunk's own prediction of the same token."""
    tokens = [int(t) for t in tokens]
    m = load_model(model_path)
    _check_mtp(m)
    ext = _ext()
    n = len(tokens)
    with _Context(m, n, n_threads, **ctx_kw) as ctx:
        ext.llama_set_embeddings_nextn(ctx.ptr, True, False)
        ctx.decode(tokens, 0, [True] * n)
        logits = np.stack([ctx.logits_row(i) for i in range(n)])
        hidden = _nextn_rows(ctx, list(range(n)))
    h_in = np.concatenate([np.zeros_like(hidden[:1]), hidden[:-1]])
    mtp_logits, mtp_hidden = llama_mtp_rows(model_path, tokens, h_in, pos0=0, n_threads=n_threads, **ctx_kw)
    return MtpRun(logits, hidden, mtp_logits, mtp_hidden)


def llama_mtp_rows(model_path, tokens: list[int], hidden: np.ndarray, pos0: int = 0, n_threads: int = 2,
                   **ctx_kw) -> tuple[np.ndarray, np.ndarray]:
    """The MTP head alone on given rows: row j = (tokens[j], hidden[j]) at position pos0 + j, in a fresh
    MTP context (so row j attends to rows 0..j only). Returns (logits [m, V], post-norm hidden [m, d]).
    One row gives the head's logits for a single (hidden state, next token) pair with no history."""
    tokens = [int(t) for t in tokens]
    m = load_model(model_path)
    _check_mtp(m)
    with _Context(m, pos0 + len(tokens), n_threads, ctx_type=L.LLAMA_CONTEXT_TYPE_MTP, **ctx_kw) as ctx:
        _ext().llama_set_embeddings_nextn(ctx.ptr, True, True)
        _mtp_decode(ctx, tokens, hidden, pos0)
        rows = list(range(len(tokens)))
        return np.stack([ctx.logits_row(i) for i in rows]), _nextn_rows(ctx, rows)


def llama_mtp_draft(model_path, prompt: list[int], n_draft: int, n_threads: int = 2,
                    **ctx_kw) -> tuple[int, list[int], np.ndarray]:
    """llama.cpp's greedy MTP draft after `prompt`: the trunk decodes the prompt and picks x_n (argmax);
    the MTP context ingests (x_k, h_{k-1}) for k < n, then the seed (x_n, h_{n-1}) at position n gives
    d_1; each further step feeds (d_i, the head's own post-norm state) at the next position (chaining,
    one trained head). Returns (x_n, [d_1..d_K], draft logit rows [K, V]). No p_min cut-off."""
    prompt = [int(t) for t in prompt]
    run = llama_mtp(model_path, prompt, n_threads, **ctx_kw)  # trunk + catch-up, as one-shot batches
    m = load_model(model_path)
    x_n = int(np.argmax(run.logits[-1]))
    n = len(prompt)
    h_in = np.concatenate([np.zeros_like(run.hidden[:1]), run.hidden])  # rows 0..n: h_{k-1}
    drafts: list[int] = []
    rows: list[np.ndarray] = []
    with _Context(m, n + n_draft + 1, n_threads, ctx_type=L.LLAMA_CONTEXT_TYPE_MTP, **ctx_kw) as ctx:
        _ext().llama_set_embeddings_nextn(ctx.ptr, True, True)
        _mtp_decode(ctx, prompt + [x_n], h_in, 0)  # catch-up rows 0..n-1 and the seed row n, one batch
        last, pos = n, n
        while True:
            row = ctx.logits_row(last)
            rows.append(row)
            drafts.append(int(np.argmax(row)))
            if len(drafts) == n_draft:
                break
            h = _nextn_rows(ctx, [last])
            pos += 1
            _mtp_decode(ctx, [drafts[-1]], h, pos)
            last = 0
    return x_n, drafts, np.stack(rows)

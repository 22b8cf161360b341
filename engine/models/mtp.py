"""The multi-token-prediction block (spec §3.6): Qwen3.5/3.6's built-in draft model."""
from __future__ import annotations

import torch

from engine import ops
from engine.cache import Cache
from engine.models.qwen35 import (STEP_ROWS, DecoderLayer, ForwardResult, Hook, Qwen35Model, _noop, check_room,
                                  embed_rows, id_tensor)
from engine.ops import Linear

# Normed embedding rows the MTP head keeps (4096 × 2048 float32 = 32 MiB on a 35B model).
EMBEDDED_ROWS = 4096


class MTPHead:
    """The multi-token-prediction block (spec §3.6): from the trunk's post-norm hidden h at position
    p−1 and the token x at p it predicts the token at p+1. Its input row for position p is
    c = W_eh [RMSNorm(embed(x); enorm) ; RMSNorm(h; hnorm)], then one full decoder block (layer L, with
    its own KV cache), then shared_head_norm and the LM head. Chained drafts feed the head's own
    post-norm output back as the next h. Position p pairs token x_p with h_{p−1} (h_{−1} = 0), as
    llama.cpp's MTP context does.
    """

    def __init__(self, model: Qwen35Model, layer: DecoderLayer, eh_proj: Linear, enorm: torch.Tensor,
                 hnorm: torch.Tensor, head_norm: torch.Tensor, embed: ops.Weight, head: Linear, device: torch.device):
        """Its pieces as engine.models.build binds them: the decoder block (layer L), eh_proj, the norms, the
        embedding (its own or the trunk's) and the LM head (its own or the trunk's, wherever that is)."""
        self.hp, self.model, self.device = model.hp, model, device
        self.il = model.hp.n_layer
        self.layer, self.eh_proj, self.enorm, self.hnorm = layer, eh_proj, enorm, hnorm
        self.head_norm, self.embed, self.head = head_norm, embed, head
        self._embedded: dict[int, torch.Tensor] = {}  # token → its normed embedding row (inference only)

    def new_cache(self, n_ctx: int) -> Cache:
        return Cache(self.hp, min(n_ctx, self.model.n_ctx_max), self.device, layers=(self.il,))

    def capturable(self) -> str | None:
        """Why the head's passes cannot be recorded as CUDA graphs on the trunk's device (None: they can)."""
        if self.device != self.model.device or self.head.device != self.model.device:
            return "the MTP head is not on the trunk's device"
        return self.layer.capturable()

    def normed_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """RMSNorm(embed(x); enorm) of each token. A function of the token alone, so at inference the rows of
        the last few thousand tokens seen are kept (each computed as a one-row pass computes it: norms are
        per-row, batch-invariant), sparing a draft its dequantize and norm ops."""
        # Head passes of up to STEP_ROWS rows take their embeddings from the per-token memo (a draft pass has the
        # rows a verify kept, plus one); longer ones catch up over a prompt.
        if self.enorm.requires_grad or ids.numel() > STEP_ROWS:  # training, or a catch-up over a prompt
            return ops.rms_norm(embed_rows(self.embed, ids, self.device), self.enorm, self.hp.rms_eps,
                                self.layer.backend)
        c = self._embedded
        toks = ids.tolist()
        missing = [t for t in dict.fromkeys(toks) if t not in c]
        if missing:
            if len(c) + len(missing) > EMBEDDED_ROWS:
                c.clear()
            rows = ops.rms_norm(embed_rows(self.embed, torch.tensor(missing), self.device), self.enorm,
                                self.hp.rms_eps, self.layer.backend)
            c.update(zip(missing, rows))
        return c[toks[0]].unsqueeze(0) if len(toks) == 1 else torch.stack([c[t] for t in toks])

    def forward(self, tokens: torch.Tensor | list[int], hidden: torch.Tensor, cache: Cache, *,
                logit_rows: str = "last", hook: Hook | None = None) -> ForwardResult:
        """Rows (tokens[i], hidden[i]) at positions cache.pos…, op by op; returns the head's post-norm hidden rows
        (the next chained "h") and the draft logits."""
        ids = id_tensor(tokens).reshape(-1)
        n, pos = ids.numel(), cache.pos
        check_room(cache, pos, n)
        res = self.rows_pass(self.normed_embeddings(ids), hidden, cache, ops.Positions(n, pos), logit_rows,
                             hook or _noop)
        cache.pos = pos + n
        return res

    def rows_pass(self, e: torch.Tensor, hidden: torch.Tensor, cache: Cache, at: ops.Positions, logit_rows: str,
                  cb: Hook = _noop) -> ForwardResult:
        """The head over normed embedding rows e and trunk hidden rows at positions `at`, op by op: the body of
        `forward`, and what a captured draft pass records. The caller advances cache.pos."""
        x = self.layer(self.project(e, hidden, cb), cache, at, self.model.rope(self.device), cb, None, False)
        return self.finish(x, logit_rows, cb)

    def project(self, e: torch.Tensor, hidden: torch.Tensor, cb: Hook = _noop) -> torch.Tensor:
        """The block's input rows: W_eh [e ; RMSNorm(h; hnorm)]."""
        h = ops.rms_norm(hidden.to(self.device), self.hnorm, self.hp.rms_eps, self.layer.backend)
        x = ops.linear(torch.cat([e, h], dim=-1), self.eh_proj)
        cb("mtp_eh_proj", self.il, x)
        return x

    def finish(self, x: torch.Tensor, logit_rows: str, cb: Hook = _noop) -> ForwardResult:
        """After the block: shared_head_norm (the next chained h) and the LM head's rows `logit_rows` ("last", "all",
        "none", or "draft": the last row's draft logits)."""
        out = ops.rms_norm(x, self.head_norm, self.hp.rms_eps, self.layer.backend)
        cb("mtp_result_norm", self.il, out)
        logits = None
        if logit_rows == "draft":  # the last row's, for drafting: exact where they decide the draft (ops.draft_logits)
            logits = ops.draft_logits(out[-1:].to(self.head.device), self.head)
        elif logit_rows != "none":
            rows = out if logit_rows == "all" else out[-1:]
            logits = ops.linear(rows.to(self.head.device), self.head)
        return ForwardResult(out, logits, None)

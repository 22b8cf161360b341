/* A whole decoder layer for the n tokens of a pass in one call (spec §3): RMSNorm, the mixer (Gated DeltaNet or
 * gated attention, from the stacked input projection to the output projection), the residual, RMSNorm, the FFN
 * (the MoE layer of moe.c, or a dense SwiGLU), the residual. A decode step of a small model was mostly the Python
 * and tensor bookkeeping between some twenty kernel calls per layer (bench/step_profile.py); here the same kernels
 * run back to back over scratch buffers, with the pool's threads warm between them.
 *
 * Bits: every piece is the kernel the op-by-op native path calls (engine.ops: the products with their activation
 * rows, norm_rows, rope_neox, attention_causal, gdn_inputs, gdn_recurrence, moe_layer) or an element-wise step
 * written once in kernels.h (silu_f, sigmoid_f over exp_f) that the op-by-op native path calls too (engine.ops.native
 * silu, sigmoid_mul, exp_rows, silu_mul), in the same order; so a layer gives exactly the op-by-op path's bits
 * (tests/test_layer.py), and, each piece being batch-invariant, a pass over n tokens gives each token the bits of a
 * one-token pass. Threads change no bits: small products run on one thread (a pool call costs more than they do),
 * the rest on `threads`, as engine.ops.backend.Backend.n_threads chooses.
 */
#include <stdlib.h>
#include "kernels.h"
#include "layer.h"

/* Element-wise steps the op-by-op native path shares with the layer (kernels.h's expressions) */
void exp_rows(const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = expf(x[i]);
}

ELEMENTWISE void silu_rows(const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = silu_f(x[i]);
}

ELEMENTWISE void sigmoid_mul(float *x, const float *g, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * sigmoid_f(g[i]);
}

static int threads_for(int64_t work, int threads) { return work >= (1 << 16) ? threads : 1; }
/* A layer's projections split between threads only from 2^19 multiply-adds (rows included): below, a pool call's
 * hand-over costs about what the second thread saves (Q8_0 on 2 threads: 256x1024 4.7 vs 4.7 us, 1024x1024 8.9 vs
 * 15.3), and on a host whose other tenants load it each hand-over costs far more. The embedded model's 70-210 KB
 * projections gained ~3 us per step from a second thread in a quiet phase; its experts (~420 KB a call) gained
 * ~12 and keep threads_for. */
static int threads_for_projection(int64_t work, int threads) { return work >= (1 << 19) ? threads : 1; }

/* out [m, p->n_rows] = x [m, p->k] through stack p's one matrix */
static int project(ExpertStack p, const float *x, int64_t m, float *out, int threads, int isa) {
    QRows r;
    int rc = act_rows(&p, x, m, isa, &r);
    trace_mark(TRACE_ACT_QUANT, 0);
    if (rc == 0)
        quant_matmul(p.code, p.w, p.expert_bytes / p.n_rows, p.n_rows, r.q, r.d, r.bs, r.s, r.perm, p.k, m, out,
                     p.n_rows, threads_for_projection(m * p.n_rows * p.k, threads), isa);
    trace_mark(TRACE_PROJECTION, p.expert_bytes);
    act_rows_free(&r);
    return rc;
}

/* out [m, Σ rows] = x [m, k] through the parts side by side; consecutive parts of one type share their activation
 * rows (act_rows depends on the type only) */
static int project_parts(const Parts *ps, const float *x, int64_t m, float *out, int threads, int isa) {
    if (ps->n == 1) return project(ps->part[0], x, m, out, threads, isa);
    int64_t ld = 0;
    for (int64_t i = 0; i < ps->n; i++) ld += ps->part[i].n_rows;
    QRows r = {0};
    int rc = 0, made = -1;
    for (int64_t i = 0, col = 0; i < ps->n && rc == 0; col += ps->part[i].n_rows, i++) {
        const ExpertStack *p = &ps->part[i];
        if (made < 0 || ps->part[made].code != p->code) {
            if (made >= 0) act_rows_free(&r), r = (QRows){0};
            made = (int)i;
            rc = act_rows(p, x, m, isa, &r);
            trace_mark(TRACE_ACT_QUANT, 0);
            if (rc) break;
        }
        quant_matmul(p->code, p->w, p->expert_bytes / p->n_rows, p->n_rows, r.q, r.d, r.bs, r.s, r.perm, p->k, m,
                     out + col, ld, threads_for_projection(m * p->n_rows * p->k, threads), isa);
        trace_mark(TRACE_PROJECTION, p->expert_bytes);
    }
    act_rows_free(&r);
    return rc;
}

/* stack p's bytes, for pool_prefetch */
static Ahead bytes_of(const ExpertStack *p) {
    return (Ahead){(const char *)p->w, (const char *)p->w + p->expert_bytes, 0};
}

/* column block [c0, c0 + w) of the rows src [n, ld] into dst [n, w] */
static void columns(const float *src, int64_t n, int64_t ld, int64_t c0, int64_t w, float *dst) {
    for (int64_t t = 0; t < n; t++) memcpy(dst + t * w, src + t * ld + c0, (size_t)w * sizeof(float));
}

/* Gated DeltaNet: a [n, d] (normed) → y [n, d] (engine.models.qwen35.GatedDeltaNet). The pass's rows are those of
 * the sequences sq[0 … n_seq) in order (one sequence: sq[0] is p), each with its own conv and recurrent state: the
 * projections, the gate and the norm run over all rows at once, the conv and the recurrence over each sequence's. */
static int gdn_mixer(const GdnW *w, const LayerPass *p, const LayerPass *const *sq, int64_t n_seq, float eps,
                     const float *a, float *y, int64_t skip, Ahead router) {
    const int64_t n = p->n, c = w->c, kk = w->kk, hv = w->hv, hk = w->hk, dk = w->dk, dv = w->dv;
    const int64_t zw = hv * dv, ld = c + zw + 2 * hv, qk = hk * dk;
    int64_t widest = 0;
    for (int64_t j = 0; j < n_seq; j++) widest = sq[j]->n > widest ? sq[j]->n : widest;
    float *proj = malloc((size_t)(n * ld) * sizeof(float));
    float *s = malloc((size_t)(n * (5 * hv + c + 3 * zw + 2 * qk)) * sizeof(float));
    /* a sequence given no window: a scratch one, and its new conv state is written back over the old one (in place) */
    float *scratch_window = malloc((size_t)((kk - 1 + widest) * c) * sizeof(float));
    int rc = RC_NO_MEMORY;
    if (!proj || !s || !scratch_window) goto done;
    float *b = s, *al = b + n * hv, *g = al + n * hv, *u = g + n * hv, *o = u + n * c, *z = o + n * zw;
    float *q0 = z + n * zw, *k0 = q0 + n * qk, *v0 = k0 + n * qk, *beta0 = z + 2 * n * zw + 2 * n * qk;
    float *decay0 = beta0 + n * hv;
    if (project_parts(&w->in, a, n, proj, p->threads, p->isa)) goto done;
    /* the recurrence reads the state next: the workers fetch it while this thread makes the recurrence's inputs */
    const Ahead state = {(const char *)sq[0]->s_in, (const char *)(sq[0]->s_in + hv * dk * dv), 0};
    pool_prefetch(p->threads, &state, 1);
    for (int64_t j = 0, r = 0; j < n_seq; r += sq[j]->n, j++) {
        const LayerPass *e = sq[j];
        const int64_t m = e->n;
        float *window = e->window ? e->window : scratch_window;
        float *q = e->q ? e->q : q0 + r * qk, *k = e->k ? e->k : k0 + r * qk, *v = e->v ? e->v : v0 + r * zw;
        float *beta = e->beta ? e->beta : beta0 + r * hv, *decay = e->decay ? e->decay : decay0 + r * hv;
        memcpy(window, e->conv, (size_t)((kk - 1) * c) * sizeof(float));
        columns(proj + r * ld, m, ld, 0, c, window + (kk - 1) * c);
        columns(proj + r * ld, m, ld, c + zw, hv, b + r * hv);
        columns(proj + r * ld, m, ld, c + zw + hv, hv, al + r * hv);
        gdn_inputs(window, w->taps, m, c, kk, b + r * hv, al + r * hv, w->A, w->dt_bias, hv, hk, dk, eps,
                   (float)(1.0 / sqrt((double)dk)), u + r * c, q, k, beta, g + r * hv);
        columns(u + r * c, m, c, 2 * qk, zw, v);
        exp_rows(g + r * hv, m * hv, decay);
        trace_mark(TRACE_GDN_INPUTS, 0);
        rc = gdn_recurrence(q, k, v, beta, decay, e->s_in, e->s_out, o + r * zw, m, hv, hk, dk, dv,
                            threads_for(m * hv * dk * dv, p->threads), p->isa);
        if (rc) goto done;
        trace_mark(TRACE_RECURRENCE, 0);
        if (!e->window) memcpy((float *)e->conv, window + m * c, (size_t)((kk - 1) * c) * sizeof(float));
    }
    /* and the output projection (and the FFN's router) while this thread gates and norms */
    const Ahead out[2] = {bytes_of(&w->out), router};
    pool_prefetch(p->threads, out, 2);
    columns(proj, n, ld, c, zw, z);
    silu_rows(z, n * zw, z);
    norm_rows(o, n * hv, dv, w->norm, z, eps, 0, 1.f, o);
    trace_mark(TRACE_GATED_NORM, 0);
    rc = n > skip ? project(w->out, o + skip * zw, n - skip, y + skip * w->out.n_rows, p->threads, p->isa) : 0;
done:
    free(scratch_window);
    free(proj), free(s);
    return rc;
}

/* Gated attention: a [n, d] (normed) → y [n, d] (engine.models.qwen35.GatedAttention), the rows those of the
 * sequences sq[0 … n_seq) in order as for gdn_mixer; writes each sequence's keys and values into its cache rows
 * pos … pos + its n − 1 and attends over its own cache */
static int attn_mixer(const AttnW *w, const LayerPass *p, const LayerPass *const *sq, int64_t n_seq, float eps,
                      const float *a, float *y, int64_t skip, Ahead router) {
    const int64_t n = p->n, h = w->h, hkv = w->h_kv, dk = w->dk, dv = w->dv;
    const int64_t ld = 2 * h * dk + hkv * dk + hkv * dv;
    float *proj = malloc((size_t)(n * ld) * sizeof(float));
    float *s = malloc((size_t)(n * (h * dk + hkv * dk + h * dv)) * sizeof(float));
    int rc = RC_NO_MEMORY;
    if (!proj || !s) goto done;
    float *q = s, *k = q + n * h * dk, *o = k + n * hkv * dk;
    if (project_parts(&w->in, a, n, proj, p->threads, p->isa)) goto done;
    const Ahead out[2] = {bytes_of(&w->out), router};  /* the workers fetch the output projection meanwhile */
    pool_prefetch(p->threads, out, 2);
    for (int64_t t = 0; t < n; t++)
        for (int64_t hh = 0; hh < h; hh++)
            memcpy(q + (t * h + hh) * dk, proj + t * ld + hh * 2 * dk, (size_t)dk * sizeof(float));
    columns(proj, n, ld, 2 * h * dk, hkv * dk, k);
    norm_rows(q, n * h, dk, w->q_norm, NULL, eps, 0, 1.f, q);
    norm_rows(k, n * hkv, dk, w->k_norm, NULL, eps, 0, 1.f, k);
    for (int64_t j = 0, r = 0; j < n_seq; r += sq[j]->n, j++) {
        const LayerPass *e = sq[j];
        const int64_t m = e->n;
        float *qj = q + r * h * dk, *kj = k + r * hkv * dk;
        rope_neox(qj, m, h, dk, w->n_rot, e->cos_t, e->sin_t);
        rope_neox(kj, m, hkv, dk, w->n_rot, e->cos_t, e->sin_t);
        memcpy(e->kc + e->pos * hkv * dk, kj, (size_t)(m * hkv * dk) * sizeof(float));
        columns(proj + r * ld, m, ld, 2 * h * dk + hkv * dk, hkv * dv, e->vc + e->pos * hkv * dv);
        const int64_t s0 = r + m > skip ? (skip > r ? skip - r : 0) : m;  /* this sequence's rows asked for: s0 … */
        if (s0 < m && attention_causal(qj + s0 * h * dk, e->kc, e->vc, o + (r + s0) * h * dv, m - s0, e->pos + s0, h, hkv,
                                       dk, dv, w->scale, threads_for((m - s0) * h * (e->pos + m) * (dk + dv), p->threads),
                                       p->isa))
            goto done;
    }
    for (int64_t t = skip; t < n; t++)  /* o ⊙ sigmoid(gate): the gate rows follow each head's query rows */
        for (int64_t hh = 0; hh < h; hh++) {
            float *oh = o + (t * h + hh) * dv;
            const float *gh = proj + t * ld + hh * 2 * dk + dk;
            sigmoid_mul(oh, gh, dv);
        }
    trace_mark(TRACE_ATTENTION, 0);
    rc = n > skip ? project(w->out, o + skip * h * dv, n - skip, y + skip * w->out.n_rows, p->threads, p->isa) : 0;
done:
    free(proj), free(s);
    return rc;
}

/* The FFN: f [n, d] → y [n, d]; a MoE layer also gives its routing (logits, weights, ids) */
static int ffn(const FfnW *w, const LayerPass *p, const float *f, float *y) {
    const int64_t n = p->n;
    if (w->dense) {
        const int64_t ff = w->sd.k;
        float *gu = malloc((size_t)(n * 2 * ff) * sizeof(float)), *hbuf = malloc((size_t)(n * ff) * sizeof(float));
        int rc = RC_NO_MEMORY;
        if (gu && hbuf && project_parts(&w->gu, f, n, gu, p->threads, p->isa) == 0) {
            for (int64_t t = 0; t < n; t++) {
                memcpy(hbuf + t * ff, gu + t * 2 * ff, (size_t)ff * sizeof(float));
                silu_mul(hbuf + t * ff, gu + t * 2 * ff + ff, ff);
            }
            trace_mark(TRACE_EXPERT_MISC, 0);
            rc = project(w->sd, hbuf, n, y, p->threads, p->isa);
        }
        free(gu), free(hbuf);
        return rc;
    }
    ExpertStack st[6] = {w->sg, w->su, w->sd, w->gate, w->up, w->down};
    const int64_t e_bytes = w->gate.expert_bytes + w->up.expert_bytes + w->down.expert_bytes;
    const int th = threads_for(n * w->k_used * e_bytes, p->threads);
    for (int i = 0; i < 6; i++) st[i].threads = th;
    const int shared = w->shared_inp != NULL;
    const int rc = moe_layer(w->router, w->shared_inp, shared ? &st[0] : NULL, shared ? &st[1] : NULL,
                             shared ? &st[2] : NULL, &st[3], &st[4], &st[5], f, n, w->k_used, w->n_expert, p->logits,
                             p->wts, p->idx, y, p->isa);
    if (rc == 0 && p->counts)
        for (int64_t i = 0; i < n * w->k_used; i++) p->counts[p->idx[i]]++;
    return rc;
}

/* The layer over the rows of the sequences sq[0 … n_seq) (one: p itself): x ← h + ffn(norm(h)), h = x + mixer(norm(x)).
 * p gives the pass's rows (x, n), threads, isa and routing buffers; each sq[j] its n rows' state and positions. The
 * first `skip` rows' outputs are not asked for (the MTP head's rows before its draft row: only their keys and values,
 * or states, are kept): their attention, output projection and FFN are not computed, and their x rows keep no
 * meaning; the other rows' bits are as without it. */
static int layer_over(const LayerW *w, const LayerPass *p, const LayerPass *const *sq, int64_t n_seq, int64_t skip) {
    const int64_t n = p->n, d = w->d;
    float *buf = malloc((size_t)(3 * n * d) * sizeof(float));
    if (!buf) return RC_NO_MEMORY;
    float *a = buf, *y = a + n * d, *h = y + n * d;
    trace_restart();
    norm_rows(p->x, n, d, w->attn_norm, NULL, w->eps, 0, 1.f, a);
    trace_mark(TRACE_NORM, 0);
    /* the router's float rows, read first by the FFN: fetched with the mixer's output projection (from DRAM at the
     * start of routing, they were read at about half the products' bandwidth) */
    const Ahead router = w->ffn.dense ? (Ahead){0} : (Ahead){(const char *)w->ffn.router,
                                                            (const char *)(w->ffn.router + w->ffn.n_expert * d), 0};
    int rc = w->attention ? attn_mixer(&w->attn, p, sq, n_seq, w->eps, a, y, skip, router)
                          : gdn_mixer(&w->gdn, p, sq, n_seq, w->eps, a, y, skip, router);
    if (rc == 0 && n > skip) {
        const int64_t e = w->ffn.n_expert, k = w->ffn.k_used;
        for (int64_t i = skip * d; i < n * d; i++) h[i] = p->x[i] + y[i];
        norm_rows(h + skip * d, n - skip, d, w->post_norm, NULL, w->eps, 0, 1.f, a + skip * d);
        trace_mark(TRACE_NORM, 0);
        LayerPass rows = *p;  /* the rows asked for, with their routing buffers */
        rows.n = n - skip;
        if (!w->ffn.dense)
            rows.logits += skip * e, rows.wts += skip * k, rows.idx += skip * k;
        rc = ffn(&w->ffn, &rows, a + skip * d, y + skip * d);
    }
    pool_prefetch(p->threads, &w->next, 1);
    if (rc == 0)
        for (int64_t i = skip * d; i < n * d; i++) p->x[i] = h[i] + y[i];
    trace_mark(TRACE_NORM, 0);
    free(buf);
    return rc;
}

/* The layer: x ← h + ffn(norm(h)), h = x + mixer(norm(x)), over one sequence's pass. Returns 0, or the failure of a
 * call it makes (RC_NO_MEMORY, RC_EXPERT_ID, RC_MAX_EXPERTS, RC_MAX_DV). */
int decoder_layer(const LayerW *w, const LayerPass *p) {
    return layer_over(w, p, &p, 1, 0);
}

int dequant_rows(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n_rows, const int64_t *ids, int64_t n,
                 int64_t k, float *out);

/* The embeddings (`in`, where given) of x's n rows, then layer i over p[i] for every layer, then the output norm and
 * head (`out`, where given); each layer's rows are those of the sequences sq[i·n_seq … i·n_seq + n_seq) in order
 * (sq NULL: one sequence, p[i] itself), sequence j's at positions pos[j] … (RoPE rows cos_t[j], sin_t[j]) */
static int step_over(const LayerW *const *w, LayerPass *p, LayerPass *const *sq, int64_t n_seq, int64_t n_layers,
                     float *x, int64_t n, const int64_t *pos, const float *const *cos_t, const float *const *sin_t,
                     const StepIn *in, const MtpIn *mtp, const StepOut *out, int64_t skip, int64_t *failed) {
    trace_restart();  /* the time since the last native call was the caller's */
    if (in) {
        const int rc = dequant_rows(in->qtype, in->table, in->row_bytes, in->n_rows, in->ids, n, w[0]->d, x);
        if (rc) {
            *failed = -1;
            return rc;
        }
    }
    if (mtp) {  /* the MTP head's input: [RMSNorm(e) ; RMSNorm(hidden)] through eh, into x */
        const int64_t d = w[0]->d;
        float *cat = malloc((size_t)(n * 2 * d) * sizeof(float)), *hn = malloc((size_t)(n * d) * sizeof(float));
        int rc = cat && hn ? 0 : RC_NO_MEMORY;
        if (rc == 0) {
            norm_rows(x, n, d, mtp->enorm, NULL, mtp->eps, 0, 1.f, x);
            norm_rows(mtp->hidden, n, d, mtp->hnorm, NULL, mtp->eps, 0, 1.f, hn);
            for (int64_t t = 0; t < n; t++) {
                memcpy(cat + t * 2 * d, x + t * d, (size_t)d * sizeof(float));
                memcpy(cat + t * 2 * d + d, hn + t * d, (size_t)d * sizeof(float));
            }
            rc = project(mtp->eh, cat, n, x, p[0].threads, p[0].isa);
        }
        free(cat), free(hn);
        if (rc) {
            *failed = -1;
            return rc;
        }
    }
    for (int64_t i = 0; i < n_layers; i++) {
        p[i].x = x, p[i].n = n;
        int rc;
        if (sq) {
            LayerPass *const *si = sq + i * n_seq;
            for (int64_t j = 0; j < n_seq; j++) si[j]->pos = pos[j], si[j]->cos_t = cos_t[j], si[j]->sin_t = sin_t[j];
            rc = layer_over(w[i], &p[i], (const LayerPass *const *)si, n_seq, 0);
        } else {
            p[i].pos = pos[0], p[i].cos_t = cos_t[0], p[i].sin_t = sin_t[0];
            const LayerPass *one = &p[i];
            rc = layer_over(w[i], &p[i], &one, 1, i + 1 == n_layers ? skip : 0);
        }
        if (rc) {
            *failed = i;
            return rc;
        }
    }
    if (!out || n == skip) return 0;
    const int64_t d = w[n_layers - 1]->d;
    norm_rows(x + skip * d, n - skip, d, out->norm, NULL, out->eps, 0, 1.f, out->h + skip * d);
    if (out->head && project(*out->head, out->h + skip * d, n - skip, out->logits + skip * out->head->n_rows,
                             p[n_layers - 1].threads, p[n_layers - 1].isa)) {
        *failed = n_layers;
        return RC_NO_MEMORY;
    }
    return 0;
}

/* A decode step's layers in one call: `in` when given, then layer i over p[i] in order, each reading x [n, d] and
 * leaving its output there (the x, n, pos and RoPE rows of every p[i] set here); then `out` when given. Returns as
 * decoder_layer, or as dequant_rows for the embeddings (RC_ROW_ID: a token id outside the table); on an error, the
 * layer's index in *failed (-1: the embedding, n_layers: the head). */
int decoder_layers(const LayerW *const *w, LayerPass *p, int64_t n_layers, float *x, int64_t n, int64_t pos,
                   const float *cos_t, const float *sin_t, const StepIn *in, const StepOut *out, int64_t *failed) {
    return step_over(w, p, NULL, 1, n_layers, x, n, &pos, &cos_t, &sin_t, in, NULL, out, 0, failed);
}

/* decoder_layers for the MTP head's pass (engine.models.mtp): its input rows made from the embeddings of `in` and
 * mtp's hidden rows, then its layer(s) and `out` (the shared head norm; the head, where given). Only the rows from
 * `skip` on are asked for (a draft's row; none where the pass only catches the head's cache up): the rows before
 * leave their keys and values (layer_over), and their rows of out->h and out->logits are not written. */
int mtp_layers(const LayerW *const *w, LayerPass *p, int64_t n_layers, float *x, int64_t n, int64_t pos,
               const float *cos_t, const float *sin_t, const StepIn *in, const MtpIn *mtp, const StepOut *out,
               int64_t skip, int64_t *failed) {
    return step_over(w, p, NULL, 1, n_layers, x, n, &pos, &cos_t, &sin_t, in, mtp, out, skip, failed);
}

/* The same step over the rows of several sequences (the server's parallel requests): x [n, d] holds sequence j's
 * n_j rows after those of the sequences before it (n = Σ n_j); p[i] gives layer i's threads, isa and routing buffers
 * for all n rows; sq[i · n_seq + j] sequence j's state in layer i (its conv window, recurrent state, recurrence
 * inputs, KV cache: the fields decoder_layer reads from a pass), its n_j, and here its position pos[j] and RoPE rows
 * cos_t[j], sin_t[j]. The projections, the MoE and the head read their weights once for all rows; each sequence's
 * conv, recurrence and attention run over its own state, so every row gets the bits of its sequence's step alone. */
int decoder_layers_many(const LayerW *const *w, LayerPass *p, LayerPass *const *sq, int64_t n_seq, int64_t n_layers,
                        float *x, int64_t n, const int64_t *pos, const float *const *cos_t, const float *const *sin_t,
                        const StepIn *in, const StepOut *out, int64_t *failed) {
    return step_over(w, p, sq, n_seq, n_layers, x, n, pos, cos_t, sin_t, in, NULL, out, 0, failed);
}

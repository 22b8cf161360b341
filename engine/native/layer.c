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

/* Gated DeltaNet: a [n, d] (normed) → y [n, d] (engine.models.qwen35.GatedDeltaNet) */
static int gdn_mixer(const GdnW *w, const LayerPass *p, float eps, const float *a, float *y) {
    const int64_t n = p->n, c = w->c, kk = w->kk, hv = w->hv, hk = w->hk, dk = w->dk, dv = w->dv;
    const int64_t zw = hv * dv, ld = c + zw + 2 * hv, qk = hk * dk;
    float *proj = malloc((size_t)(n * ld) * sizeof(float));
    float *s = malloc((size_t)(n * (5 * hv + c + 3 * zw + 2 * qk)) * sizeof(float));
    /* no window given: a scratch one, and the new conv state is written back over the old one (in place) */
    float *window = p->window ? p->window : malloc((size_t)((kk - 1 + n) * c) * sizeof(float));
    int rc = RC_NO_MEMORY;
    if (!proj || !s || !window) goto done;
    float *b = s, *al = b + n * hv, *g = al + n * hv, *u = g + n * hv, *o = u + n * c, *z = o + n * zw;
    float *q = p->q ? p->q : z + n * zw, *k = p->k ? p->k : z + n * zw + n * qk;
    float *v = p->v ? p->v : z + n * zw + 2 * n * qk, *beta = p->beta ? p->beta : z + 2 * n * zw + 2 * n * qk;
    float *decay = p->decay ? p->decay : z + 2 * n * zw + 2 * n * qk + n * hv;
    if (project_parts(&w->in, a, n, proj, p->threads, p->isa)) goto done;
    /* the recurrence reads the state next: the workers fetch it while this thread makes the recurrence's inputs */
    const Ahead state = {(const char *)p->s_in, (const char *)(p->s_in + hv * dk * dv), 0};
    pool_prefetch(p->threads, &state, 1);
    memcpy(window, p->conv, (size_t)((kk - 1) * c) * sizeof(float));
    columns(proj, n, ld, 0, c, window + (kk - 1) * c);
    columns(proj, n, ld, c + zw, hv, b);
    columns(proj, n, ld, c + zw + hv, hv, al);
    gdn_inputs(window, w->taps, n, c, kk, b, al, w->A, w->dt_bias, hv, hk, dk, eps,
               (float)(1.0 / sqrt((double)dk)), u, q, k, beta, g);
    columns(u, n, c, 2 * qk, zw, v);
    exp_rows(g, n * hv, decay);
    trace_mark(TRACE_GDN_INPUTS, 0);
    rc = gdn_recurrence(q, k, v, beta, decay, p->s_in, p->s_out, o, n, hv, hk, dk, dv,
                        threads_for(n * hv * dk * dv, p->threads), p->isa);
    if (rc) goto done;
    trace_mark(TRACE_RECURRENCE, 0);
    const Ahead out = bytes_of(&w->out);  /* and the output projection while this thread gates and norms */
    pool_prefetch(p->threads, &out, 1);
    columns(proj, n, ld, c, zw, z);
    silu_rows(z, n * zw, z);
    norm_rows(o, n * hv, dv, w->norm, z, eps, 0, 1.f, o);
    trace_mark(TRACE_GATED_NORM, 0);
    rc = project(w->out, o, n, y, p->threads, p->isa);
    if (!p->window) memcpy((float *)p->conv, window + n * c, (size_t)((kk - 1) * c) * sizeof(float));
done:
    if (!p->window) free(window);
    free(proj), free(s);
    return rc;
}

/* Gated attention: a [n, d] (normed) → y [n, d] (engine.models.qwen35.GatedAttention); writes the pass's keys and
 * values into the cache rows pos … pos + n − 1 */
static int attn_mixer(const AttnW *w, const LayerPass *p, float eps, const float *a, float *y) {
    const int64_t n = p->n, h = w->h, hkv = w->h_kv, dk = w->dk, dv = w->dv;
    const int64_t ld = 2 * h * dk + hkv * dk + hkv * dv;
    float *proj = malloc((size_t)(n * ld) * sizeof(float));
    float *s = malloc((size_t)(n * (h * dk + hkv * dk + h * dv)) * sizeof(float));
    int rc = RC_NO_MEMORY;
    if (!proj || !s) goto done;
    float *q = s, *k = q + n * h * dk, *o = k + n * hkv * dk;
    if (project_parts(&w->in, a, n, proj, p->threads, p->isa)) goto done;
    const Ahead out = bytes_of(&w->out);  /* the workers fetch the output projection meanwhile */
    pool_prefetch(p->threads, &out, 1);
    for (int64_t t = 0; t < n; t++)
        for (int64_t hh = 0; hh < h; hh++)
            memcpy(q + (t * h + hh) * dk, proj + t * ld + hh * 2 * dk, (size_t)dk * sizeof(float));
    columns(proj, n, ld, 2 * h * dk, hkv * dk, k);
    norm_rows(q, n * h, dk, w->q_norm, NULL, eps, 0, 1.f, q);
    norm_rows(k, n * hkv, dk, w->k_norm, NULL, eps, 0, 1.f, k);
    rope_neox(q, n, h, dk, w->n_rot, p->cos_t, p->sin_t);
    rope_neox(k, n, hkv, dk, w->n_rot, p->cos_t, p->sin_t);
    memcpy(p->kc + p->pos * hkv * dk, k, (size_t)(n * hkv * dk) * sizeof(float));
    columns(proj, n, ld, 2 * h * dk + hkv * dk, hkv * dv, p->vc + p->pos * hkv * dv);
    if (attention_causal(q, p->kc, p->vc, o, n, p->pos, h, hkv, dk, dv, w->scale,
                         threads_for(n * h * (p->pos + n) * (dk + dv), p->threads), p->isa))
        goto done;
    for (int64_t t = 0; t < n; t++)  /* o ⊙ sigmoid(gate): the gate rows follow each head's query rows */
        for (int64_t hh = 0; hh < h; hh++) {
            float *oh = o + (t * h + hh) * dv;
            const float *gh = proj + t * ld + hh * 2 * dk + dk;
            sigmoid_mul(oh, gh, dv);
        }
    trace_mark(TRACE_ATTENTION, 0);
    rc = project(w->out, o, n, y, p->threads, p->isa);
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

/* The layer: x ← h + ffn(norm(h)), h = x + mixer(norm(x)). Returns 0, or the failure of a call it makes
 * (RC_NO_MEMORY, RC_EXPERT_ID, RC_MAX_EXPERTS, RC_MAX_DV). */
int decoder_layer(const LayerW *w, const LayerPass *p) {
    const int64_t n = p->n, d = w->d;
    float *buf = malloc((size_t)(3 * n * d) * sizeof(float));
    if (!buf) return RC_NO_MEMORY;
    float *a = buf, *y = a + n * d, *h = y + n * d;
    trace_restart();
    norm_rows(p->x, n, d, w->attn_norm, NULL, w->eps, 0, 1.f, a);
    trace_mark(TRACE_NORM, 0);
    int rc = w->attention ? attn_mixer(&w->attn, p, w->eps, a, y) : gdn_mixer(&w->gdn, p, w->eps, a, y);
    if (rc == 0) {
        for (int64_t i = 0; i < n * d; i++) h[i] = p->x[i] + y[i];
        norm_rows(h, n, d, w->post_norm, NULL, w->eps, 0, 1.f, a);
        trace_mark(TRACE_NORM, 0);
        rc = ffn(&w->ffn, p, a, y);
    }
    pool_prefetch(p->threads, &w->next, 1);
    if (rc == 0)
        for (int64_t i = 0; i < n * d; i++) p->x[i] = h[i] + y[i];
    trace_mark(TRACE_NORM, 0);
    free(buf);
    return rc;
}

int dequant_rows(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n_rows, const int64_t *ids, int64_t n,
                 int64_t k, float *out);

/* A decode step's layers in one call: `in` when given, then layer i over p[i] in order, each reading x [n, d] and
 * leaving its output there (the x, n, pos and RoPE rows of every p[i] set here); then `out` when given. Returns as
 * decoder_layer, or as dequant_rows for the embeddings (RC_ROW_ID: a token id outside the table); on an error, the
 * layer's index in *failed (-1: the embedding, n_layers: the head). */
int decoder_layers(const LayerW *const *w, LayerPass *p, int64_t n_layers, float *x, int64_t n, int64_t pos,
                   const float *cos_t, const float *sin_t, const StepIn *in, const StepOut *out, int64_t *failed) {
    if (in) {
        const int rc = dequant_rows(in->qtype, in->table, in->row_bytes, in->n_rows, in->ids, n, w[0]->d, x);
        if (rc) {
            *failed = -1;
            return rc;
        }
    }
    for (int64_t i = 0; i < n_layers; i++) {
        p[i].x = x, p[i].n = n, p[i].pos = pos, p[i].cos_t = cos_t, p[i].sin_t = sin_t;
        const int rc = decoder_layer(w[i], &p[i]);
        if (rc) {
            *failed = i;
            return rc;
        }
    }
    if (!out) return 0;
    const int64_t d = w[n_layers - 1]->d;
    norm_rows(x, n, d, out->norm, NULL, out->eps, 0, 1.f, out->h);
    if (out->head && project(*out->head, out->h, n, out->logits, p[n_layers - 1].threads, p[n_layers - 1].isa)) {
        *failed = n_layers;
        return RC_NO_MEMORY;
    }
    return 0;
}

/* A MoE layer's routed experts for the n tokens of a pass, in one call: the pairs grouped by expert, the
 * activations quantized as each projection's weights need, gate and up products, silu(gate) · up, the down
 * products, and the outputs weighted and summed over each token's top-k slots in slot order. Each expert's
 * blocks are read once per pass whatever n is, and every output element takes the same steps whatever n and the
 * thread split (the products' rule, kquant.c), so a pass over n tokens gives each token a one-token pass's bits.
 * One call where the Python driver made about fifteen (engine/ops/experts.py), with the same kernels.
 */
#include <stdlib.h>
#include "kernels.h"

int64_t group_expert_pairs(const int64_t *idx, int64_t n, int64_t k, int64_t n_expert, int64_t *order,
                           int64_t *tokens, int64_t *experts, int64_t *counts, int64_t *starts);

static int wants_perm(int code, int isa) { return code == T_Q4_K && isa_runs(isa, ISA_AVX512); }

/* Buffers for m activation rows as stack s's products take them (kernels.h act_format): 0, or RC_NO_MEMORY when out of
 * memory (act_rows_free releases what was made either way). act_fill then quantizes rows into them. */
static int act_alloc(const ExpertStack *s, int64_t m, int isa, QRows *r) {
    const int64_t k = s->k;
    const int fmt = act_format(s->code);
    *r = (QRows){0};
    if (fmt == ACT_F16 || fmt == ACT_BF16) return (r->q = malloc((size_t)(m * k) * 2)) ? 0 : RC_NO_MEMORY;
    r->q = malloc((size_t)(m * k));
    if (fmt == ACT_Q8_0 || fmt == ACT_Q8_1) {
        r->d = malloc((size_t)(m * (k / QK8_0)) * sizeof(float));
        if (fmt == ACT_Q8_1) r->s = malloc((size_t)(m * (k / QK8_0)) * sizeof(float));
        return r->q && r->d && (fmt == ACT_Q8_0 || r->s) ? 0 : RC_NO_MEMORY;
    }
    r->d = malloc((size_t)(m * (k / QK_K)) * sizeof(float));
    r->bs = malloc((size_t)(m * (k / 16)) * sizeof(int16_t));
    if (wants_perm(s->code, isa)) r->perm = malloc((size_t)(m * k));
    return r->q && r->d && r->bs && (r->perm || !wants_perm(s->code, isa)) ? 0 : RC_NO_MEMORY;
}

/* rows [r0, r1) of x [·, s->k] quantized into r's rows r0 … r1−1: each row on its own, so rows filled apart (by
 * different threads) are the rows one call fills */
static void act_fill(const ExpertStack *s, const float *x, int64_t r0, int64_t r1, int isa, QRows *r) {
    const int64_t k = s->k, m = r1 - r0;
    const float *xr = x + r0 * k;
    switch (act_format(s->code)) {
    case ACT_F16: case ACT_BF16:
        round_half(xr, m * k, act_format(s->code) == ACT_BF16, (uint16_t *)r->q + r0 * k);
        return;
    case ACT_Q8_0:
        quantize_q8_0(xr, m, k, r->q + r0 * k, r->d + r0 * (k / QK8_0), isa);
        return;
    case ACT_Q8_1:
        quantize_q8_1(xr, m, k, r->q + r0 * k, r->d + r0 * (k / QK8_0), r->s + r0 * (k / QK8_0), isa);
        return;
    default:
        quantize_q8_k(xr, m, k, r->q + r0 * k, r->d + r0 * (k / QK_K), r->bs + r0 * (k / 16), isa);
        if (r->perm) q8_k_to_q4_k_order(r->q + r0 * k, m, k, r->perm + r0 * k);
    }
}

/* x [m, s->k] as the rows s's products take; 0, or RC_NO_MEMORY (act_rows_free releases what was made either
 * way). */
int act_rows(const ExpertStack *s, const float *x, int64_t m, int isa, QRows *r) {
    if (act_alloc(s, m, isa, r)) return RC_NO_MEMORY;
    act_fill(s, x, 0, m, isa, r);
    return 0;
}

void act_rows_free(QRows *r) {
    free(r->q), free(r->d), free(r->s), free(r->bs), free(r->perm);
}

/* g ← silu(g) · u, element by element; exported so the grouped Python driver (an expert cache's passes) computes
 * the bits this file's passes compute. */
ELEMENTWISE void silu_mul(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = silu_f(g[i]) * u[i];
}

/* One set of experts a pass runs: the routed experts (idx [n, k_used] ids in [0, n_expert), wts their weights), or
 * the shared expert (a set of one expert that every token takes, weighted by its gate). Into y [n, d]:
 * y[t] = Σ_s wts[t, s] · down_e(silu(gate_e x_t) ⊙ up_e x_t), e = idx[t, s], summed in slot order from 0. */
typedef struct {
    const ExpertStack *gate, *up, *down;
    const int64_t *idx;
    const float *wts;
    int64_t k_used, n_expert;
    float *y;
    /* the pass's scratch (set_begin) */
    int64_t p_n, n_groups, *ints, *order, *tokens, *self, *experts, *counts, *starts;
    float *g, *u, *o;
    QRows xg, xu, xh;
    int same;
    PairsJob jg, ju, jd;  /* the gate, up and down products (set_begin) */
} ExpertSet;

static PairsJob job(const ExpertStack *st, const QRows *x, const int64_t *xrow, const ExpertSet *s, float *out,
                    int isa) {
    return pairs_job(st->code, st->w, st->expert_bytes, st->expert_bytes / st->n_rows, st->n_rows, x->q, x->d, x->bs,
                     x->s, x->perm, st->k, xrow, s->n_groups, s->experts, s->starts, out, isa);
}

/* groups the set's pairs by expert, quantizes x for its gate and up products, makes room for the down products'
 * input rows and sets the three products' jobs: 0, RC_NO_MEMORY or RC_EXPERT_ID */
static int set_begin(ExpertSet *s, const float *x, int64_t n, int isa) {
    const int64_t p_n = s->p_n = n * s->k_used, f = s->gate->n_rows, d = s->down->n_rows, ne = s->n_expert;
    s->ints = malloc((size_t)(3 * p_n + 3 * ne + 1) * sizeof(int64_t));
    s->g = malloc((size_t)(p_n * f) * sizeof(float)), s->u = malloc((size_t)(p_n * f) * sizeof(float));
    s->o = malloc((size_t)(p_n * d) * sizeof(float));
    if (!s->ints || !s->g || !s->u || !s->o) return RC_NO_MEMORY;
    s->order = s->ints, s->tokens = s->order + p_n, s->self = s->tokens + p_n, s->experts = s->self + p_n;
    s->counts = s->experts + ne, s->starts = s->counts + ne;
    s->n_groups = group_expert_pairs(s->idx, n, s->k_used, ne, s->order, s->tokens, s->experts, s->counts, s->starts);
    if (s->n_groups < 0) return (int)s->n_groups;
    if (act_rows(s->gate, x, n, isa, &s->xg)) return RC_NO_MEMORY;
    /* up reuses the gate's rows where it reads the same format (with the Q4_K order where it needs that) */
    s->same = act_format(s->up->code) == act_format(s->gate->code) && (s->xg.perm || !wants_perm(s->up->code, isa));
    if ((!s->same && act_rows(s->up, x, n, isa, &s->xu)) || act_alloc(s->down, p_n, isa, &s->xh)) return RC_NO_MEMORY;
    for (int64_t p = 0; p < p_n; p++) s->self[p] = p;  /* the down products read pair p's own row */
    s->jg = job(s->gate, &s->xg, s->tokens, s, s->g, isa);
    s->ju = job(s->up, s->same ? &s->xg : &s->xu, s->tokens, s, s->u, isa);
    s->jd = job(s->down, &s->xh, s->self, s, s->o, isa);
    return 0;
}

static void set_free(ExpertSet *s) {
    act_rows_free(&s->xg), act_rows_free(&s->xu), act_rows_free(&s->xh);
    free(s->ints), free(s->g), free(s->u), free(s->o);
}

/* y[t] = Σ_s wts[t, s] · o[pair of (t, s)] of each set, the slots summed in order from 0 */
static void reduce_sets(ExpertSet *sets, int n_sets, int64_t n) {
    for (int i = 0; i < n_sets; i++) {
        /* pair p holds flat slot order[p] = t·k_used + s: place it, then sum each token's slots in order */
        const ExpertSet *s = &sets[i];
        const int64_t d = s->down->n_rows, k = s->k_used;
        for (int64_t p = 0; p < s->p_n; p++) s->tokens[s->order[p]] = p;
        for (int64_t t = 0; t < n; t++) {
            float *yt = s->y + t * d;
            for (int64_t j = 0; j < d; j++) yt[j] = 0.f;
            for (int64_t sl = 0; sl < k; sl++) {
                const float ws = s->wts[t * k + sl], *os = s->o + s->tokens[t * k + sl] * d;
                for (int64_t j = 0; j < d; j++) yt[j] += ws * os[j];
            }
        }
    }
}

/* Passes of up to WHOLE_ROWS tokens (decode steps, verifies, a batch's shared pass) run each expert whole as one work
 * item: its gate and up products over its pairs, silu · up, those rows quantized for down, its down products. The
 * layer's experts then take one pool call instead of two, and silu and the quantization run on every thread instead
 * of on the caller between the calls: a decode step's experts are small (the embedded model's 100 KB, a 35B-A3B
 * expert's 1.7 MB) beside the 1–2 µs a hand-over to the pool costs, and a verify's ~30 distinct experts of 1–3 rows
 * each keep both threads busy (the mid MoE's 5-row verify: the caller's silu and quantization 0.3-0.5 ms of ~18, now
 * 0.13 on all threads; scratch A/B, 1-2 % a verify). The items go largest first (pairs × the expert's bytes), so
 * claiming them in order evens the threads out. The kernels per row are the two-call form's, so are the bits. */
#define WHOLE_ROWS 16

typedef struct {
    ExpertSet *set;
    int64_t g, weight;
} WholeItem;

typedef struct {
    const WholeItem *items;
    int64_t n;
    int isa;
} Whole;

static void whole_item(void *ctx, int64_t i) {
    const Whole *w = ctx;
    ExpertSet *s = w->items[i].set;
    const int64_t g = w->items[i].g, p0 = s->starts[g], p1 = s->starts[g + 1], f = s->gate->n_rows;
    pairs_group(&s->jg, g, &s->ju, g);
    pairs_group(&s->ju, g, &s->jd, g);
    silu_mul(s->g + p0 * f, s->u + p0 * f, (p1 - p0) * f);
    act_fill(s->down, s->g, p0, p1, w->isa, &s->xh);
    const WholeItem *nx = i + 1 < w->n ? &w->items[i + 1] : NULL;  /* likely this thread's next: its gate */
    pairs_group(&s->jd, g, nx ? &nx->set->jg : NULL, nx ? nx->g : 0);
}

/* the sets' experts as whole items in one pool call (after set_begin); the bytes read into *bytes; 0 or RC_NO_MEMORY */
static int run_whole(ExpertSet *sets, int n_sets, int threads, int isa, int64_t *bytes) {
    int64_t n_items = 0;
    for (int i = 0; i < n_sets; i++) n_items += sets[i].n_groups;
    WholeItem *items = malloc((size_t)n_items * sizeof(WholeItem));
    if (!items) return RC_NO_MEMORY;
    int64_t ni = 0;
    for (int i = 0; i < n_sets; i++) {
        ExpertSet *s = &sets[i];
        const int64_t eb = s->gate->expert_bytes + s->up->expert_bytes + s->down->expert_bytes;
        for (int64_t g = 0; g < s->n_groups; g++) {
            WholeItem it = {s, g, (s->starts[g + 1] - s->starts[g]) * eb};
            int64_t j = ni++;
            for (; j > 0 && items[j - 1].weight < it.weight; j--) items[j] = items[j - 1];  /* stable, largest first */
            items[j] = it;
        }
        *bytes += s->n_groups * eb;
    }
    Whole w = {items, n_items, isa};
    cpu_features();
    pool_run(threads, n_items, whole_item, &w);
    free(items);
    return 0;
}

/* Up to two sets of experts over the same rows x [n, d]: every gate and up product in one pool call, every down
 * product in one more (one call in all for a small pass: run_whole). Each expert's blocks are read once per pass
 * whatever n is. Returns 0, RC_NO_MEMORY or RC_EXPERT_ID. */
static int run_sets(ExpertSet *sets, int n_sets, const float *x, int64_t n, int isa) {
    PairsJob jobs[4];
    int64_t bytes = 0;
    int rc = 0;
    const int threads = sets[0].gate->threads;
    for (int i = 0; i < n_sets && rc == 0; i++) rc = set_begin(&sets[i], x, n, isa);
    if (rc) goto done;
    trace_mark(TRACE_ACT_QUANT, 0);
    if (n <= WHOLE_ROWS) {
        rc = run_whole(sets, n_sets, threads, isa, &bytes);
        if (rc) goto done;
        trace_mark(TRACE_EXPERT_PRODUCTS, bytes);
        reduce_sets(sets, n_sets, n);
        trace_mark(TRACE_EXPERT_MISC, 0);
        goto done;
    }
    for (int i = 0; i < n_sets; i++) {
        ExpertSet *s = &sets[i];
        jobs[2 * i] = s->jg, jobs[2 * i + 1] = s->ju;
        bytes += s->n_groups * (s->gate->expert_bytes + s->up->expert_bytes);
    }
    pairs_run(jobs, 2 * n_sets, threads);
    trace_mark(TRACE_EXPERT_PRODUCTS, bytes);
    bytes = 0;
    /* the down matrices, in the order of the next call's items, fetched by the workers while this thread runs silu
     * and quantizes */
    Ahead down[16];
    int nd = 0;
    for (int i = 0; i < n_sets; i++)
        for (int64_t g = 0; g < sets[i].n_groups && nd < 16; g++) {
            const char *e = (const char *)sets[i].down->w + sets[i].experts[g] * sets[i].down->expert_bytes;
            down[nd++] = (Ahead){e, e + sets[i].down->expert_bytes, 0};
        }
    pool_prefetch(threads, down, nd);
    for (int i = 0; i < n_sets; i++) {
        ExpertSet *s = &sets[i];
        silu_mul(s->g, s->u, s->p_n * s->gate->n_rows);
        act_fill(s->down, s->g, 0, s->p_n, isa, &s->xh);
        jobs[i] = s->jd;
        bytes += s->n_groups * s->down->expert_bytes;
    }
    trace_mark(TRACE_EXPERT_MISC, 0);
    pairs_run(jobs, n_sets, threads);
    trace_mark(TRACE_EXPERT_PRODUCTS, bytes);
    reduce_sets(sets, n_sets, n);
    trace_mark(TRACE_EXPERT_MISC, 0);
done:
    for (int i = 0; i < n_sets; i++) set_free(&sets[i]);
    return rc;
}

/* The routed experts alone (the grouped Python driver's call): as run_sets with one set. */
int moe_routed(const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down, const float *x, int64_t n,
               const int64_t *idx, const float *wts, int64_t k_used, int64_t n_expert, float *y, int isa) {
    ExpertSet s = {gate, up, down, idx, wts, k_used, n_expert, y};
    return run_sets(&s, 1, x, n, isa);
}

/* ---- the whole layer: router, top-k, routed experts, shared expert ------------------------------------------- */

/* Four sums Σ a_j[i]·b_j[i] at once, each over 8 fixed lanes (lane i % 8), summed pairwise at the end: the same
 * numbers from every instruction set (a plain multiply and add per lane, no contraction), whichever clone runs, and
 * whatever the other three sums are. Four at a time: one sum alone waited on its adds' latency (the router's
 * products ran at a third of the core's speed). */
typedef float V8 __attribute__((vector_size(32)));  /* the 8 lanes (two SSE registers in the default clone) */

#define V8_AT(p) (*(const V8 __attribute__((aligned(4), may_alias)) *)(p))  /* 8 floats at p, unaligned */
#define V8_SUM(v) (((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])))

__attribute__((target_clones("avx2", "default")))
static void dots4(const float *const a[4], const float *const b[4], int64_t n, float out[4]) {
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *b0 = b[0], *b1 = b[1], *b2 = b[2], *b3 = b[3];
    V8 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        c0 += V8_AT(a0 + i) * V8_AT(b0 + i), c1 += V8_AT(a1 + i) * V8_AT(b1 + i);
        c2 += V8_AT(a2 + i) * V8_AT(b2 + i), c3 += V8_AT(a3 + i) * V8_AT(b3 + i);
    }
    for (; i < n; i++)
        c0[i % 8] += a0[i] * b0[i], c1[i % 8] += a1[i] * b1[i], c2[i % 8] += a2[i] * b2[i], c3[i % 8] += a3[i] * b3[i];
    out[0] = V8_SUM(c0), out[1] = V8_SUM(c1), out[2] = V8_SUM(c2), out[3] = V8_SUM(c3);
}

/* One token's routing, as llama.cpp's build_moe_ffn (softmax gating, top-k, weights renormalised): logits =
 * router · x (route_logits, first); softmax with the sum in double (ggml_soft_max); the k largest probabilities in descending order
 * (the lower expert id first on a tie); each divided by their sum. */
typedef struct {
    const float *router, *x;
    int64_t n, d, n_expert, k_used;
    float *logits, *wts;
    int64_t *idx;
} Route;

#define ROUTE_CHUNK 8  /* experts per item of the router's products */
#define ROUTE_TOKENS 16  /* tokens per item likewise: each router row read once for them */

/* The sums a[p_j] · b[q_j] for the c pairs j (vectors of n floats), four at a time (dots4; past the last pair, the
 * last again, its sum not kept) */
static void pair_dots(const float *const *a, const float *const *b, int64_t c, int64_t n, float *out) {
    for (int64_t p = 0; p < c; p += 4) {
        const float *a4[4], *b4[4];
        float o[4];
        for (int j = 0; j < 4; j++) a4[j] = a[p + j < c ? p + j : c - 1], b4[j] = b[p + j < c ? p + j : c - 1];
        dots4(a4, b4, n, o);
        for (int j = 0; j < 4 && p + j < c; j++) out[p + j] = o[j];
    }
}

/* logits of the tokens [ROUTE_TOKENS · (i / chunks), …) for experts [ROUTE_CHUNK · (i % chunks), …): the router's
 * rows split between threads (a 35B layer's router is 2 MiB of float32, read each step), the item's (expert, token)
 * pairs four at a time */
static void route_logits(void *ctx, int64_t i) {
    const Route *r = ctx;
    const int64_t chunks = (r->n_expert + ROUTE_CHUNK - 1) / ROUTE_CHUNK, t0 = i / chunks * ROUTE_TOKENS;
    const int64_t e0 = (i % chunks) * ROUTE_CHUNK, e1 = e0 + ROUTE_CHUNK < r->n_expert ? e0 + ROUTE_CHUNK : r->n_expert;
    const int64_t nt = t0 + ROUTE_TOKENS < r->n ? ROUTE_TOKENS : r->n - t0, np = (e1 - e0) * nt;
    /* the item's rows asked for at once: they are read from DRAM once per step, and the hardware prefetcher alone
     * left this product at about half the products' bandwidth (a 1024-wide router, with each row asking for the one
     * two ahead: 10% less time, A/B) */
    for (int64_t e = e0; e < e1; e++)
        for (int64_t c = 0; c < r->d; c += 64 / (int64_t)sizeof(float)) __builtin_prefetch(r->router + e * r->d + c, 0, 3);
    const float *a[ROUTE_CHUNK * ROUTE_TOKENS] = {NULL}, *b[ROUTE_CHUNK * ROUTE_TOKENS] = {NULL};
    float out[ROUTE_CHUNK * ROUTE_TOKENS];
    for (int64_t p = 0; p < np; p++) a[p] = r->router + (e0 + p / nt) * r->d, b[p] = r->x + (t0 + p % nt) * r->d;
    pair_dots(a, b, np, r->d, out);
    for (int64_t p = 0; p < np; p++) r->logits[(t0 + p % nt) * r->n_expert + e0 + p / nt] = out[p];
}

static void route_item(void *ctx, int64_t t) {
    const Route *r = ctx;
    const int64_t E = r->n_expert, k = r->k_used;
    float *l = r->logits + t * E, *w = r->wts + t * k;
    int64_t *id = r->idx + t * k;
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; e++)
        if (l[e] > mx) mx = l[e];
    float p[MAX_EXPERTS];  /* checked by moe_route */
    double sum = 0.0;
    for (int64_t e = 0; e < E; e++) sum += (double)(p[e] = expf(l[e] - mx));
    const float inv = (float)(1.0 / sum);
    for (int64_t e = 0; e < E; e++) p[e] *= inv;
    /* the k best in one pass, kept in descending order: an expert enters past those it beats, after any it ties (the
     * lower id first) */
    int64_t m = 0;
    for (int64_t e = 0; e < E; e++) {
        if (m == k && !(p[e] > w[k - 1])) continue;
        int64_t j = m < k ? m++ : k - 1;
        for (; j > 0 && p[e] > w[j - 1]; j--) w[j] = w[j - 1], id[j] = id[j - 1];
        w[j] = p[e], id[j] = e;
    }
    double wsum = 0.0;
    for (int64_t s = 0; s < k; s++) wsum += (double)w[s];
    const float ws = (float)wsum;
    for (int64_t s = 0; s < k; s++) w[s] = w[s] / ws;
}

/* A pass's routing (route_item per token) and, with shared_inp, the shared expert's gate sigmoid(shared_inp · x_t)
 * into sgate [n]: what moe_layer computes first, and what the op-by-op form of the layer calls (ops.moe_route), so
 * both route with the same bits. Returns 0, or RC_MAX_EXPERTS for more than MAX_EXPERTS experts (or k over them). */
int moe_route(const float *router, const float *shared_inp, const float *x, int64_t n, int64_t d, int64_t k_used,
              int64_t n_expert, float *logits, float *wts, int64_t *idx, float *sgate, int threads) {
    if (n_expert > MAX_EXPERTS || k_used > n_expert) return RC_MAX_EXPERTS;
    Route r = {router, x, n, d, n_expert, k_used, logits, wts, idx};
    const int64_t chunks = (n_expert + ROUTE_CHUNK - 1) / ROUTE_CHUNK;
    pool_run(n * n_expert * d >= (1 << 16) ? threads : 1, (n + ROUTE_TOKENS - 1) / ROUTE_TOKENS * chunks, route_logits,
             &r);
    pool_run(n > 1 ? threads : 1, n, route_item, &r);
    if (shared_inp)  /* the shared expert's gate: shared_inp · x_t, the router's sums, ROUTE_TOKENS tokens at a time */
        for (int64_t t0 = 0; t0 < n; t0 += ROUTE_TOKENS) {
            const int64_t m = t0 + ROUTE_TOKENS < n ? ROUTE_TOKENS : n - t0;
            const float *a[ROUTE_TOKENS], *b[ROUTE_TOKENS];
            for (int64_t t = 0; t < m; t++) a[t] = shared_inp, b[t] = x + (t0 + t) * d;
            pair_dots(a, b, m, d, sgate + t0);
            for (int64_t t = t0; t < t0 + m; t++) sgate[t] = sigmoid_f(sgate[t]);
        }
    trace_mark(TRACE_ROUTER, n_expert * d * (int64_t)sizeof(float));
    return 0;
}

/* A MoE layer for the n tokens of a pass in one call: routing (router [n_expert, d] float32), the routed experts,
 * and the shared expert (stacks sg, su, sd with one expert each; NULL when the layer has none) weighted by
 * sigmoid(shared_inp · x) and added after the routed sum; the two sets' products run in the same pool calls
 * (run_sets). Outputs y [n, d], and the router's logits [n, n_expert], weights and ids [n, k_used] (the model's hooks
 * and routing statistics read them). Returns as moe_routed and moe_route. */
int moe_layer(const float *router, const float *shared_inp, const ExpertStack *sg, const ExpertStack *su,
              const ExpertStack *sd, const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down,
              const float *x, int64_t n, int64_t k_used, int64_t n_expert, float *logits, float *wts, int64_t *idx,
              float *y, int isa) {
    const int64_t d = down->n_rows;
    float *sw = malloc((size_t)n * sizeof(float)), *ys = sg ? malloc((size_t)(n * d) * sizeof(float)) : NULL;
    int64_t *zero = sg ? calloc((size_t)n, sizeof(int64_t)) : NULL;
    int rc = RC_NO_MEMORY;
    if (!sw || (sg && (!ys || !zero))) goto done;
    rc = moe_route(router, shared_inp, x, n, gate->k, k_used, n_expert, logits, wts, idx, sw, gate->threads);
    if (rc) goto done;
    ExpertSet sets[2] = {{gate, up, down, idx, wts, k_used, n_expert, y},
                         {sg, su, sd, zero, sw, 1, 1, ys}};  /* ys[t] = sw[t] · shared(x_t) */
    rc = run_sets(sets, sg ? 2 : 1, x, n, isa);
    if (rc == 0 && sg)
        for (int64_t i = 0; i < n * d; i++) y[i] += ys[i];
done:
    free(sw), free(ys), free(zero);
    return rc;
}

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
void quant_matmul_pairs(int qtype, const uint8_t *w, int64_t expert_bytes, int64_t row_bytes, int64_t n_rows,
                        const int8_t *xq, const float *xd, const int16_t *xbs, const float *xs, const int8_t *xperm,
                        int64_t k, const int64_t *xrow, int64_t n_groups, const int64_t *experts, const int64_t *starts,
                        float *out, int n_threads, int isa);

static int wants_perm(int code, int isa) { return code == T_Q4_K && isa_runs(isa, ISA_AVX512); }

/* x [m, s->k] as the rows s's products take (kernels.h act_format); 0, or -1 when out of memory (act_rows_free
 * releases what was made either way). */
int act_rows(const ExpertStack *s, const float *x, int64_t m, int isa, QRows *r) {
    const int64_t k = s->k;
    const int fmt = act_format(s->code);
    *r = (QRows){0};
    if (fmt == ACT_F16 || fmt == ACT_BF16) {
        r->q = malloc((size_t)(m * k) * 2);
        if (!r->q) return -1;
        round_half(x, m * k, fmt == ACT_BF16, (uint16_t *)r->q);
        return 0;
    }
    r->q = malloc((size_t)(m * k));
    r->d = malloc((size_t)(m * (k / QK8_0)) * sizeof(float));
    if (!r->q || !r->d) return -1;
    if (fmt == ACT_Q8_0) {
        quantize_q8_0(x, m, k, r->q, r->d);
        return 0;
    }
    if (fmt == ACT_Q8_1) {
        r->s = malloc((size_t)(m * (k / QK8_0)) * sizeof(float));
        if (!r->s) return -1;
        quantize_q8_1(x, m, k, r->q, r->d, r->s);
        return 0;
    }
    r->bs = malloc((size_t)(m * (k / 16)) * sizeof(int16_t));
    if (!r->bs) return -1;
    quantize_q8_k(x, m, k, r->q, r->d, r->bs, isa);
    if (wants_perm(s->code, isa)) {
        r->perm = malloc((size_t)(m * k));
        if (!r->perm) return -1;
        q8_k_to_q4_k_order(r->q, m, k, r->perm);
    }
    return 0;
}

void act_rows_free(QRows *r) {
    free(r->q), free(r->d), free(r->s), free(r->bs), free(r->perm);
}

static void pairs(const ExpertStack *s, const QRows *x, const int64_t *xrow, int64_t n_groups,
                  const int64_t *experts, const int64_t *starts, float *out, int isa) {
    const int64_t row_bytes = s->expert_bytes / s->n_rows;
    quant_matmul_pairs(s->code, s->w, s->expert_bytes, row_bytes, s->n_rows, x->q, x->d, x->bs, x->s, x->perm, s->k,
                       xrow, n_groups, experts, starts, out, s->threads, isa);
}

/* g ← silu(g) · u, element by element; exported so the grouped Python driver (an expert cache's passes) computes
 * the bits this file's passes compute. */
void silu_mul(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = silu_f(g[i]) * u[i];
}

/* x [n, d]; idx [n, k_used] expert ids in [0, n_expert), wts [n, k_used] their weights; y [n, d]:
 * y[t] = Σ_s wts[t, s] · down_e(silu(gate_e x_t) ⊙ up_e x_t), e = idx[t, s], summed in slot order from 0.
 * Returns 0, -1 when out of memory, -2 for an expert id out of range. */
int moe_routed(const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down, const float *x, int64_t n,
               const int64_t *idx, const float *wts, int64_t k_used, int64_t n_expert, float *y, int isa) {
    const int64_t p_n = n * k_used, f = gate->n_rows, d = down->n_rows;
    int64_t *ints = malloc((size_t)(3 * p_n + 3 * n_expert + 1) * sizeof(int64_t));
    float *g = malloc((size_t)(p_n * f) * sizeof(float)), *u = malloc((size_t)(p_n * f) * sizeof(float));
    float *o = malloc((size_t)(p_n * d) * sizeof(float));
    QRows xg = {0}, xu = {0}, xh = {0};
    int rc = -1;
    if (!ints || !g || !u || !o) goto done;
    int64_t *order = ints, *tokens = order + p_n, *self = tokens + p_n, *experts = self + p_n,
            *counts = experts + n_expert, *starts = counts + n_expert;
    const int64_t n_groups = group_expert_pairs(idx, n, k_used, n_expert, order, tokens, experts, counts, starts);
    if (n_groups < 0) {
        rc = -2;
        goto done;
    }
    if (act_rows(gate, x, n, isa, &xg)) goto done;
    /* up reuses the gate's rows where it reads the same format (with the Q4_K order where it needs that) */
    const int same = act_format(up->code) == act_format(gate->code) && (xg.perm || !wants_perm(up->code, isa));
    if (!same && act_rows(up, x, n, isa, &xu)) goto done;
    pairs(gate, &xg, tokens, n_groups, experts, starts, g, isa);
    pairs(up, same ? &xg : &xu, tokens, n_groups, experts, starts, u, isa);
    silu_mul(g, u, p_n * f);
    if (act_rows(down, g, p_n, isa, &xh)) goto done;
    for (int64_t p = 0; p < p_n; p++) self[p] = p;
    pairs(down, &xh, self, n_groups, experts, starts, o, isa);
    /* pair p holds flat slot order[p] = t·k_used + s: place it, then sum each token's slots in order */
    for (int64_t p = 0; p < p_n; p++) tokens[order[p]] = p;
    for (int64_t t = 0; t < n; t++) {
        float *yt = y + t * d;
        for (int64_t j = 0; j < d; j++) yt[j] = 0.f;
        for (int64_t s = 0; s < k_used; s++) {
            const float ws = wts[t * k_used + s], *os = o + tokens[t * k_used + s] * d;
            for (int64_t j = 0; j < d; j++) yt[j] += ws * os[j];
        }
    }
    rc = 0;
done:
    act_rows_free(&xg), act_rows_free(&xu), act_rows_free(&xh);
    free(ints), free(g), free(u), free(o);
    return rc;
}

/* ---- the whole layer: router, top-k, routed experts, shared expert ------------------------------------------- */

/* Σ a[i]·b[i] over 8 fixed lanes, summed pairwise at the end: the same numbers from every instruction set (a plain
 * multiply and add per lane, no contraction), whichever clone runs. */
__attribute__((target_clones("avx2", "default")))
static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    for (; i < n; i++) acc[i % 8] += a[i] * b[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* One token's routing, as llama.cpp's build_moe_ffn (softmax gating, top-k, weights renormalised): logits =
 * router · x (route_logits, first); softmax with the sum in double (ggml_soft_max); the k largest probabilities in descending order
 * (the lower expert id first on a tie); each divided by their sum. */
typedef struct {
    const float *router, *x;
    int64_t d, n_expert, k_used;
    float *logits, *wts;
    int64_t *idx;
} Route;

#define ROUTE_CHUNK 8  /* experts per item of the router's products */

/* logits of token i / chunks for experts [ROUTE_CHUNK · (i % chunks), …): the router's rows split between threads
 * (a 35B layer's router is 2 MiB of float32, read each step) */
static void route_logits(void *ctx, int64_t i) {
    const Route *r = ctx;
    const int64_t chunks = (r->n_expert + ROUTE_CHUNK - 1) / ROUTE_CHUNK, t = i / chunks;
    const int64_t e0 = (i % chunks) * ROUTE_CHUNK, e1 = e0 + ROUTE_CHUNK < r->n_expert ? e0 + ROUTE_CHUNK : r->n_expert;
    for (int64_t e = e0; e < e1; e++) r->logits[t * r->n_expert + e] = dot_f32(r->router + e * r->d, r->x + t * r->d, r->d);
}

static void route_item(void *ctx, int64_t t) {
    const Route *r = ctx;
    const int64_t E = r->n_expert, k = r->k_used;
    float *l = r->logits + t * E, *w = r->wts + t * k;
    int64_t *id = r->idx + t * k;
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; e++)
        if (l[e] > mx) mx = l[e];
    float p[1024];  /* E ≤ 1024: checked by moe_layer */
    double sum = 0.0;
    for (int64_t e = 0; e < E; e++) sum += (double)(p[e] = expf(l[e] - mx));
    const float inv = (float)(1.0 / sum);
    for (int64_t e = 0; e < E; e++) p[e] *= inv;
    double wsum = 0.0;
    for (int64_t s = 0; s < k; s++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < s; j++) taken |= id[j] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        id[s] = best;
        w[s] = p[best];
        wsum += (double)p[best];
    }
    const float ws = (float)wsum;
    for (int64_t s = 0; s < k; s++) w[s] = w[s] / ws;
}

/* A pass's routing (route_item per token) and, with shared_inp, the shared expert's gate sigmoid(shared_inp · x_t)
 * into sgate [n]: what moe_layer computes first, and what the op-by-op form of the layer calls (ops.moe_route), so
 * both route with the same bits. Returns 0, or -3 for more than 1024 experts. */
int moe_route(const float *router, const float *shared_inp, const float *x, int64_t n, int64_t d, int64_t k_used,
              int64_t n_expert, float *logits, float *wts, int64_t *idx, float *sgate, int threads) {
    if (n_expert > 1024 || k_used > n_expert) return -3;
    Route r = {router, x, d, n_expert, k_used, logits, wts, idx};
    const int64_t chunks = (n_expert + ROUTE_CHUNK - 1) / ROUTE_CHUNK;
    pool_run(n * n_expert * d >= (1 << 16) ? threads : 1, n * chunks, route_logits, &r);
    pool_run(n > 1 ? threads : 1, n, route_item, &r);
    if (shared_inp)
        for (int64_t t = 0; t < n; t++) sgate[t] = sigmoid_f(dot_f32(shared_inp, x + t * d, d));
    return 0;
}

/* A MoE layer for the n tokens of a pass in one call: routing (router [n_expert, d] float32), the routed experts
 * (moe_routed), and the shared expert (stacks sg, su, sd with one expert each; NULL when the layer has none) weighted
 * by sigmoid(shared_inp · x) and added after the routed sum. Outputs y [n, d], and the router's logits [n, n_expert],
 * weights and ids [n, k_used] (the model's hooks and routing statistics read them). Returns as moe_routed; -3 for
 * more than 1024 experts. */
int moe_layer(const float *router, const float *shared_inp, const ExpertStack *sg, const ExpertStack *su,
              const ExpertStack *sd, const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down,
              const float *x, int64_t n, int64_t k_used, int64_t n_expert, float *logits, float *wts, int64_t *idx,
              float *y, int isa) {
    const int64_t d = down->n_rows;
    float *sw = malloc((size_t)n * sizeof(float));
    if (!sw) return -1;
    int rc = moe_route(router, shared_inp, x, n, gate->k, k_used, n_expert, logits, wts, idx, sw, gate->threads);
    if (rc == 0) rc = moe_routed(gate, up, down, x, n, idx, wts, k_used, n_expert, y, isa);
    if (rc || !sg) {
        free(sw);
        return rc;
    }
    float *ys = malloc((size_t)(n * d) * sizeof(float));
    int64_t *zero = calloc((size_t)n, sizeof(int64_t));
    rc = -1;
    if (ys && zero) {
        rc = moe_routed(sg, su, sd, x, n, zero, sw, 1, 1, ys, isa);  /* ys[t] = sw[t] · shared(x_t) */
        if (rc == 0)
            for (int64_t i = 0; i < n * d; i++) y[i] += ys[i];
    }
    free(sw), free(ys), free(zero);
    return rc;
}

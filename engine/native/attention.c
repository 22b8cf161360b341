/* Causal attention of a pass's queries over the KV cache (spec §3.5), one (query, head) at a time:
 *   s_t = (q · k_t) · scale for t ≤ pos + i;  p = softmax(s);  o = Σ_t p_t v_t
 * One call per layer and pass instead of four tensor ops per query. Each (query, head) runs the same
 * arithmetic over exactly the keys it sees, whatever the number of queries or threads (a head of a query is
 * one thread's work), so a verify pass gives the bits of one-token steps. The dot products sum in 16 lanes
 * (a fixed order the compiler may vectorise without reassociating), the weighted sum of values in key order.
 * Built for AVX512 and AVX2 besides the baseline (target_clones): the lanes' operations are the same, and the
 * build contracts no multiply-add (-ffp-contract=off), so every clone gives the same bits; the scores and the
 * weighted sum have register forms for AVX512 and AVX2 (the same operations per lane: the same bits, tested).
 */
#include <math.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdlib.h>
#include "kernels.h"

#define LANES 16

/* Σ_l of a 16-lane accumulator in lane order */
static inline float lane_sum(const float *acc) {
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t d) {
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
    for (; j < d; j++) acc[j % LANES] += a[j] * b[j];
    return lane_sum(acc);
}

#if defined(__x86_64__)
/* The scores of the `per` query heads q + g · dk against keys 0 … t_n−1 (rows `stride` floats apart) into
 * p + g · t_max: dot's exact operations per key (one 16-lane accumulator, multiply then add, lanes summed in
 * order; in AVX2 as two 8-lane halves, lanes 0-7 and 8-15), four keys at a time so that their accumulation chains
 * overlap (one key at a time, the chain's latency set the pace), and every head over the same four key rows while
 * they are in L1 (each row is read from memory once for the group). Needs dk % 16 == 0. */
#define SCORES_FORM(NAME, TARGET, VEC, PFX, W)                                                                    \
    __attribute__((target(TARGET)))                                                                               \
    static void NAME(const float *q, int64_t per, const float *k, int64_t stride, int64_t t_n, int64_t dk,        \
                     float scale, float *p, int64_t t_max) {                                                      \
        enum { H = LANES / W };                                                                                   \
        float buf[4][LANES];                                                                                      \
        int64_t t = 0;                                                                                            \
        for (; t + 4 <= t_n; t += 4) {                                                                            \
            const float *k0 = k + t * stride;                                                                     \
            for (int64_t g = 0; g < per; g++) {                                                                   \
                const float *qh = q + g * dk;                                                                     \
                VEC a[4][H];                                                                                      \
                for (int r = 0; r < 4; r++)                                                                       \
                    for (int h = 0; h < H; h++) a[r][h] = PFX##_setzero_ps();                                     \
                for (int64_t j = 0; j < dk; j += LANES)                                                           \
                    for (int h = 0; h < H; h++) {                                                                 \
                        const VEC x = PFX##_loadu_ps(qh + j + W * h);                                             \
                        for (int r = 0; r < 4; r++)                                                               \
                            a[r][h] = PFX##_add_ps(a[r][h],                                                       \
                                                   PFX##_mul_ps(x, PFX##_loadu_ps(k0 + r * stride + j + W * h))); \
                    }                                                                                             \
                for (int r = 0; r < 4; r++) {                                                                     \
                    for (int h = 0; h < H; h++) PFX##_storeu_ps(buf[r] + W * h, a[r][h]);                         \
                    p[g * t_max + t + r] = lane_sum(buf[r]) * scale;                                              \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (; t < t_n; t++)                                                                                      \
            for (int64_t g = 0; g < per; g++) p[g * t_max + t] = dot(q + g * dk, k + t * stride, dk) * scale;     \
    }
SCORES_FORM(scores_avx512, "avx512f", __m512, _mm512, 16)
SCORES_FORM(scores_avx2, "avx2", __m256, _mm256, 8)

/* o_g += Σ_t (p_g[t] / sum_g) · v_t over keys 0 … t_n−1 for the `per` heads g (probabilities p + g · t_max, outputs
 * o + g · dv): the plain loop's operations per element (the weight divided, then multiplied, then added, keys in
 * order), with 8 vectors of a head's output values (AVX512: 128, AVX2: 64) held in registers over 16 keys whose value
 * rows stay in L1 for all the heads; the plain loop loaded and stored every output value once per key. Needs dv a
 * multiple of 8 vectors. */
#define VALUES_FORM(NAME, TARGET, VEC, PFX, W)                                                                    \
    __attribute__((target(TARGET)))                                                                               \
    static void NAME(const float *p, int64_t t_max, const float *sum, int64_t per, const float *v, int64_t stride, \
                     int64_t t_n, int64_t dv, float *o) {                                                         \
        for (int64_t t0 = 0; t0 < t_n; t0 += 16) {                                                                \
            const int64_t t1 = t0 + 16 < t_n ? t0 + 16 : t_n;                                                     \
            for (int64_t g = 0; g < per; g++) {                                                                   \
                const float *pg = p + g * t_max;                                                                  \
                float *og = o + g * dv;                                                                           \
                for (int64_t jb = 0; jb < dv; jb += 8 * W) {                                                      \
                    VEC acc[8];                                                                                   \
                    for (int z = 0; z < 8; z++) acc[z] = PFX##_loadu_ps(og + jb + W * z);                        \
                    for (int64_t t = t0; t < t1; t++) {                                                           \
                        const VEC w = PFX##_set1_ps(pg[t] / sum[g]);                                              \
                        const float *vt = v + t * stride + jb;                                                    \
                        for (int z = 0; z < 8; z++)                                                               \
                            acc[z] = PFX##_add_ps(acc[z], PFX##_mul_ps(w, PFX##_loadu_ps(vt + W * z)));           \
                    }                                                                                             \
                    for (int z = 0; z < 8; z++) PFX##_storeu_ps(og + jb + W * z, acc[z]);                         \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }
VALUES_FORM(values_avx512, "avx512f", __m512, _mm512, 16)
VALUES_FORM(values_avx2, "avx2", __m256, _mm256, 8)
#endif

typedef struct {
    const float *q, *k, *v;
    float *out;
    int64_t n, pos, n_head, n_kv, dk, dv, group, per, runs;
    float scale;
    int wide, wide_v;  /* the register forms: 0 none, 1 AVX2, 2 AVX512 */
    _Atomic int failed;
} Attn;

/* Each thread's scores buffer, grown as needed and kept (the pool's threads live as long as the process). */
static __thread float *SCORES;
static __thread int64_t SCORES_CAP;

static int scores_ready(int64_t need) {
    if (SCORES_CAP >= need) return 0;
    float *p = realloc(SCORES, (size_t)need * sizeof(float));
    if (!p) return -1;
    SCORES = p;
    SCORES_CAP = need;
    return 0;
}

/* one work item: query i, KV head hk, `per` of its query heads from h0 */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void attention_item(void *ctx, int64_t item) {
    Attn *job = ctx;
    const float *q = job->q, *k = job->k, *v = job->v;
    float *out = job->out;
    const int64_t n_head = job->n_head, n_kv = job->n_kv, dk = job->dk, dv = job->dv, per = job->per;
    const int64_t t_max = job->pos + job->n, runs = job->runs;
    const float scale = job->scale;
    if (scores_ready(t_max * per)) {
        job->failed = 1;
        return;
    }
    float *p = SCORES;
    const int64_t i = item / (n_kv * runs), hk = item / runs % n_kv, h0 = hk * job->group + item % runs * per;
    const int64_t t_n = job->pos + i + 1;
    float m[per], sum[per];
    for (int64_t g = 0; g < per; g++) m[g] = -INFINITY, sum[g] = 0.f;
#if defined(__x86_64__)
    if (job->wide) {
        (job->wide == 2 ? scores_avx512 : scores_avx2)(q + (i * n_head + h0) * dk, per, k + hk * dk, n_kv * dk, t_n, dk,
                                                       scale, p, t_max);
    } else
#endif
    {
        for (int64_t t = 0; t < t_n; t++) {
            const float *kt = k + (t * n_kv + hk) * dk;
            for (int64_t g = 0; g < per; g++) p[g * t_max + t] = dot(q + (i * n_head + h0 + g) * dk, kt, dk) * scale;
        }
    }
    for (int64_t g = 0; g < per; g++) {
        float *pg = p + g * t_max;
        for (int64_t t = 0; t < t_n; t++)
            if (pg[t] > m[g]) m[g] = pg[t];
        for (int64_t t = 0; t < t_n; t++) {
            pg[t] = expf(pg[t] - m[g]);
            sum[g] += pg[t];
        }
        float *o = out + (i * n_head + h0 + g) * dv;
        for (int64_t j = 0; j < dv; j++) o[j] = 0.f;
    }
#if defined(__x86_64__)
    if (job->wide_v) {  /* the group's heads are adjacent in out */
        (job->wide_v == 2 ? values_avx512 : values_avx2)(p, t_max, sum, per, v + hk * dv, n_kv * dv, t_n, dv,
                                                         out + (i * n_head + h0) * dv);
        return;
    }
#endif
    for (int64_t t = 0; t < t_n; t++) {
        const float *vt = v + (t * n_kv + hk) * dv;
        for (int64_t g = 0; g < per; g++) {
            const float w = p[g * t_max + t] / sum[g];
            float *o = out + (i * n_head + h0 + g) * dv;
            for (int64_t j = 0; j < dv; j++) o[j] += w * vt[j];
        }
    }
}

/* q [n, n_head, dk] (query i at position pos + i), k [·, n_kv, dk] and v [·, n_kv, dv] the cache rows from 0,
 * out [n, n_head, dv]. Head h reads KV head h / (n_head / n_kv). The query heads that share a KV head are run
 * together over the keys (split into as many runs as the threads need work items), so each key and value row is
 * read once for all of them instead of once per head: at long contexts the rows come from memory, and reading
 * them once per head set the pace. Returns 0, or −1 when out of memory. */
int attention_causal(const float *q, const float *k, const float *v, float *out, int64_t n, int64_t pos, int64_t n_head,
                 int64_t n_kv, int64_t dk, int64_t dv, float scale, int n_threads, int isa) {
#if defined(__x86_64__)
    const int form = isa_runs(isa, ISA_AVX512) ? 2 : isa_runs(isa, ISA_AVX2) ? 1 : 0;
    const int wide = dk % LANES == 0 ? form : 0, wide_v = dv % (form == 2 ? 128 : 64) == 0 ? form : 0;
#else
    const int wide = 0, wide_v = 0;
    (void)isa;
#endif
    const int64_t group = n_head / n_kv;
    /* heads per work item: the whole group unless that leaves threads idle */
    int64_t per = group;
    while (per > 1 && n * n_kv * (group / per) < n_threads) per /= 2;
    while (group % per) per--;
    const int64_t runs = group / per;
    Attn job = {q, k, v, out, n, pos, n_head, n_kv, dk, dv, group, per, runs, scale, wide, wide_v, 0};
    pool_run(n_threads, n * n_kv * runs, attention_item, &job);
    return job.failed ? RC_NO_MEMORY : 0;
}

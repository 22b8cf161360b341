/* The Gated DeltaNet recurrence for the tokens of one pass (spec §3.4), one head at a time:
 *   S ← e^g S;  e = β (v − Sᵀk);  S ← S + k eᵀ;  o = Sᵀq        S: [d_k, d_v] per head
 * A head's state (64 KiB at d_k = d_v = 128) stays in cache over all the pass's tokens and is swept once per
 * token (its update and Sᵀq, then the next token's decay and Sᵀk), where five tensor ops per token read it
 * five times. Token t's arithmetic is the same whatever the number of tokens or threads (a head is one
 * thread's work), so a verify pass gives the bits of one-token steps, and re-running a pass's first j tokens
 * from its starting state gives the bits of the state it passed through after token j (engine.cache
 * StateReplay: a verify keeps its starting state instead of writing a copy of the state per position).
 *
 * The state is read from S_in and written to S_out (the same buffer for an in-place step): the first sweep
 * reads one and writes the other, so keeping the starting state costs no copy.
 */
#include <stdint.h>
#include <string.h>
#include "kernels.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif


#if defined(__x86_64__)
/* One head's tokens with its d_v = 16·NV columns of e, o and Sᵀk held in registers over the sweep (the
 * portable loop keeps them in memory and loads and stores them for every row of S). Element by element the
 * same operations in the same order as the loop in gdn_recurrence, so the same bits. */
#define SWEEP(NV, NEXT)                                                                                           \
    for (int64_t i = 0; i < dk; i++) {                                                                            \
        float *row = Sh + i * (16 * NV);                                                                          \
        const __m512 ki = _mm512_set1_ps(kt[i]), qi = _mm512_set1_ps(qt[i]);                                     \
        const __m512 kni = _mm512_set1_ps(NEXT ? kn[i] : 0.f);                                                    \
        for (int c = 0; c < NV; c++) {                                                                            \
            __m512 r = _mm512_add_ps(_mm512_loadu_ps(row + 16 * c), _mm512_mul_ps(ki, e[c]));                     \
            acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(r, qi));                                                 \
            if (NEXT) {                                                                                           \
                r = _mm512_mul_ps(r, decn);                                                                       \
                u[c] = _mm512_add_ps(u[c], _mm512_mul_ps(r, kni));                                                \
            }                                                                                                     \
            _mm512_storeu_ps(row + 16 * c, r);                                                                    \
        }                                                                                                         \
    }

#define DEFINE_HEAD(NV)                                                                                           \
__attribute__((target("avx512f")))                                                                                \
static void head_dv##NV(const float *q, const float *k, const float *v, const float *beta, const float *decay,    \
                        const float *S_in, float *Sh, float *o, int64_t n, int64_t H, int64_t Hk, int64_t h,      \
                        int64_t dk) {                                                                             \
    const int64_t dv = 16 * NV, kh = h % Hk;                                                                      \
    __m512 u[NV], e[NV], acc[NV];                                                                                 \
    for (int c = 0; c < NV; c++) u[c] = _mm512_setzero_ps();                                                      \
    const __m512 dec0 = _mm512_set1_ps(decay[h]);                                                                 \
    for (int64_t i = 0; i < dk; i++) {                                                                            \
        const __m512 ki = _mm512_set1_ps(k[kh * dk + i]);                                                         \
        for (int c = 0; c < NV; c++) {                                                                            \
            const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(S_in + i * dv + 16 * c), dec0);                        \
            _mm512_storeu_ps(Sh + i * dv + 16 * c, r);                                                            \
            u[c] = _mm512_add_ps(u[c], _mm512_mul_ps(r, ki));                                                     \
        }                                                                                                         \
    }                                                                                                             \
    for (int64_t t = 0; t < n; t++) {                                                                             \
        const int64_t th = t * H + h, tk = t * Hk + kh;                                                           \
        const float *kt = k + tk * dk, *qt = q + tk * dk, *vt = v + th * dv;                                      \
        const __m512 bt = _mm512_set1_ps(beta[th]);                                                               \
        for (int c = 0; c < NV; c++) {                                                                            \
            e[c] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(vt + 16 * c), u[c]), bt);                          \
            acc[c] = _mm512_setzero_ps();                                                                         \
        }                                                                                                         \
        if (t + 1 < n) {                                                                                          \
            const float *kn = k + (tk + Hk) * dk;                                                                 \
            const __m512 decn = _mm512_set1_ps(decay[th + H]);                                                    \
            for (int c = 0; c < NV; c++) u[c] = _mm512_setzero_ps();                                              \
            SWEEP(NV, 1)                                                                                          \
        } else {                                                                                                  \
            const float *kn = NULL;                                                                               \
            const __m512 decn = _mm512_setzero_ps();                                                              \
            (void)kn;                                                                                             \
            (void)decn;                                                                                           \
            SWEEP(NV, 0)                                                                                          \
        }                                                                                                         \
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(o + th * dv + 16 * c, acc[c]);                             \
    }                                                                                                             \
}

DEFINE_HEAD(4)
DEFINE_HEAD(8)

/* The same in AVX2, whose 16 registers do not hold a head's d_v columns three times over: the columns in chunks of
 * 32 (4 registers each of e, o and Sᵀk), each chunk through all the pass's tokens before the next — a column's
 * operations never read another column's, so element by element still the loop's, in its order. */
#define SWEEP8(NEXT)                                                                                              \
    for (int64_t i = 0; i < dk; i++) {                                                                            \
        float *row = Sh + i * dv + c0;                                                                            \
        const __m256 ki = _mm256_set1_ps(kt[i]), qi = _mm256_set1_ps(qt[i]);                                     \
        const __m256 kni = _mm256_set1_ps(NEXT ? kn[i] : 0.f);                                                    \
        for (int c = 0; c < 4; c++) {                                                                             \
            __m256 r = _mm256_add_ps(_mm256_loadu_ps(row + 8 * c), _mm256_mul_ps(ki, e[c]));                      \
            acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(r, qi));                                                 \
            if (NEXT) {                                                                                           \
                r = _mm256_mul_ps(r, decn);                                                                       \
                u[c] = _mm256_add_ps(u[c], _mm256_mul_ps(r, kni));                                                \
            }                                                                                                     \
            _mm256_storeu_ps(row + 8 * c, r);                                                                     \
        }                                                                                                         \
    }

__attribute__((target("avx2")))
static void head_avx2(const float *q, const float *k, const float *v, const float *beta, const float *decay,
                      const float *S_in, float *Sh, float *o, int64_t n, int64_t H, int64_t Hk, int64_t h, int64_t dk,
                      int64_t dv) {
    const int64_t kh = h % Hk;
    const __m256 dec0 = _mm256_set1_ps(decay[h]);
    for (int64_t c0 = 0; c0 < dv; c0 += 32) {
        __m256 u[4], e[4], acc[4];
        for (int c = 0; c < 4; c++) u[c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < dk; i++) {
            const __m256 ki = _mm256_set1_ps(k[kh * dk + i]);
            for (int c = 0; c < 4; c++) {
                const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(S_in + i * dv + c0 + 8 * c), dec0);
                _mm256_storeu_ps(Sh + i * dv + c0 + 8 * c, r);
                u[c] = _mm256_add_ps(u[c], _mm256_mul_ps(r, ki));
            }
        }
        for (int64_t t = 0; t < n; t++) {
            const int64_t th = t * H + h, tk = t * Hk + kh;
            const float *kt = k + tk * dk, *qt = q + tk * dk, *vt = v + th * dv + c0;
            const __m256 bt = _mm256_set1_ps(beta[th]);
            for (int c = 0; c < 4; c++) {
                e[c] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(vt + 8 * c), u[c]), bt);
                acc[c] = _mm256_setzero_ps();
            }
            if (t + 1 < n) {
                const float *kn = k + (tk + Hk) * dk;
                const __m256 decn = _mm256_set1_ps(decay[th + H]);
                for (int c = 0; c < 4; c++) u[c] = _mm256_setzero_ps();
                SWEEP8(1)
            } else {
                const float *kn = NULL;
                const __m256 decn = _mm256_setzero_ps();
                (void)kn;
                (void)decn;
                SWEEP8(0)
            }
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + th * dv + c0 + 8 * c, acc[c]);
        }
    }
}
#endif

typedef struct {
    const float *q, *k, *v, *beta, *decay, *S_in;
    float *S_out, *o;
    int64_t n, H, Hk, dk, dv;
    int avx512, avx2;
} Gdn;

/* one value head's tokens: a pool item */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void gdn_head(void *ctx, int64_t h) {
    const Gdn *job = ctx;
    const float *q = job->q, *k = job->k, *v = job->v, *beta = job->beta, *decay = job->decay;
    float *o = job->o;
    const int64_t n = job->n, H = job->H, Hk = job->Hk, dk = job->dk, dv = job->dv;
    const int avx512 = job->avx512, avx2 = job->avx2;
    const float *Sin = job->S_in + h * dk * dv;
    float *Sh = job->S_out + h * dk * dv;
#if defined(__x86_64__)
    if (avx512 && (dv == 64 || dv == 128)) {
        (dv == 128 ? head_dv8 : head_dv4)(q, k, v, beta, decay, Sin, Sh, o, n, H, Hk, h, dk);
        return;
    }
    if (avx2 && dv % 32 == 0) {
        head_avx2(q, k, v, beta, decay, Sin, Sh, o, n, H, Hk, h, dk, dv);
        return;
    }
#endif
    (void)avx512, (void)avx2;
    const int64_t kh = h % Hk;
    float u[MAX_DV], e[MAX_DV];
    /* token 0's decay and Sᵀk; later tokens' are done in the previous token's update sweep */
    for (int64_t j = 0; j < dv; j++) u[j] = 0.f;
    for (int64_t i = 0; i < dk; i++) {
        const float *in = Sin + i * dv;
        float *row = Sh + i * dv;
        const float ki = k[kh * dk + i], dec = decay[h];
        for (int64_t j = 0; j < dv; j++) {
            row[j] = in[j] * dec;
            u[j] += row[j] * ki;
        }
    }
    for (int64_t t = 0; t < n; t++) {
        const int64_t th = t * H + h, tk = t * Hk + kh;
        const float *kt = k + tk * dk, *qt = q + tk * dk, *vt = v + th * dv, bt = beta[th];
        float *ot = o + th * dv;
        for (int64_t j = 0; j < dv; j++) {
            e[j] = (vt[j] - u[j]) * bt;
            ot[j] = 0.f;
        }
        const int next = t + 1 < n;
        const float *kn = next ? k + (tk + Hk) * dk : NULL;
        const float decn = next ? decay[th + H] : 0.f;
        if (next)
            for (int64_t j = 0; j < dv; j++) u[j] = 0.f;
        /* one sweep: token t's update and output, then token t+1's decay and Sᵀk — element by element the
         * same operations as separate sweeps (built without FP contraction) */
        for (int64_t i = 0; i < dk; i++) {
            float *row = Sh + i * dv;
            const float ki = kt[i], qi = qt[i];
            for (int64_t j = 0; j < dv; j++) {
                row[j] += ki * e[j];
                ot[j] += row[j] * qi;
            }
            if (next) {
                const float kni = kn[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] *= decn;
                    u[j] += row[j] * kni;
                }
            }
        }
    }
}

/* q, k [n, Hk, dk] (value head h reads key head h mod Hk: GGUF's tiled order); v [n, H, dv]; beta, decay
 * [n, H]; S_in, S_out [H, dk, dv] (may be the same buffer); o [n, H, dv]. isa: the AVX512 register form from
 * ISA_AVX512, the AVX2 one from ISA_AVX2, else the loop above even where a register form could run (tests compare
 * them). Heads are the threads' items.
 * Returns 0, or RC_MAX_DV if dv > MAX_DV. */
int gdn_recurrence(const float *q, const float *k, const float *v, const float *beta, const float *decay,
                     const float *S_in, float *S_out, float *o, int64_t n, int64_t H, int64_t Hk, int64_t dk,
                     int64_t dv, int n_threads, int isa) {
    if (dv > MAX_DV) return RC_MAX_DV;
    Gdn j = {q, k, v, beta, decay, S_in, S_out, o, n, H, Hk, dk, dv, isa_runs(isa, ISA_AVX512),
             isa_runs(isa, ISA_AVX2)};
    pool_run(n_threads, H, gdn_head, &j);
    return 0;
}

/* ---- the recurrence's inputs -------------------------------------------------------------------------------- */

/* From a pass's projections to the recurrence's inputs, per token t (spec §3.4):
 *   u = silu(Σ_j window[t + j] ⊙ taps[j])    the causal conv over the last K inputs (window [K−1+n, C]: the conv
 *                                           state, then the pass's rows; taps [K, C]), summed tap 0 first;
 *   q = u[0 : H_k·d_k] per key head / max(‖·‖, eps) · q_scale;  k likewise (no scale);  (v: u's last H·d_v)
 *   β = sigmoid(b);  g = A · softplus(a + dt_bias)   (softplus(x) = x above 20, as torch's).
 * u [n, C], q and k [n, H_k, d_k], beta and g [n, H]. Element by element what the torch twin computes op by op
 * (engine.ops.delta_rule.gdn_inputs), in one pass over the rows instead of about twenty tensor ops. */
ELEMENTWISE void gdn_inputs(const float *window, const float *taps, int64_t n, int64_t c, int64_t kk, const float *b,
                const float *a, const float *A, const float *dt_bias, int64_t h, int64_t hk, int64_t dk, float eps,
                float q_scale, float *u, float *q, float *k, float *beta, float *g) {
    for (int64_t t = 0; t < n; t++) {
        float *ut = u + t * c;
        for (int64_t i = 0; i < c; i++) ut[i] = window[t * c + i] * taps[i];
        for (int64_t j = 1; j < kk; j++) {
            const float *w = window + (t + j) * c, *tj = taps + j * c;
            for (int64_t i = 0; i < c; i++) ut[i] = ut[i] + w[i] * tj[i];
        }
        for (int64_t i = 0; i < c; i++) ut[i] = silu_f(ut[i]);
        norm_rows(ut, hk, dk, NULL, NULL, eps, 1, q_scale, q + t * hk * dk);  /* ops.l2_norm's bits */
        norm_rows(ut + hk * dk, hk, dk, NULL, NULL, eps, 1, 1.f, k + t * hk * dk);
        for (int64_t i = 0; i < h; i++) {
            beta[t * h + i] = sigmoid_f(b[t * h + i]);
            const float x = a[t * h + i] + dt_bias[i];
            g[t * h + i] = A[i] * (x > 20.f ? x : log1pf(expf(x)));
        }
    }
}

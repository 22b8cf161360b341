/* The Gated DeltaNet recurrence for the tokens of one pass (spec §3.4), one head at a time:
 *   S ← e^g S;  e = β (v − Sᵀk);  S ← S + k eᵀ;  o = Sᵀq        S: [d_k, d_v] per head
 * A head's state (64 KiB at d_k = d_v = 128) stays in cache over all the pass's tokens and is swept once per
 * token (its update and Sᵀq, then the next token's decay and Sᵀk), where five tensor ops per token read it
 * five times. Token t's arithmetic is the same whatever the number of tokens or threads (a head is one
 * thread's work), so a verify pass gives the bits of one-token steps.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_DV 1024

int kq_isa(void);

#if defined(__x86_64__)
/* Captured states are written once and read at most once (at the commit): streaming stores skip reading
 * the destination into cache first, half the memory traffic of a plain copy. dst 64-byte aligned. */
__attribute__((target("avx512f")))
static void stream_copy(float *dst, const float *src, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
    for (; j < n; j++) dst[j] = src[j];
}
#endif

static void copy_state(float *dst, const float *src, int64_t n, int streaming) {
#if defined(__x86_64__)
    if (streaming && ((uintptr_t)dst & 63) == 0) {
        stream_copy(dst, src, n);
        return;
    }
#endif
    (void)streaming;
    memcpy(dst, src, (size_t)n * sizeof(float));
}

/* q, k [n, H, dk]; v [n, H, dv]; beta, decay [n, H]; S [H, dk, dv] (in/out); o [n, H, dv];
 * states [n − 1, H, dk, dv] (the state after every token but the last, which S itself holds) or NULL.
 * Returns 0, or -1 if dv > MAX_DV. */
__attribute__((target_clones("avx512f", "avx2", "default")))
int kq_gdn_recurrent(const float *q, const float *k, const float *v, const float *beta, const float *decay, float *S,
                     float *o, float *states, int64_t n, int64_t H, int64_t dk, int64_t dv, int n_threads) {
    if (dv > MAX_DV) return -1;
    const int streaming = kq_isa() == 1;
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (int64_t h = 0; h < H; h++) {
        float u[MAX_DV], e[MAX_DV];
        float *Sh = S + h * dk * dv;
        /* token 0's decay and Sᵀk; later tokens' are done in the previous token's update sweep */
        for (int64_t j = 0; j < dv; j++) u[j] = 0.f;
        for (int64_t i = 0; i < dk; i++) {
            float *row = Sh + i * dv;
            const float ki = k[h * dk + i], dec = decay[h];
            for (int64_t j = 0; j < dv; j++) {
                row[j] *= dec;
                u[j] += row[j] * ki;
            }
        }
        for (int64_t t = 0; t < n; t++) {
            const int64_t th = t * H + h;
            const float *kt = k + th * dk, *qt = q + th * dk, *vt = v + th * dv, bt = beta[th];
            float *ot = o + th * dv;
            for (int64_t j = 0; j < dv; j++) {
                e[j] = (vt[j] - u[j]) * bt;
                ot[j] = 0.f;
            }
            const int next = t + 1 < n;
            const float *kn = next ? k + (th + H) * dk : NULL;
            const float decn = next ? decay[th + H] : 0.f;
            if (next)
                for (int64_t j = 0; j < dv; j++) u[j] = 0.f;
            float *dst = states && next ? states + th * dk * dv : NULL;
            /* one sweep: token t's update and output, its captured state, then token t+1's decay and Sᵀk —
             * element by element the same operations as separate sweeps (built without FP contraction) */
            for (int64_t i = 0; i < dk; i++) {
                float *row = Sh + i * dv;
                const float ki = kt[i], qi = qt[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] += ki * e[j];
                    ot[j] += row[j] * qi;
                }
                if (dst) copy_state(dst + i * dv, row, dv, streaming);
                if (next) {
                    const float kni = kn[i];
                    for (int64_t j = 0; j < dv; j++) {
                        row[j] *= decn;
                        u[j] += row[j] * kni;
                    }
                }
            }
        }
#if defined(__x86_64__)
        _mm_sfence();  /* this thread's streamed states are visible before the region ends */
#endif
    }
    return 0;
}

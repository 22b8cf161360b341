/* The Gated DeltaNet recurrence for the tokens of one pass (spec §3.4), one head at a time:
 *   S ← e^g S;  e = β (v − Sᵀk);  S ← S + k eᵀ;  o = Sᵀq        S: [d_k, d_v] per head
 * A head's state (64 KiB at d_k = d_v = 128) stays in cache over all the pass's tokens, and each token
 * reads and writes it twice (decay with Sᵀk; the update with Sᵀq), where five tensor ops per token read it
 * five times. Token t's arithmetic is the same whatever the number of tokens or threads (a head is one
 * thread's work), so a verify pass gives the bits of one-token steps.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define MAX_DV 1024

/* q, k [n, H, dk]; v [n, H, dv]; beta, decay [n, H]; S [H, dk, dv] (in/out); o [n, H, dv];
 * states [n, H, dk, dv] (the state after every token) or NULL. Returns 0, or -1 if dv > MAX_DV. */
__attribute__((target_clones("avx512f", "avx2", "default")))
int kq_gdn_recurrent(const float *q, const float *k, const float *v, const float *beta, const float *decay, float *S,
                     float *o, float *states, int64_t n, int64_t H, int64_t dk, int64_t dv, int n_threads) {
    if (dv > MAX_DV) return -1;
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (int64_t h = 0; h < H; h++) {
        float u[MAX_DV], e[MAX_DV];
        float *Sh = S + h * dk * dv;
        for (int64_t t = 0; t < n; t++) {
            const int64_t th = t * H + h;
            const float *kt = k + th * dk, *qt = q + th * dk, *vt = v + th * dv;
            const float dec = decay[th], bt = beta[th];
            for (int64_t j = 0; j < dv; j++) u[j] = 0.f;
            for (int64_t i = 0; i < dk; i++) {
                float *row = Sh + i * dv;
                const float ki = kt[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] *= dec;
                    u[j] += row[j] * ki;
                }
            }
            for (int64_t j = 0; j < dv; j++) e[j] = (vt[j] - u[j]) * bt;
            float *ot = o + th * dv;
            for (int64_t j = 0; j < dv; j++) ot[j] = 0.f;
            float *dst = states ? states + th * dk * dv : NULL;
            for (int64_t i = 0; i < dk; i++) {
                float *row = Sh + i * dv;
                const float ki = kt[i], qi = qt[i];
                for (int64_t j = 0; j < dv; j++) {
                    row[j] += ki * e[j];
                    ot[j] += row[j] * qi;
                }
                if (dst) memcpy(dst + i * dv, row, dv * sizeof(float));
            }
        }
    }
    return 0;
}

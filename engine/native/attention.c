/* Causal attention of a pass's queries over the KV cache (spec §3.5), one (query, head) at a time:
 *   s_t = (q · k_t) · scale for t ≤ pos + i;  p = softmax(s);  o = Σ_t p_t v_t
 * One call per layer and pass instead of four tensor ops per query. Each (query, head) runs the same
 * arithmetic over exactly the keys it sees, whatever the number of queries or threads (a head of a query is
 * one thread's work), so a verify pass gives the bits of one-token steps. The dot products sum in 16 lanes
 * (a fixed order the compiler may vectorise without reassociating), the weighted sum of values in key order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#define LANES 16

static float dot(const float *a, const float *b, int64_t d) {
    float acc[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
    for (; j < d; j++) acc[j % LANES] += a[j] * b[j];
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

/* q [n, n_head, dk] (query i at position pos + i), k [·, n_kv, dk] and v [·, n_kv, dv] the cache rows from 0,
 * out [n, n_head, dv]. Head h reads KV head h / (n_head / n_kv). Returns 0, or −1 when out of memory. */
int kq_attention(const float *q, const float *k, const float *v, float *out, int64_t n, int64_t pos, int64_t n_head,
                 int64_t n_kv, int64_t dk, int64_t dv, float scale, int n_threads) {
    const int64_t group = n_head / n_kv, t_max = pos + n;
    int failed = 0;
    #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        float *p = malloc((size_t)t_max * sizeof(float));
        if (!p) {
            #pragma omp atomic write
            failed = 1;
        } else {
            #pragma omp for schedule(static)
            for (int64_t item = 0; item < n * n_head; item++) {
                const int64_t i = item / n_head, h = item % n_head, hk = h / group, t_n = pos + i + 1;
                const float *qi = q + (i * n_head + h) * dk;
                float m = -INFINITY;
                for (int64_t t = 0; t < t_n; t++) {
                    p[t] = dot(qi, k + (t * n_kv + hk) * dk, dk) * scale;
                    if (p[t] > m) m = p[t];
                }
                float sum = 0.f;
                for (int64_t t = 0; t < t_n; t++) {
                    p[t] = expf(p[t] - m);
                    sum += p[t];
                }
                float *o = out + (i * n_head + h) * dv;
                for (int64_t j = 0; j < dv; j++) o[j] = 0.f;
                for (int64_t t = 0; t < t_n; t++) {
                    const float w = p[t] / sum, *vt = v + (t * n_kv + hk) * dv;
                    for (int64_t j = 0; j < dv; j++) o[j] += w * vt[j];
                }
            }
            free(p);
        }
    }
    return failed ? -1 : 0;
}

/* Row norms as ggml computes them (and RoPE, the other per-row transform of a query or key): the sum of squares accumulated in double, the row's scale in float, then
 * y = x · scale, times the weight, times an optional per-element factor (a gate already through its activation),
 * times an optional constant.
 *
 * RMS: scale = 1 / sqrt(Σx²/d + eps) (ggml_rms_norm); L2: scale = 1 / max(sqrt(Σx²), eps) (ggml_l2_norm).
 *
 * Bits: four double partial sums in a fixed order (lane i % 4, then (0+1)+(2+3)), written as plain C so every
 * instruction set the compiler picks computes the same numbers; each row is a function of itself alone, so a
 * pass over N rows gives each row the bits of a one-row pass. One thread: a step's norms are a few thousand
 * values, less than a pool call costs.
 */
#include "kernels.h"

static double sum_squares(const float *x, int64_t d) {
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    for (; i + 4 <= d; i += 4)
        for (int l = 0; l < 4; l++) acc[l] += (double)(x[i + l] * x[i + l]);
    for (; i < d; i++) acc[i % 4] += (double)(x[i] * x[i]);
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

/* x, y [n, d] (y may be x); w [d] or NULL; gate [n, d] or NULL; l2: the L2 form instead of RMS (kernels.h). */
void norm_rows(const float *x, int64_t n, int64_t d, const float *w, const float *gate, float eps, int l2,
               float post, float *y) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        const double s = sum_squares(xr, d);
        const float scale = l2 ? 1.0f / fmaxf(sqrtf((float)s), eps) : 1.0f / sqrtf((float)(s / (double)d) + eps);
        for (int64_t i = 0; i < d; i++) yr[i] = xr[i] * scale;
        if (w)
            for (int64_t i = 0; i < d; i++) yr[i] *= w[i];
        if (gate)
            for (int64_t i = 0; i < d; i++) yr[i] *= gate[r * d + i];
        if (post != 1.0f)
            for (int64_t i = 0; i < d; i++) yr[i] *= post;
    }
}

/* RoPE, NEOX pairing, in place: x [n, h, d]; for token t and pair i < n_rot/2 of every head,
 * (x_i, x_{i+n_rot/2}) ← (x_i·c − x_j·s, x_i·s + x_j·c) with c, s = cos[t, i], sin[t, i] ([n, n_rot/2]); dims from n_rot
 * on are left as they are. The same multiplies and adds as the torch twin (engine.models.qwen35.apply_rope). */
void rope_neox(float *x, int64_t n, int64_t h, int64_t d, int64_t n_rot, const float *cos_t, const float *sin_t) {
    const int64_t half = n_rot / 2;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t hh = 0; hh < h; hh++) {
            float *xr = x + (t * h + hh) * d;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = xr[i], x2 = xr[i + half];
                xr[i] = x1 * c[i] - x2 * s[i];
                xr[i + half] = x1 * s[i] + x2 * c[i];
            }
        }
    }
}

/* F16 and BF16 weights, multiplied as llama.cpp's CPU backend multiplies them: the activations rounded to the
 * weight's format (F16 or BF16, made by the caller: act_quant.c round_half or torch), both widened to float and
 * multiplied and added in float.
 *
 * Bits: per output, 32 float lanes (4 vectors of 8, as ggml's F16 loop keeps 4 sums of 8): lane l takes elements
 * 32c + l of every chunk c in order by one fused multiply-add each; at the end of the row the four vectors are added
 * pairwise ((0 + 1) + (2 + 3)) and the 8 lanes summed across in hsum8's order. The portable form does the same
 * steps with fmaf: the AVX2 and portable forms give the same bits, batch- and thread-invariant. Rows must be a
 * multiple of 32 values (native.product_cols).
 */
#include "kernels.h"

static float half_to_f32(int bf16, uint16_t h) {
    if (bf16) {
        const uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    uint8_t b[2] = {(uint8_t)(h & 0xFF), (uint8_t)(h >> 8)};
    return fp16_to_f32(b);
}

static void rows_times_portable(int bf16, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                                const Acts *a, const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    const int64_t k = a->k;
    const uint16_t *xh = (const uint16_t *)a->q;
    float wf[32], acc[32];
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = (const uint16_t *)(w + r * row_bytes);
        for (int64_t i = 0; i < m; i++) {
            const uint16_t *x = xh + (xrow ? xrow[i] : i) * k;
            for (int l = 0; l < 32; l++) acc[l] = 0.f;
            for (int64_t c = 0; c < k; c += 32) {
                for (int l = 0; l < 32; l++) wf[l] = half_to_f32(bf16, row[c + l]);
                for (int l = 0; l < 32; l++) acc[l] = fmaf(wf[l], half_to_f32(bf16, x[c + l]), acc[l]);
            }
            float lanes[8];
            for (int l = 0; l < 8; l++) lanes[l] = (acc[l] + acc[8 + l]) + (acc[16 + l] + acc[24 + l]);
            out[i * ldo + r] = lanes_sum(lanes);
        }
    }
}

#if defined(__x86_64__)
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256 widen(const int bf16, const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

/* Each weight row's chunk of 32 widened once per tile of activation rows and multiplied by every row of it */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void rows_times_fmt(const int bf16, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                                  const Acts *a, const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    const int64_t k = a->k;
    const uint16_t *xh = (const uint16_t *)a->q, *x[M_TILE];
    __m256 acc[M_TILE][4];
    for (int64_t t0 = 0; t0 < m; t0 += M_TILE) {
        const int64_t tn = m - t0 < M_TILE ? m - t0 : M_TILE;
        for (int64_t i = 0; i < tn; i++) x[i] = xh + (xrow ? xrow[t0 + i] : t0 + i) * k;
        for (int64_t r = r0; r < r1; r++) {
            const uint16_t *row = (const uint16_t *)(w + r * row_bytes);
            for (int64_t i = 0; i < tn; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < k; c += 32) {
                __m256 wv[4];
                for (int j = 0; j < 4; j++) wv[j] = widen(bf16, row + c + 8 * j);
                for (int64_t i = 0; i < tn; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], widen(bf16, x[i] + c + 8 * j), acc[i][j]);
            }
            for (int64_t i = 0; i < tn; i++)
                out[(t0 + i) * ldo + r] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                                                              _mm256_add_ps(acc[i][2], acc[i][3])));
        }
    }
}

__attribute__((target(AVX2_TARGET)))
static void rows_times_avx2(int bf16, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                            const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    if (bf16) rows_times_fmt(1, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
    else rows_times_fmt(0, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
}
#endif

void rows_times_half(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                     const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa) {
    const int bf16 = qtype == T_BF16;
#if defined(__x86_64__)
    if (isa_runs(isa, ISA_AVX2)) {
        rows_times_avx2(bf16, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
        return;
    }
#endif
    rows_times_portable(bf16, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
}

/* x [n] float32 rounded to F16 (bf16 = 0) or BF16, to nearest even, as ggml's GGML_FP32_TO_FP16 / _BF16 and torch
 * round them (BF16 NaNs made quiet) */
void round_half(const float *x, int64_t n, int bf16, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        if (!bf16) {
            const _Float16 h = (_Float16)x[i];
            memcpy(out + i, &h, 2);
            continue;
        }
        uint32_t u;
        memcpy(&u, x + i, 4);
        out[i] = (u & 0x7fffffff) > 0x7f800000 ? (uint16_t)((u >> 16) | 64) : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
}

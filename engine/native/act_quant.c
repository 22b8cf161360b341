/* Activations quantized as llama.cpp's CPU backend quantizes them before an integer product: Q8_K (blocks of 256,
 * for K- and IQ-quant weights; AVX512 and AVX2 forms, chosen by the backend's level) and Q8_0 (blocks of 32; an
 * AVX512 form wherever the CPU has VNNI), each form giving the portable loop's quants and scales; and the Q8_K quants
 * in the order Q4_K blocks hold their values. */
#include "kernels.h"

/* ---- activations -------------------------------------------------------------------------------- */

/* ggml quantize_row_q8_K: per block of 256, scale from the signed extreme (first of equal magnitudes),
 * q = round-half-even(−127/max · x) capped at 127, d = 1/iscale, and the sums of q per 16. */
static void quantize_q8k_block(const float *xb, int8_t *qb, float *d, int16_t *bsums) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < QK_K; j++) {
        float ax = fabsf(xb[j]);
        if (ax > amax) { amax = ax; max = xb[j]; }
    }
    if (amax == 0.f) {
        *d = 0.f;
        memset(qb, 0, QK_K);
        memset(bsums, 0, 16 * sizeof(int16_t));
        return;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < QK_K; j++) {
        long v = lrintf(iscale * xb[j]);
        qb[j] = (int8_t)(v > 127 ? 127 : v);
    }
    *d = 1.f / iscale;
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += qb[g * 16 + j];
        bsums[g] = (int16_t)s;
    }
}

#if defined(__x86_64__)
/* The same block with AVX512: the same products and round-half-even conversions (the default rounding mode,
 * as lrintf's), so the same quants; NaNs are skipped by the maximum as by the scalar loop. */
__attribute__((target("avx512f,avx512bw")))
static void quantize_q8k_block_avx512(const float *xb, int8_t *qb, float *d, int16_t *bsums) {
    __m512 m = _mm512_setzero_ps();
    for (int g = 0; g < 16; g++) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + 16 * g)), m);
    const float amax = _mm512_reduce_max_ps(m);
    if (amax == 0.f) {
        quantize_q8k_block(xb, qb, d, bsums);
        return;
    }
    int first = 0;
    for (int g = 0; g < 16; g++) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xb + 16 * g)), _mm512_set1_ps(amax),
                                                _CMP_EQ_OQ);
        if (eq) {
            first = 16 * g + __builtin_ctz(eq);
            break;
        }
    }
    const float iscale = -127.f / xb[first];
    *d = 1.f / iscale;
    const __m512 vs = _mm512_set1_ps(iscale);
    for (int g = 0; g < 16; g++) {
        const __m512i v = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * g), vs)),
                                           _mm512_set1_epi32(127));
        const __m128i q8 = _mm512_cvtepi32_epi8(v);  /* a NaN's INT_MIN truncates to 0, as the scalar cast */
        _mm_storeu_si128((__m128i *)(qb + 16 * g), q8);
        bsums[g] = (int16_t)_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q8));
    }
}
#endif

#if defined(__x86_64__)
/* The same block with AVX2: max(|x|, m) keeps m where x is a NaN, as the scalar loop passes NaNs over; the quants are
 * the low bytes of the conversions (a NaN's INT_MIN gives 0, as the scalar cast), and each 16's sum is of those. */
__attribute__((target(AVX2_TARGET)))
static void quantize_q8k_block_avx2(const float *xb, int8_t *qb, float *d, int16_t *bsums) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int g = 0; g < 32; g++) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * g)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    if (amax == 0.f) {
        quantize_q8k_block(xb, qb, d, bsums);
        return;
    }
    int first = 0;
    for (int g = 0; g < 32; g++) {
        const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * g)),
                                                        _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (eq) {
            first = 8 * g + __builtin_ctz((unsigned)eq);
            break;
        }
    }
    const float iscale = -127.f / xb[first];
    *d = 1.f / iscale;
    const __m256 vs = _mm256_set1_ps(iscale);
    /* byte 0 of each int32 lane, to the low 4 bytes of each 128-bit half */
    const __m256i low = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    for (int g = 0; g < 16; g++) {
        int8_t *o = qb + 16 * g;
        for (int h2 = 0; h2 < 2; h2++) {
            const __m256i v = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * g + 8 * h2), vs)),
                                               _mm256_set1_epi32(127));
            const __m256i b = _mm256_shuffle_epi8(v, low);
            const int32_t lo = _mm_cvtsi128_si32(_mm256_castsi256_si128(b)),
                          hi = _mm_cvtsi128_si32(_mm256_extracti128_si256(b, 1));
            memcpy(o + 8 * h2, &lo, 4);
            memcpy(o + 8 * h2 + 4, &hi, 4);
        }
        const __m128i s = _mm_madd_epi16(_mm_add_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)o)),
                                                       _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(o + 8)))),
                                         _mm_set1_epi16(1));
        const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        bsums[g] = (int16_t)_mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
    }
}
#endif

void quantize_q8_k(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, int16_t *bsums, int isa) {
    const int64_t nb = k / QK_K;
#if defined(__x86_64__)
    if (isa_runs(isa, ISA_AVX512)) {
        for (int64_t i = 0; i < m_rows * nb; i++)
            quantize_q8k_block_avx512(x + i * QK_K, q + i * QK_K, d + i, bsums + i * 16);
        return;
    }
    if (isa_runs(isa, ISA_AVX2)) {
        for (int64_t i = 0; i < m_rows * nb; i++)
            quantize_q8k_block_avx2(x + i * QK_K, q + i * QK_K, d + i, bsums + i * 16);
        return;
    }
#endif
    for (int64_t i = 0; i < m_rows * nb; i++) quantize_q8k_block(x + i * QK_K, q + i * QK_K, d + i, bsums + i * 16);
}

/* The quants of rows [m, k] in the order Q4_K's nibbles come in: per 128 values, 32-value sub-blocks
 * (0, 2, 1, 3) — the low nibbles of two 32-byte chunks, then their high nibbles. */
void q8_k_to_q4_k_order(const int8_t *q, int64_t m, int64_t k, int8_t *out) {
    for (int64_t h = 0; h < m * k / 128; h++) {
        const int8_t *s = q + h * 128;
        int8_t *o = out + h * 128;
        memcpy(o, s, 32);
        memcpy(o + 32, s + 64, 32);
        memcpy(o + 64, s + 32, 32);
        memcpy(o + 96, s + 96, 32);
    }
}

/* ggml quantize_row_q8_0: per block of 32, d = amax/127, q = round-half-even(x / d) (x · 1/d, 0 where d = 0),
 * and the scale stored as f16: d is returned rounded to f16 (as a float), which is what the products use. */
#if defined(__x86_64__)
static void quantize_q8_0_vnni(const float *x, int64_t n_blocks, int8_t *q, float *d);
static void quantize_q8_0_avx2(const float *x, int64_t n_blocks, int8_t *q, float *d);
#endif

void quantize_q8_0(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, int isa) {
#if defined(__x86_64__)
    if (isa_runs(isa, ISA_AVX512) && (cpu_features() & CPU_VNNI)) {
        quantize_q8_0_vnni(x, m_rows * (k / QK8_0), q, d);
        return;
    }
    if (isa_runs(isa, ISA_AVX2)) {
        quantize_q8_0_avx2(x, m_rows * (k / QK8_0), q, d);
        return;
    }
#endif
    for (int64_t i = 0; i < m_rows * (k / QK8_0); i++) {
        const float *xb = x + i * QK8_0;
        float amax = 0.f;
        for (int j = 0; j < QK8_0; j++) {
            const float a = fabsf(xb[j]);
            if (a > amax) amax = a;
        }
        const float dd = amax / 127.0f, id = dd != 0.f ? 1.0f / dd : 0.f;
        for (int j = 0; j < QK8_0; j++) q[i * QK8_0 + j] = (int8_t)nearbyintf(xb[j] * id);
        d[i] = (float)(_Float16)dd;
    }
}

/* ggml quantize_row_q8_1: Q8_0's quants and f16-rounded scales, and per block s = fp16(d · Σq) with d = amax/127
 * before its rounding (what Q4_1 / Q5_1 products add m_w · s of), returned as a float. */
void quantize_q8_1(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, float *s, int isa) {
    quantize_q8_0(x, m_rows, k, q, d, isa);
    for (int64_t i = 0; i < m_rows * (k / QK8_0); i++) {
        float amax = 0.f;
        int32_t sum = 0;
        for (int j = 0; j < QK8_0; j++) {
            const float a = fabsf(x[i * QK8_0 + j]);
            if (a > amax) amax = a;
            sum += q[i * QK8_0 + j];
        }
        s[i] = (float)(_Float16)((float)sum * (amax / 127.0f));
    }
}

#if defined(__x86_64__)
#define Q8_0_QUANT_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"

/* The quantizer's SIMD twin: the same values (max of |x|, d = amax/127, x · 1/d rounded half to even by the
 * conversion, the scale rounded to f16). */
__attribute__((target(Q8_0_QUANT_TARGET)))
static void quantize_q8_0_vnni(const float *x, int64_t n_blocks, int8_t *q, float *d) {
    for (int64_t i = 0; i < n_blocks; i++) {
        const __m512 a = _mm512_loadu_ps(x + i * QK8_0), b = _mm512_loadu_ps(x + i * QK8_0 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float dd = amax / 127.0f, id = dd != 0.f ? 1.0f / dd : 0.f;
        const __m512 v = _mm512_set1_ps(id);
        _mm_storeu_si128((__m128i *)(q + i * QK8_0), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, v))));
        _mm_storeu_si128((__m128i *)(q + i * QK8_0 + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, v))));
        d[i] = _cvtsh_ss(_cvtss_sh(dd, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

/* The same in AVX2: the maximum of |x| over the block's four 8-lane vectors, the same scale and conversions; the
 * int32 quants packed to bytes with saturation, as the VNNI form's cvtsepi32. */
__attribute__((target(AVX2_TARGET)))
static void quantize_q8_0_avx2(const float *x, int64_t n_blocks, int8_t *q, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  /* packs interleave the 128-bit halves */
    for (int64_t i = 0; i < n_blocks; i++) {
        const float *xb = x + i * QK8_0;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(xb + 8 * j), m = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), m);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        const float dd = amax / 127.0f, id = dd != 0.f ? 1.0f / dd : 0.f;
        const __m256 vs = _mm256_set1_ps(id);
        __m256i w[4];
        for (int j = 0; j < 4; j++) w[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vs));
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
        _mm256_storeu_si256((__m256i *)(q + i * QK8_0), _mm256_permutevar8x32_epi32(b, order));
        d[i] = _cvtsh_ss(_cvtss_sh(dd, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}
#endif

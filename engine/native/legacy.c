/* The 32-value block types besides Q8_0 (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4), multiplied the way llama.cpp's
 * CPU backend multiplies them: against Q8_0 activations (Q8_1 for Q4_1 and Q5_1: Q8_0's quants and scales, and
 * s = fp16(d·Σq) per block for the weights' minimum), per block an exact integer dot product of the values and the
 * quants, scaled by d_w·d_x in float; Q4_1/Q5_1 add m_w·s_x per block into a separate float sum, added at the end.
 *
 * Values per block: Q4_0 nibble − 8, Q5_0 (nibble | high bit << 4) − 16, Q4_1 / Q5_1 the same without the offset
 * (d·v + m), IQ4_NL the non-linear table kvalues_iq4nl[nibble] (scale f16 d), MXFP4 the e2m1 values doubled
 * (kvalues_mxfp4) with the E8M0 scale halved (ggml_e8m0_to_fp32_half): value j is nibble j of byte j (low
 * nibbles: values 0-15, high nibbles: 16-31).
 *
 * Bits: int32 lane l of a block's product is the exact sum of values 4l … 4l+3 times their quants; each lane is
 * scaled into its own float sum by one fused multiply-add per block, and the 8 lanes are summed across at the end
 * of the weight row (hsum8's order). The portable form does the same lane sums with fmaf, so the AVX2 and portable
 * forms give the same bits; both are batch- and thread-invariant (nothing depends on the other rows).
 */
#include "kernels.h"

static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static int block_bytes(int qtype) {
    switch (qtype) {
    case T_Q4_0: case T_IQ4_NL: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    default: return 17;  /* MXFP4 */
    }
}

/* 2^(e − 127) / 2 as ggml_e8m0_to_fp32_half makes it (e < 2: a subnormal) */
static float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float scale_of(int qtype, const uint8_t *blk) {
    return qtype == T_MXFP4 ? e8m0_half(blk[0]) : fp16_to_f32(blk);
}

/* A block's 32 integer values in order, and its minimum (Q4_1, Q5_1; else 0) */
static float decode(int qtype, const uint8_t *blk, int8_t *v) {
    const int has_min = qtype == T_Q4_1 || qtype == T_Q5_1, five = qtype == T_Q5_0 || qtype == T_Q5_1;
    const uint8_t *qs = blk + (qtype == T_MXFP4 ? 1 : 2) + 2 * has_min + 4 * five;
    uint32_t qh = 0;
    if (five) memcpy(&qh, blk + 2 + 2 * has_min, 4);
    for (int j = 0; j < 32; j++) {
        const int nib = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
        switch (qtype) {
        case T_Q4_0: v[j] = (int8_t)(nib - 8); break;
        case T_Q4_1: v[j] = (int8_t)nib; break;
        case T_Q5_0: v[j] = (int8_t)((nib | (((qh >> j) & 1) << 4)) - 16); break;
        case T_Q5_1: v[j] = (int8_t)(nib | (((qh >> j) & 1) << 4)); break;
        case T_IQ4_NL: v[j] = KVALUES_IQ4NL[nib]; break;
        default: v[j] = KVALUES_MXFP4[nib]; break;
        }
    }
    return has_min ? fp16_to_f32(blk + 2) : 0.f;
}

/* One row of k values of a legacy type as float32, v·d (+ m for Q4_1 / Q5_1): the bits of
 * engine/storage/qtensor.py's dequantization (a token-embedding row, kquant.c dequant_rows). Returns 0, or -1 for a
 * type this file does not hold. */
int legacy_row(int qtype, const uint8_t *row, int64_t k, float *out) {
    if (qtype != T_Q4_0 && qtype != T_Q4_1 && qtype != T_Q5_0 && qtype != T_Q5_1 && qtype != T_IQ4_NL &&
        qtype != T_MXFP4)
        return -1;
    const int bytes = block_bytes(qtype), has_min = qtype == T_Q4_1 || qtype == T_Q5_1;
    int8_t v[32];
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *blk = row + b * bytes;
        const float m = decode(qtype, blk, v), d = scale_of(qtype, blk);
        float *o = out + b * 32;
        for (int j = 0; j < 32; j++) o[j] = has_min ? (float)v[j] * d + m : (float)v[j] * d;
    }
    return 0;
}

static void rows_times_portable(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                                const Acts *a, const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    const int has_min = qtype == T_Q4_1 || qtype == T_Q5_1;
    const int64_t k = a->k, nb = k / QK8_0, bytes = block_bytes(qtype);
    int8_t v[32];
    float acc[M_TILE][8], accm[M_TILE];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t t0 = 0; t0 < m; t0 += M_TILE) {
            const int64_t tn = m - t0 < M_TILE ? m - t0 : M_TILE;
            memset(acc, 0, sizeof acc);
            memset(accm, 0, sizeof accm);
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * bytes;
                const float mw = decode(qtype, blk, v), dw = scale_of(qtype, blk);
                for (int64_t i = 0; i < tn; i++) {
                    const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
                    const int8_t *x = a->q + xr * k + b * QK8_0;
                    const float f = dw * a->d[xr * nb + b];
                    for (int l = 0; l < 8; l++) {
                        int32_t p = 0;
                        for (int j = 4 * l; j < 4 * l + 4; j++) p += (int32_t)v[j] * x[j];
                        acc[i][l] = fmaf((float)p, f, acc[i][l]);
                    }
                    if (has_min) accm[i] += mw * a->s[xr * nb + b];
                }
            }
            for (int64_t i = 0; i < tn; i++) out[(t0 + i) * ldo + r] = lanes_sum(acc[i]) + accm[i];
        }
    }
}

#if defined(__x86_64__)
/* 32 nibbles of 16 bytes in value order: low nibbles (values 0-15), then high ones */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i nibbles(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

/* 0x10 in byte j where bit j of the 32 bits at p is set */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i high_bits(const uint8_t *p) {
    uint32_t h;
    memcpy(&h, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), _mm256_setr_epi64x(
        0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));  /* byte j/8 into byte j */
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* A block's 32 values (signed, or unsigned for Q4_1 / Q5_1), its scale and minimum */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i decode_avx2(const int qtype, const uint8_t *blk, __m256i table, float *dw, float *mw) {
    *dw = qtype == T_MXFP4 ? e8m0_half(blk[0]) : fp16_f16c(blk);
    *mw = qtype == T_Q4_1 || qtype == T_Q5_1 ? fp16_f16c(blk + 2) : 0.f;
    switch (qtype) {
    case T_Q4_0: return _mm256_sub_epi8(nibbles(blk + 2), _mm256_set1_epi8(8));
    case T_Q4_1: return nibbles(blk + 4);
    case T_Q5_0: return _mm256_sub_epi8(_mm256_or_si256(nibbles(blk + 6), high_bits(blk + 2)), _mm256_set1_epi8(16));
    case T_Q5_1: return _mm256_or_si256(nibbles(blk + 8), high_bits(blk + 4));
    case T_IQ4_NL: return _mm256_shuffle_epi8(table, nibbles(blk + 2));
    default: return _mm256_shuffle_epi8(table, nibbles(blk + 1));
    }
}

/* The 8 exact int32 lane sums of a block's values times 32 quants (signed values: maddubs of |v| and x·sign(v)) */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i block_dot(const int has_min, __m256i v, __m256i x) {
    const __m256i u = has_min ? v : _mm256_abs_epi8(v), xs = has_min ? x : _mm256_sign_epi8(x, v);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs), _mm256_set1_epi16(1));
}

/* On starting the `bytes` at row, the bytes `dist` further on, which
 * run from the item's rows (up to end) into the next item's */
static inline void prefetch_at(const char *row, int64_t bytes, int64_t dist, const char *end, const Ahead *next) {
    for (int64_t off = 0; off < bytes; off += 64) {
        const char *t = row + dist + off;
        if (t < end) __builtin_prefetch(t, 0, 3);
        else if (next && next->p + (t - end) < next->end) __builtin_prefetch(next->p + (t - end), 0, 3);
    }
}

/* The product of one type, inlined per type. A tile of activation rows: weight row by weight row, each block decoded
 * once and multiplied by every row of the tile. One activation row (a decode step): four weight rows at a time, each
 * output's sums in registers. Both take the same steps per output: one fused multiply-add of its lanes per block
 * (and m_w·s_x into its own float sum), then hsum8 plus that sum. */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void rows_times_type(const int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                                   const Acts *a, const int64_t *xrow, int64_t m, float *out, int64_t ldo,
                                   const Ahead *next) {
    const char *end = (const char *)w + r1 * row_bytes;  /* prefetched 8 rows ahead, into the next item's rows */
    const int has_min = qtype == T_Q4_1 || qtype == T_Q5_1;
    const int64_t k = a->k, nb = k / QK8_0, bytes = block_bytes(qtype);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
        (const __m128i *)(qtype == T_MXFP4 ? KVALUES_MXFP4 : KVALUES_IQ4NL)));
    float dw, mw;
    if (m == 1) {
        const int64_t xr = xrow ? xrow[0] : 0;
        const int8_t *xq = a->q + xr * k;
        const float *xd = a->d + xr * nb, *xs = has_min ? a->s + xr * nb : NULL;
        for (int64_t r = r0; r < r1; r += 4) {
            const int nr = r1 - r < 4 ? (int)(r1 - r) : 4;
            prefetch_at((const char *)w + r * row_bytes, 4 * row_bytes, 8 * row_bytes, end, next);
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            float accm[4] = {0.f, 0.f, 0.f, 0.f};
            for (int64_t b = 0; b < nb; b++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QK8_0));
                for (int j = 0; j < 4; j++) {
                    const uint8_t *blk = w + (r + (j < nr ? j : 0)) * row_bytes + b * bytes;  /* a leftover row reuses row r */
                    const __m256i v = decode_avx2(qtype, blk, table, &dw, &mw);
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(has_min, v, x)), _mm256_set1_ps(dw * xd[b]), acc[j]);
                    if (has_min) accm[j] += mw * xs[b];
                }
            }
            for (int j = 0; j < nr; j++) out[r + j] = hsum8(acc[j]) + accm[j];
        }
        return;
    }
    const int8_t *xq[M_TILE];
    const float *xd[M_TILE], *xs[M_TILE];
    __m256 acc[M_TILE];
    float accm[M_TILE];
    for (int64_t t0 = 0; t0 < m; t0 += M_TILE) {
        const int64_t tn = m - t0 < M_TILE ? m - t0 : M_TILE;
        for (int64_t i = 0; i < tn; i++) {
            const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
            xq[i] = a->q + xr * k;
            xd[i] = a->d + xr * nb;
            xs[i] = has_min ? a->s + xr * nb : NULL;
        }
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = w + r * row_bytes;
            prefetch_at((const char *)row, row_bytes, 8 * row_bytes, end, next);
            for (int64_t i = 0; i < tn; i++) acc[i] = _mm256_setzero_ps(), accm[i] = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const __m256i v = decode_avx2(qtype, row + b * bytes, table, &dw, &mw);
                for (int64_t i = 0; i < tn; i++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq[i] + b * QK8_0));
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(has_min, v, x)), _mm256_set1_ps(dw * xd[i][b]), acc[i]);
                    if (has_min) accm[i] += mw * xs[i][b];
                }
            }
            for (int64_t i = 0; i < tn; i++) out[(t0 + i) * ldo + r] = hsum8(acc[i]) + accm[i];
        }
    }
}

__attribute__((target(AVX2_TARGET), optimize("no-tree-loop-distribute-patterns")))
static void rows_times_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                            const int64_t *xrow, int64_t m, float *out, int64_t ldo, const Ahead *next) {
    switch (qtype) {  /* one copy of the loop per type, its decoding inlined */
    case T_Q4_0: rows_times_type(T_Q4_0, w, row_bytes, r0, r1, a, xrow, m, out, ldo, next); break;
    case T_Q4_1: rows_times_type(T_Q4_1, w, row_bytes, r0, r1, a, xrow, m, out, ldo, next); break;
    case T_Q5_0: rows_times_type(T_Q5_0, w, row_bytes, r0, r1, a, xrow, m, out, ldo, next); break;
    case T_Q5_1: rows_times_type(T_Q5_1, w, row_bytes, r0, r1, a, xrow, m, out, ldo, next); break;
    case T_IQ4_NL: rows_times_type(T_IQ4_NL, w, row_bytes, r0, r1, a, xrow, m, out, ldo, next); break;
    default: rows_times_type(T_MXFP4, w, row_bytes, r0, r1, a, xrow, m, out, ldo, next); break;
    }
}
#endif

void rows_times_legacy(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                       const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa, const Ahead *next) {
#if defined(__x86_64__)
    if (isa_runs(isa, ISA_AVX2)) {
        rows_times_avx2(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo, next);
        return;
    }
#endif
    rows_times_portable(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
}

/* Products of the grid-codebook IQ types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) with Q8_K
 * activation rows, the way llama.cpp's CPU backend computes them: ggml-cpu's generic vec_dot_iq*_q8_K, bit for bit.
 *
 * A block of 256 weights stores, per 8 (IQ3: 4) values, an index into a grid of magnitudes and a sign pattern
 * (IQ1: a grid of −1/0/1 and a delta ±1/8 shared by 8 or 32 values), an odd integer scale per 16 or 32 values and
 * one fp16 scale. Per block and activation row: the exact integer Σ scale · (grid·sign · quant); IQ1 also the
 * exact Σ scale · delta_sign · quant. Then ggml's float step, per block in block order:
 *   IQ2/IQ3:  acc += (d_w·d_x) · Σ, and the row's result acc · 1/8 (IQ2), · 1/4 (IQ3_XXS), · 1 (IQ3_S);
 *   IQ1:      acc += (d_w·d_x) · (Σ + IQ1_DELTA · Σ_delta).
 *
 * Bits: the integer sums are exact in every form; the float step is scalar and the same in every form, so the AVX2
 * form and the portable form give the same bits, and an output does not depend on the number of activation rows,
 * their grouping or the thread split. The tables are generated from the gguf package (iq_tables.h).
 */
#include "kernels.h"
#include "iq_tables.h"

static int64_t block_bytes(int qtype) {
    switch (qtype) {
    case T_IQ2_XXS: return 66;
    case T_IQ2_XS: return 74;
    case T_IQ2_S: return 82;
    case T_IQ3_XXS: return 98;
    case T_IQ3_S: return 110;
    case T_IQ1_S: return 50;
    case T_IQ1_M: return 56;
    default: return 0;
    }
}

int iq_grid_type(int qtype) { return block_bytes(qtype) != 0; }

static int is_iq1(int qtype) { return qtype == T_IQ1_S || qtype == T_IQ1_M; }

/* the float factor ggml applies to a row's sum of blocks (exact: powers of two) */
static float row_factor(int qtype) {
    return qtype == T_IQ2_XXS || qtype == T_IQ2_XS || qtype == T_IQ2_S ? 0.125f : qtype == T_IQ3_XXS ? 0.25f : 1.f;
}

static inline uint32_t u16_at(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float half_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* IQ1_M keeps its fp16 scale in the top nibbles of its four 16-bit scale words */
static inline uint16_t iq1m_scale_bits(const uint8_t *blk) {
    const uint8_t *sc = blk + 48;
    return (uint16_t)((u16_at(sc) >> 12) | ((u16_at(sc + 2) >> 8) & 0x00f0) | ((u16_at(sc + 4) >> 4) & 0x0f00) |
                      (u16_at(sc + 6) & 0xf000));
}

/* ---- a block, 32 values at a time ------------------------------------------------------------------ */

/* 32 values of a block as 4 groups of 8: the grid rows (magnitudes; IQ1: −1/0/1), the sign bytes (SIGN_BYTES: 0x01
 * or 0xFF per value; IQ1: its delta's sign per value) and the integer scales of the first and last 16 values. Both
 * forms read blocks through this one decoder, so they multiply the same integers. Inlined with a constant qtype,
 * the fields stay in registers. */
typedef struct {
    uint64_t grid[4], sign[4];
    int32_t ls[2];
} Group32;

static inline __attribute__((always_inline)) void group32(int qtype, const uint8_t *b, int ib, Group32 *o) {
    switch (qtype) {
    case T_IQ2_XXS: {  /* per 32: 4 grid bytes, then 4 × 7-bit sign indices and a 4-bit scale */
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t aux = u32_at(q + 4);
        o->ls[0] = o->ls[1] = (int32_t)(2 * (aux >> 28) + 1);
        for (int l = 0; l < 4; l++) {
            o->grid[l] = IQ2XXS_GRID[q[l]];
            o->sign[l] = KSIGNS_BYTES[(aux >> (7 * l)) & 127];
        }
        break;
    }
    case T_IQ2_XS: {  /* per 8: a 9-bit grid index and a 7-bit sign index; a 4-bit scale per 16 */
        const uint8_t sc = b[66 + ib];
        o->ls[0] = 2 * (sc & 15) + 1;
        o->ls[1] = 2 * (sc >> 4) + 1;
        for (int l = 0; l < 4; l++) {
            const uint32_t q = u16_at(b + 2 + 2 * (4 * ib + l));
            o->grid[l] = IQ2XS_GRID[q & 511];
            o->sign[l] = KSIGNS_BYTES[q >> 9];
        }
        break;
    }
    case T_IQ2_S: {  /* grid index low bytes, sign bytes, 2 high index bits per 8, a 4-bit scale per 16 */
        const uint32_t sc = b[74 + ib], qh = b[66 + ib];
        o->ls[0] = (int32_t)(2 * (sc & 15) + 1);
        o->ls[1] = (int32_t)(2 * (sc >> 4) + 1);
        for (int l = 0; l < 4; l++) {
            o->grid[l] = IQ2S_GRID[b[2 + 4 * ib + l] | ((qh << (8 - 2 * l)) & 0x300)];
            o->sign[l] = SIGN_BYTES[b[34 + 4 * ib + l]];
        }
        break;
    }
    case T_IQ3_XXS: {  /* per 4 values a grid byte; per 32: 4 × 7-bit sign indices and a 4-bit scale */
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t aux = u32_at(b + 66 + 4 * ib);
        o->ls[0] = o->ls[1] = (int32_t)(2 * (aux >> 28) + 1);
        for (int l = 0; l < 4; l++) {
            o->grid[l] = IQ3XXS_GRID[q[2 * l]] | ((uint64_t)IQ3XXS_GRID[q[2 * l + 1]] << 32);
            o->sign[l] = KSIGNS_BYTES[(aux >> (7 * l)) & 127];
        }
        break;
    }
    case T_IQ3_S: {  /* per 4 values a grid byte and a 9th index bit; sign bytes; a 4-bit scale per 32 */
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t qh = b[66 + ib];
        o->ls[0] = o->ls[1] = 2 * ((b[106 + ib / 2] >> (4 * (ib & 1))) & 15) + 1;
        for (int l = 0; l < 4; l++) {
            const uint32_t lo = IQ3S_GRID[q[2 * l] | ((qh << (8 - 2 * l)) & 256)];
            const uint32_t hi = IQ3S_GRID[q[2 * l + 1] | ((qh << (7 - 2 * l)) & 256)];
            o->grid[l] = lo | ((uint64_t)hi << 32);
            o->sign[l] = SIGN_BYTES[b[74 + 4 * ib + l]];
        }
        break;
    }
    case T_IQ1_S: {  /* per 8 an 11-bit grid index; per 32 a 3-bit scale and the delta's sign */
        const uint32_t h = u16_at(b + 34 + 2 * ib);
        o->ls[0] = o->ls[1] = (int32_t)(2 * ((h >> 12) & 7) + 1);
        for (int l = 0; l < 4; l++) {
            o->grid[l] = IQ1S_GRID[b[2 + 4 * ib + l] | (((h >> (3 * l)) & 7) << 8)];
            o->sign[l] = SIGN_BYTES[h & 0x8000 ? 0xFF : 0];
        }
        break;
    }
    default: {  /* T_IQ1_M: per 8 an 11-bit grid index and the delta's sign; a 3-bit scale per 16 */
        const uint32_t sc = u16_at(b + 48 + 2 * (ib / 2)) >> (6 * (ib % 2));
        o->ls[0] = (int32_t)(2 * (sc & 7) + 1);
        o->ls[1] = (int32_t)(2 * ((sc >> 3) & 7) + 1);
        for (int l = 0; l < 4; l++) {
            const uint32_t qh = b[32 + 2 * ib + l / 2] >> (4 * (l % 2));
            o->grid[l] = IQ1S_GRID[b[4 * ib + l] | ((qh & 7) << 8)];
            o->sign[l] = SIGN_BYTES[qh & 8 ? 0xFF : 0];
        }
    }
    }
}

/* the block's fp16 scale (IQ1_M: spread over the top nibbles of its four 16-bit scale words) */
static inline float block_d(int qtype, const uint8_t *b) {
    if (qtype != T_IQ1_M) return half_at(b);
    const uint16_t bits = iq1m_scale_bits(b);
    return half_at((const uint8_t *)&bits);
}

/* ---- portable form ------------------------------------------------------------------------------ */

/* A decoded block as bytes: IQ2/IQ3 the signed weights (grid · sign); IQ1 the grid values and the deltas' signs */
typedef struct {
    int8_t v[QK_K], dv[QK_K];
    int32_t ls[16];
    float d;
} Values;

/* (the tables hold value j of a grid row in byte j of a little-endian word, as GGUF files are little-endian) */
static inline __attribute__((always_inline)) void values_of(int qtype, const uint8_t *b, Values *o) {
    for (int ib = 0; ib < 8; ib++) {
        Group32 g;
        group32(qtype, b, ib, &g);
        memcpy(o->v + 32 * ib, g.grid, 32);
        memcpy(o->dv + 32 * ib, g.sign, 32);
        o->ls[2 * ib] = g.ls[0];
        o->ls[2 * ib + 1] = g.ls[1];
    }
    if (!is_iq1(qtype))
        for (int j = 0; j < QK_K; j++) o->v[j] = (int8_t)(o->v[j] * o->dv[j]);
    o->d = block_d(qtype, b);
}

static inline int32_t scaled_dot(const int8_t *v, const int32_t *ls, const int8_t *x) {
    int32_t s = 0;
    for (int g = 0; g < 16; g++) {
        int32_t p = 0;
        for (int j = 0; j < 16; j++) p += (int32_t)v[16 * g + j] * x[16 * g + j];
        s += ls[g] * p;
    }
    return s;
}

/* ggml's float step of one block for one activation row (see the top of the file) */
static inline float block_term(int iq1, float dw, float dx, int32_t s, int32_t s_delta) {
    return iq1 ? dw * dx * ((float)s + IQ1_DELTA * (float)s_delta) : dw * dx * (float)s;
}

/* One type's rows (inlined per type, qtype a constant): each weight block decoded once per tile of activation rows
 * and multiplied by every row of it. */
static inline __attribute__((always_inline)) void rows_portable(const int qtype, const uint8_t *w, int64_t row_bytes,
                                                                int64_t r0, int64_t r1, const Acts *a,
                                                                const int64_t *xrow, int64_t m, float *out,
                                                                int64_t ldo) {
    const int64_t nb = a->k / QK_K, bb = block_bytes(qtype);
    const int iq1 = is_iq1(qtype);
    const float factor = row_factor(qtype);
    Values blk;
    float acc[M_TILE];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t t0 = 0; t0 < m; t0 += M_TILE) {
            const int64_t tn = m - t0 < M_TILE ? m - t0 : M_TILE;
            for (int64_t i = 0; i < tn; i++) acc[i] = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                values_of(qtype, row + b * bb, &blk);
                for (int64_t i = 0; i < tn; i++) {
                    const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
                    const int8_t *x = a->q + xr * a->k + b * QK_K;
                    const int32_t s = scaled_dot(blk.v, blk.ls, x), sd = iq1 ? scaled_dot(blk.dv, blk.ls, x) : 0;
                    acc[i] += block_term(iq1, blk.d, a->d[xr * nb + b], s, sd);
                }
            }
            for (int64_t i = 0; i < tn; i++) out[(t0 + i) * ldo + r] = acc[i] * factor;
        }
    }
}

static void rows_times_portable(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                                const Acts *a, const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    switch (qtype) {
    case T_IQ2_XXS: rows_portable(T_IQ2_XXS, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ2_XS: rows_portable(T_IQ2_XS, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ2_S: rows_portable(T_IQ2_S, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ3_XXS: rows_portable(T_IQ3_XXS, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ3_S: rows_portable(T_IQ3_S, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ1_S: rows_portable(T_IQ1_S, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    default: rows_portable(T_IQ1_M, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
    }
}

/* ---- AVX2 form ---------------------------------------------------------------------------------- */

#if defined(__x86_64__)
/* 32 values as vectors: grid bytes, sign bytes, and the 16-bit scales of each pair of values (the low 128 bits
 * hold the first 16 values of the 32, the high the last 16) */
typedef struct {
    __m256i g, s, l;
} Vec32;

__attribute__((target(AVX2_TARGET), always_inline))
static inline Vec32 vec32(int qtype, const uint8_t *b, int ib) {
    Group32 o;
    group32(qtype, b, ib, &o);
    return (Vec32){_mm256_set_epi64x((long long)o.grid[3], (long long)o.grid[2], (long long)o.grid[1],
                                     (long long)o.grid[0]),
                   _mm256_set_epi64x((long long)o.sign[3], (long long)o.sign[2], (long long)o.sign[1],
                                     (long long)o.sign[0]),
                   _mm256_set_m128i(_mm_set1_epi16((short)o.ls[1]), _mm_set1_epi16((short)o.ls[0]))};
}

__attribute__((target(AVX2_TARGET), always_inline))
static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* IQ2/IQ3: scale · grid · (quant with the weight's sign), summed in int32 lanes: maddubs of the unsigned grid bytes
 * and the signed quants (pair sums ≤ 2·62·127, no saturation), madd by the scales. IQ1: the grid's −1/0/1 and the
 * deltas' ±1 applied to the quants with sign_epi8, the bytes summed in pairs (maddubs by ones), madd by the
 * scales, into p and pd. */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void dot32(int iq1, const Vec32 *v, const int8_t *x, __m256i *p, __m256i *pd) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)x);
    if (iq1) {
        const __m256i ones = _mm256_set1_epi8(1);
        *p = _mm256_add_epi32(*p, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, _mm256_sign_epi8(q, v->g)), v->l));
        *pd = _mm256_add_epi32(*pd, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, _mm256_sign_epi8(q, v->s)), v->l));
    } else {
        *p = _mm256_add_epi32(*p, _mm256_madd_epi16(_mm256_maddubs_epi16(v->g, _mm256_sign_epi8(q, v->s)), v->l));
    }
}

/* One type's rows (inlined per type, qtype a constant). A one-row pass (a decode step) multiplies each 32 values as
 * it decodes them, in registers; more rows decode the block once into 8 Vec32 and multiply every row by them. */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void rows_avx2(const int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                             const Acts *a, const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    const int64_t nb = a->k / QK_K, bb = block_bytes(qtype);
    const int iq1 = is_iq1(qtype);
    const float factor = row_factor(qtype);
    float acc[M_TILE];
    const int8_t *xq[M_TILE];
    const float *xd[M_TILE];
    Vec32 v[8];
    for (int64_t t0 = 0; t0 < m; t0 += M_TILE) {
        const int64_t tn = m - t0 < M_TILE ? m - t0 : M_TILE;
        for (int64_t i = 0; i < tn; i++) {
            const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
            xq[i] = a->q + xr * a->k;
            xd[i] = a->d + xr * nb;
        }
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = w + r * row_bytes;
            for (int64_t i = 0; i < tn; i++) acc[i] = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * bb;
                const float d = block_d(qtype, blk);
                if (tn == 1) {
                    __m256i p = _mm256_setzero_si256(), pd = _mm256_setzero_si256();
                    for (int ib = 0; ib < 8; ib++) {
                        const Vec32 g = vec32(qtype, blk, ib);
                        dot32(iq1, &g, xq[0] + b * QK_K + 32 * ib, &p, &pd);
                    }
                    acc[0] += block_term(iq1, d, xd[0][b], hsum_i32(p), iq1 ? hsum_i32(pd) : 0);
                    continue;
                }
                for (int ib = 0; ib < 8; ib++) v[ib] = vec32(qtype, blk, ib);
                for (int64_t i = 0; i < tn; i++) {
                    __m256i p = _mm256_setzero_si256(), pd = _mm256_setzero_si256();
                    for (int ib = 0; ib < 8; ib++) dot32(iq1, &v[ib], xq[i] + b * QK_K + 32 * ib, &p, &pd);
                    acc[i] += block_term(iq1, d, xd[i][b], hsum_i32(p), iq1 ? hsum_i32(pd) : 0);
                }
            }
            for (int64_t i = 0; i < tn; i++) out[(t0 + i) * ldo + r] = acc[i] * factor;
        }
    }
}

__attribute__((target(AVX2_TARGET)))
static void rows_times_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                            const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    switch (qtype) {
    case T_IQ2_XXS: rows_avx2(T_IQ2_XXS, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ2_XS: rows_avx2(T_IQ2_XS, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ2_S: rows_avx2(T_IQ2_S, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ3_XXS: rows_avx2(T_IQ3_XXS, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ3_S: rows_avx2(T_IQ3_S, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    case T_IQ1_S: rows_avx2(T_IQ1_S, w, row_bytes, r0, r1, a, xrow, m, out, ldo); break;
    default: rows_avx2(T_IQ1_M, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
    }
}
#endif

/* Weight rows [r0, r1) (stored blocks, rows row_bytes apart) times the Q8_K activation rows xrow[0..m) (0..m when
 * xrow is NULL) into out[i * ldo + r]. */
void rows_times_iq(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                   const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa) {
#if defined(__x86_64__)
    if (isa_runs(isa, ISA_AVX2)) {
        rows_times_avx2(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
        return;
    }
#endif
    rows_times_portable(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
}

/* Q5_K, Q3_K, Q2_K and IQ4_XS blocks for the K-quant products (kquant.c runs them with Q4_K and Q6_K), the way
 * llama.cpp's CPU backend multiplies them: against Q8_K activations, an exact integer sum per block of
 * scale · value · quant over the sub-blocks, then per block in float p · d·d_x (Q5_K, Q2_K: less the mins' integer
 * term Σ min·bsum · dmin·d_x, as Q4_K).
 *
 * Each type has a portable unpacking into kquant.c's Block (unsigned values; a signed type stores v + offset and
 * takes offset · Σ scale·bsum off the integer sum: Q3_K's q + 4, IQ4_XS's table value + 128), an AVX2 form that
 * decodes a block into eight 32-value vectors and their 16-bit scales once, then multiplies every activation row of
 * the tile by it, and an AVX512 form that does the same with four 64-value vectors in the values' natural order (a
 * vector joins two 32-byte halves, so the activations need no reordering, unlike Q4_K's AVX512 form). maddubs takes unsigned values × signed quants into pairs of at most 2·31·127 (IQ4_XS: |value| ×
 * quant·sign(value), at most 2·127·127), so nothing saturates; madd by the scales gives exact int32 lanes.
 *
 * Bits: the integer sums are exact in every form; the float steps per block are the same as Q4_K's (AVX2: fused
 * multiply-adds into 8 lanes, AVX512 into 16, summed across at the end of the weight row; portable: one float per
 * output), so each form is batch-invariant and they differ by float rounding only.
 */
#include "kernels.h"

static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ---- portable unpacking ------------------------------------------------------------------------- */

/* d, dmin, 12 scale bytes (as Q4_K), qh[32], qs[128]: value 64c + l = nibble c of qs[32c + l's half] | bit 2c (or
 * 2c + 1 for the high nibbles) of qh[l] as bit 4. */
void unpack_q5_k(const uint8_t *b, Block *o) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    o->d = fp16_to_f32(b);
    o->dmin = fp16_to_f32(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k4_scale_min(b + 4, j, &sc, &mn);
        for (int l = 0; l < 8; l++) o->lane[j * 8 + l] = sc;
        o->corr[2 * j] = o->corr[2 * j + 1] = mn;
    }
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            o->v[64 * c + l] = (uint8_t)((qs[32 * c + l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4));
            o->v[64 * c + 32 + l] = (uint8_t)((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
        }
    }
}

/* Q3_K's 16 signed 6-bit scales (stored + 32) from their 12 bytes: low nibbles in bytes 0-7, high pairs in 8-11 */
void q3_k_scales(const uint8_t *b, int8_t sc[16]) {
    uint32_t a[4];
    memcpy(a, b + 96, 12);
    const uint32_t t = a[2];
    a[2] = ((a[0] >> 4) & 0x0f0f0f0f) | (((t >> 4) & 0x03030303) << 4);
    a[3] = ((a[1] >> 4) & 0x0f0f0f0f) | (((t >> 6) & 0x03030303) << 4);
    a[0] = (a[0] & 0x0f0f0f0f) | ((t & 0x03030303) << 4);
    a[1] = (a[1] & 0x0f0f0f0f) | (((t >> 2) & 0x03030303) << 4);
    uint8_t u[16];
    memcpy(u, a, 16);
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)(u[j] - 32);
}

/* hmask[32], qs[64], scales[12], d: value 128n + 32j + l = bits 2j of qs[32n + l], plus 4 where bit 4n + j of
 * hmask[l] is set, less 4: stored here as q + 4 (0 … 7) */
void unpack_q3_k(const uint8_t *b, Block *o) {
    int8_t sc[16];
    q3_k_scales(b, sc);
    o->d = fp16_to_f32(b + 108);
    o->dmin = 0.f;
    for (int j = 0; j < 16; j++) {
        for (int l = 0; l < 4; l++) o->lane[j * 4 + l] = sc[j];
        o->corr[j] = 4 * sc[j];
    }
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                o->v[128 * n + 32 * j + l] = (uint8_t)(((b[32 + 32 * n + l] >> (2 * j)) & 3) |
                                                       (((b[l] >> (4 * n + j)) & 1) << 2));
}

/* scales[16] (scale | min << 4 per 16 values), qs[64], d, dmin: value 128n + 32j + l = bits 2j of qs[32n + l] */
void unpack_q2_k(const uint8_t *b, Block *o) {
    o->d = fp16_to_f32(b + 80);
    o->dmin = fp16_to_f32(b + 82);
    for (int j = 0; j < 16; j++) {
        for (int l = 0; l < 4; l++) o->lane[j * 4 + l] = b[j] & 0xF;
        o->corr[j] = b[j] >> 4;
    }
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) o->v[128 * n + 32 * j + l] = (b[16 + 32 * n + l] >> (2 * j)) & 3;
}

/* The 6-bit scale (stored + 32) of IQ4_XS sub-block ib: 4 low bits in scales_l, 2 high ones in scales_h */
__attribute__((always_inline)) static inline int iq4_xs_scale(const uint8_t *b, int ib) {
    const int h = b[2] | (b[3] << 8);
    return (((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((h >> (2 * ib)) & 3) << 4)) - 32;
}

/* d, scales_h, scales_l[4], qs[128]: sub-block ib's values j, j + 16 = table[low, high nibble of qs[16 ib + j]],
 * stored here as table value + 128 (1 … 241) */
void unpack_iq4_xs(const uint8_t *b, Block *o) {
    o->d = fp16_to_f32(b);
    o->dmin = 0.f;
    for (int ib = 0; ib < 8; ib++) {
        const int ls = iq4_xs_scale(b, ib);
        for (int l = 0; l < 8; l++) o->lane[ib * 8 + l] = ls;
        o->corr[2 * ib] = o->corr[2 * ib + 1] = 128 * ls;
        for (int j = 0; j < 16; j++) {
            const uint8_t q = b[8 + 16 * ib + j];
            o->v[32 * ib + j] = (uint8_t)(KVALUES_IQ4NL[q & 0xF] + 128);
            o->v[32 * ib + 16 + j] = (uint8_t)(KVALUES_IQ4NL[q >> 4] + 128);
        }
    }
}

/* ---- AVX2 --------------------------------------------------------------------------------------- */
#if defined(__x86_64__)

/* q3_k_scales in registers, as 16-bit lanes: low nibbles of bytes 0-7 (scales 0-7) then their high nibbles (8-15),
 * with bits 2·(j/4), 2·(j/4) + 1 of byte 8 + j%4 as bits 4-5, less 32 */
__attribute__((target("avx2"), always_inline))
static inline __m256i q3_k_scales16(const uint8_t *blk) {
    uint32_t u[3];
    memcpy(u, blk + 96, 12);
    const __m128i x = _mm_setr_epi32((int)u[0], (int)u[1], 0, 0);
    const __m128i lo = _mm_and_si128(_mm_unpacklo_epi64(x, _mm_srli_epi16(x, 4)), _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)u[2]), _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(3));
    return _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32)));
}

/* The 16-bit scales for blocks of 16 sub-blocks of 16 values: vector 4n + t (values 128n + 32t …) holds sub-blocks
 * 8n + 2t (low 128 bits) and 8n + 2t + 1 (high); sc16 holds the 16 scales. */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void scales_per16(__m256i sc16, __m256i *s) {
    for (int n = 0; n < 2; n++) {
        const __m256i half = _mm256_permute2x128_si256(sc16, sc16, n ? 0x11 : 0x00);
        for (int t = 0; t < 4; t++)
            s[4 * n + t] = _mm256_shuffle_epi8(half, _mm256_set_m128i(
                _mm_set1_epi16((short)(0x0100 * (4 * t + 3) + 4 * t + 2)), _mm_set1_epi16((short)(0x0100 * (4 * t + 1) + 4 * t))));
    }
}

/* A block decoded for the products: values (IQ4_XS: |value|, with the signed values in sg), the scale vectors, and
 * the weights of the 16 activation sums (mins for Q5_K / Q2_K, the scales for Q3_K's offset), d and dmin */
typedef struct {
    __m256i v[8], s[8], sg[8], w16;
    float d, dmin;
} KDec;

__attribute__((target(AVX2_TARGET), always_inline))
static inline void decode_block(const int qtype, const uint8_t *blk, KDec *o) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    if (qtype == T_Q5_K) {  /* d, dmin, Q4_K's scales, qh[32] (bit 2c / 2c + 1: the fifth bit), qs[128] */
        o->d = fp16_f16c(blk), o->dmin = fp16_f16c(blk + 2);
        const __m128i sm = q4_k_scales(blk);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        o->w16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));  /* mn0 mn0 mn1 mn1 …: one per bsum */
        __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * c));
            o->v[2 * c] = _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
            o->v[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
            h = _mm256_srli_epi16(h, 2);
        }
        for (int j = 0; j < 8; j++) o->s[j] = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
    } else if (qtype == T_Q3_K) {  /* hmask[32], qs[64], 12 scale bytes, d: values stored q + 4 */
        o->d = fp16_f16c(blk + 108);
        o->w16 = q3_k_scales16(blk);
        __m256i h = _mm256_loadu_si256((const __m256i *)blk);
        for (int n = 0; n < 2; n++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * n));
            for (int j = 0; j < 4; j++) {
                o->v[4 * n + j] = _mm256_or_si256(_mm256_and_si256(q, m3), _mm256_slli_epi16(_mm256_and_si256(h, one), 2));
                q = _mm256_srli_epi16(q, 2);
                h = _mm256_srli_epi16(h, 1);
            }
        }
        scales_per16(o->w16, o->s);
    } else if (qtype == T_Q2_K) {  /* scales[16] (scale | min << 4), qs[64], d, dmin */
        o->d = fp16_f16c(blk + 80), o->dmin = fp16_f16c(blk + 82);
        const __m128i sm = _mm_loadu_si128((const __m128i *)blk), lo4 = _mm_set1_epi8(0x0F);
        o->w16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), lo4));
        for (int n = 0; n < 2; n++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * n));
            for (int j = 0; j < 4; j++) {
                o->v[4 * n + j] = _mm256_and_si256(q, m3);
                q = _mm256_srli_epi16(q, 2);
            }
        }
        scales_per16(_mm256_cvtepu8_epi16(_mm_and_si128(sm, lo4)), o->s);
    } else {  /* IQ4_XS: d, scales_h, scales_l[4], qs[128]; 32 bytes hold sub-blocks 2c (bytes 0-15) and 2c + 1 */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL));
        o->d = fp16_f16c(blk);
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 8 + 32 * c));
            const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            o->sg[2 * c] = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x20));
            o->sg[2 * c + 1] = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x31));
        }
        for (int j = 0; j < 8; j++) {
            o->v[j] = _mm256_abs_epi8(o->sg[j]);
            o->s[j] = _mm256_set1_epi16((short)iq4_xs_scale(blk, j));
        }
    }
}

/* One activation row times a decoded block into its 8 float lanes. Q5_K, Q2_K: Q4_K's float step, p · d·d_x then
 * Σ min·bsum · −dmin·d_x; Q3_K: 4 · Σ scale·bsum off p first (the values are q + 4); IQ4_XS: |value| × quant·sign. */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256 block_times_row(const int qtype, const KDec *k, const Row *r, int64_t b, __m256 acc) {
    const int8_t *x = r->q + b * QK_K;
    const float dx = r->d[b];
    __m256i p;
    if (qtype == T_IQ4_XS) {
        __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
            p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(_mm256_maddubs_epi16(
                k->v[j], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x + 32 * j)), k->sg[j])), k->s[j]));
            p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(_mm256_maddubs_epi16(
                k->v[j + 1], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x + 32 * j + 32)), k->sg[j + 1])), k->s[j + 1]));
        }
        p = _mm256_add_epi32(p0, p1);
    } else {
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(r->bs + b * 16));
        const __m256i off = qtype == T_Q3_K ? _mm256_sub_epi32(_mm256_setzero_si256(),
                                                               _mm256_slli_epi32(_mm256_madd_epi16(bs, k->w16), 2))
                                            : _mm256_setzero_si256();
        p = dot8(k->v, k->s, x, off);
        if (qtype == T_Q5_K || qtype == T_Q2_K) {
            const __m256 c = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, k->w16));
            return _mm256_fmadd_ps(c, _mm256_set1_ps(-dx * k->dmin),
                                   _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx * k->d), acc));
        }
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx * k->d), acc);
}

/* ---- AVX512 ------------------------------------------------------------------------------------- */

/* Two 32-byte halves as one 64-byte vector */
__attribute__((target(AVX512_TARGET), always_inline))
static inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

/* The bits n of each byte of x, as bytes (n < 8: a 16-bit shift moves no bit into a byte's bit 0 from its neighbour) */
__attribute__((target(AVX512_TARGET), always_inline))
static inline __m256i bits_at(__m256i x, int n) { return _mm256_srl_epi16(x, _mm_cvtsi32_si128(n)); }

/* A block decoded for the AVX512 products: vector j holds values 64j … 64j + 63 (IQ4_XS: |value|, the negative ones
 * in neg), s[j] the 16-bit scale of each pair of them, w16 the weights of the 16 activation sums as in KDec */
typedef struct {
    __m512i v[4], s[4];
    __mmask64 neg[4];
    __m256i w16;
    float d, dmin;
} KDec512;

__attribute__((target(AVX512_TARGET), always_inline))
static inline void decode_block512(const int qtype, const uint8_t *blk, KDec512 *o) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    /* 16-bit lane i of 32 (values 2i, 2i + 1 of a vector) takes scale i / 8 of the four sub-blocks of 16 it spans */
    const __m512i per16 = _mm512_setr_epi32(0, 0, 0, 0, 0x00010001, 0x00010001, 0x00010001, 0x00010001,
                                            0x00020002, 0x00020002, 0x00020002, 0x00020002,
                                            0x00030003, 0x00030003, 0x00030003, 0x00030003);
    if (qtype == T_Q5_K) {  /* vector c: the low then the high nibbles of qs[32c …], fifth bits 2c, 2c + 1 of qh */
        o->d = fp16_f16c(blk), o->dmin = fp16_f16c(blk + 2);
        const __m128i sm = q4_k_scales(blk);
        const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));
        o->w16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * c));
            const __m512i nib = _mm512_and_si512(join(q, _mm256_srli_epi16(q, 4)), m4);
            const __m512i hb = _mm512_and_si512(join(bits_at(h, 2 * c), bits_at(h, 2 * c + 1)), one);
            o->v[c] = _mm512_or_si512(nib, _mm512_slli_epi16(hb, 4));
            o->s[c] = _mm512_permutexvar_epi16(join(_mm256_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1))), sc);
        }
    } else if (qtype == T_Q3_K || qtype == T_Q2_K) {  /* vector 2n + t: bits 4t, 4t + 2 of qs[32n …] (values 128n + 64t …) */
        const __m256i h = _mm256_loadu_si256((const __m256i *)blk);
        __m256i sc16;
        if (qtype == T_Q3_K) {  /* third bits 4n + 2t (+ 1) of hmask; values q + 4 */
            o->d = fp16_f16c(blk + 108);
            o->w16 = sc16 = q3_k_scales16(blk);
        } else {  /* scales[16] (scale | min << 4), qs[64], d, dmin */
            o->d = fp16_f16c(blk + 80), o->dmin = fp16_f16c(blk + 82);
            const __m128i sm = _mm_loadu_si128((const __m128i *)blk), lo4 = _mm_set1_epi8(0x0F);
            o->w16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), lo4));
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(sm, lo4));
        }
        const int qs = qtype == T_Q3_K ? 32 : 16;
        for (int n = 0; n < 2; n++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + qs + 32 * n));
            for (int t = 0; t < 2; t++) {
                const int j = 4 * n + 2 * t;
                __m512i v = _mm512_and_si512(join(bits_at(q, 4 * t), bits_at(q, 4 * t + 2)), m3);
                if (qtype == T_Q3_K)
                    v = _mm512_or_si512(v, _mm512_slli_epi16(
                        _mm512_and_si512(join(bits_at(h, 4 * n + 2 * t), bits_at(h, 4 * n + 2 * t + 1)), one), 2));
                o->v[j / 2] = v;
                o->s[j / 2] = _mm512_permutexvar_epi16(_mm512_add_epi16(per16, _mm512_set1_epi16((short)(2 * j))),
                                                       _mm512_castsi256_si512(sc16));
            }
        }
    } else {  /* IQ4_XS: vector c: sub-blocks 2c, 2c + 1 (each the low then the high nibbles of its 16 bytes) */
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL));
        o->d = fp16_f16c(blk);
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 8 + 32 * c));
            const __m256i lo = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F));
            const __m512i sg = _mm512_shuffle_epi8(table, join(_mm256_permute2x128_si256(lo, hi, 0x20),
                                                               _mm256_permute2x128_si256(lo, hi, 0x31)));
            o->v[c] = _mm512_abs_epi8(sg);
            o->neg[c] = _mm512_movepi8_mask(sg);
            o->s[c] = join(_mm256_set1_epi16((short)iq4_xs_scale(blk, 2 * c)),
                           _mm256_set1_epi16((short)iq4_xs_scale(blk, 2 * c + 1)));
        }
    }
}

/* One activation row times a decoded block into its 16 float lanes: block_times_row's steps */
__attribute__((target(AVX512_TARGET), always_inline))
static inline __m512 block_times_row512(const int qtype, const KDec512 *k, const Row *r, int64_t b, __m512 acc) {
    const int8_t *x = r->q + b * QK_K;
    const float dx = r->d[b];
    __m512i p;
    if (qtype == T_IQ4_XS) {  /* |value| × quant·sign(value) */
        __m512i xs[4];
        for (int j = 0; j < 4; j++) {
            const __m512i q = _mm512_loadu_si512(x + 64 * j);
            xs[j] = _mm512_mask_sub_epi8(q, k->neg[j], _mm512_setzero_si512(), q);
        }
        const __m512i p0 = _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(k->v[0], xs[0]), k->s[0]),
                                            _mm512_madd_epi16(_mm512_maddubs_epi16(k->v[1], xs[1]), k->s[1]));
        const __m512i p1 = _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(k->v[2], xs[2]), k->s[2]),
                                            _mm512_madd_epi16(_mm512_maddubs_epi16(k->v[3], xs[3]), k->s[3]));
        p = _mm512_add_epi32(p0, p1);
    } else {
        p = row_sum(k->v, k->s, x);
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(r->bs + b * 16));
        if (qtype == T_Q3_K)  /* the values are q + 4 */
            p = _mm512_sub_epi32(p, _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(bs, k->w16), 2)));
        if (qtype == T_Q5_K || qtype == T_Q2_K) {
            const __m256 c = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, k->w16));
            const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(dx * k->d), acc);
            return _mm512_fmadd_ps(_mm512_zextps256_ps512(c), _mm512_set1_ps(-dx * k->dmin), f);
        }
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(dx * k->d), acc);
}

/* A weight row's blocks, each decoded once, times the tile's rows; a decode step's one row keeps its sum in a
 * register (the same operations, so the same bits as in a tile). NAME(qtype, …): Q5_K, Q3_K, Q2_K or IQ4_XS, one
 * copy of the loop per type, its decoding inlined; one driver per form. */
#define K_MORE_ROWS(NAME, TARGET, DEC, DECODE, TIMES, VEC)                                                         \
    __attribute__((target(TARGET), always_inline))                                                                \
    static inline void NAME##_type(const int qtype, const int bytes, const uint8_t *row, int64_t nb,              \
                                   const Row *rows, int64_t tn, VEC *acc) {                                        \
        DEC k;                                                                                                     \
        if (tn == 1) {                                                                                             \
            VEC a0 = acc[0];                                                                                       \
            for (int64_t b = 0; b < nb; b++) {                                                                     \
                DECODE(qtype, row + b * bytes, &k);                                                                \
                a0 = TIMES(qtype, &k, rows, b, a0);                                                                \
            }                                                                                                      \
            acc[0] = a0;                                                                                           \
            return;                                                                                                \
        }                                                                                                          \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            DECODE(qtype, row + b * bytes, &k);                                                                    \
            for (int64_t i = 0; i < tn; i++) acc[i] = TIMES(qtype, &k, rows + i, b, acc[i]);                       \
        }                                                                                                          \
    }                                                                                                              \
    __attribute__((target(TARGET)))                                                                               \
    void NAME(int qtype, const uint8_t *row, int64_t nb, const Row *rows, int64_t tn, VEC *acc) {                 \
        switch (qtype) {                                                                                           \
        case T_Q5_K: NAME##_type(T_Q5_K, 176, row, nb, rows, tn, acc); break;                                      \
        case T_Q3_K: NAME##_type(T_Q3_K, 110, row, nb, rows, tn, acc); break;                                      \
        case T_Q2_K: NAME##_type(T_Q2_K, 84, row, nb, rows, tn, acc); break;                                       \
        default: NAME##_type(T_IQ4_XS, 136, row, nb, rows, tn, acc); break;                                        \
        }                                                                                                          \
    }
K_MORE_ROWS(rows_k_more_avx2, AVX2_TARGET, KDec, decode_block, block_times_row, __m256)
K_MORE_ROWS(rows_k_more_avx512, AVX512_TARGET, KDec512, decode_block512, block_times_row512, __m512)
#endif

/* The 16-row interleaved ("packed") layout of IQ4_XS and its products in AVX512-VNNI, AVX-VNNI and AVX2 (the same
 * bits), beside packed_x16.c's K-quants: stored, IQ4_XS ran one weight row at a time (kquant_more.c) at ~39 GB/s for
 * one activation row and ~23 for four on a 2-core AVX512 host, ~33 and ~13 in AVX2.
 *
 * A packed group block (16 rows, one 256-value block; IQ4_XS_GROUP_BYTES): per sub-block j (32 values) four 64-byte
 * vectors p, byte 4l + e = stored quant byte 16j + 4p + e of row l (low nibble value 32j + 4p + e, high nibble
 * 32j + 16 + 4p + e); then d [16] f16; then the sub-blocks' 6-bit scales less 32, [j][row] int8; then padding to whole
 * cache lines (140 bytes a row and block against the stored 136).
 *
 * Integers, per row and block: Σ_j s_j · Σ v·x (v the non-linear table's values, s_j the sub-block's scale − 32),
 * exact whatever the form. VNNI and AVX-VNNI take the values + 128 (one pshufb of the shifted table) into dpbusd, from
 * −128 · the sub-block's 32 quants' sum (two of Q8_K's sums of 16), times s_j by mullo; AVX2 takes |v| and x·sign(v)
 * into maddubs (pairs of at most 2·127·127) and madd by s_j in both int16 halves of each lane. Floats, lane by lane in
 * every form: acc = fma(float(Σ), d_w·d_x, acc). */
#include "kernels.h"

#if defined(__x86_64__)
#define IQ4_XS_BYTES 136  /* a stored block */
#define IQ4_XS_GROUP_BYTES 2240  /* 2048 of quants, 32 of scales d, 128 of sub-block scales, 32 of padding */
#define IQ4_XS_D 2048
#define IQ4_XS_SCALES 2080

static const int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

int64_t packed_iq4_xs_bytes(void) { return IQ4_XS_GROUP_BYTES / GROUP; }

void repack_iq4_xs_group(const uint8_t *src, int64_t nb, uint8_t *dst) {
    memset(dst + IQ4_XS_SCALES + 128, 0, IQ4_XS_GROUP_BYTES - IQ4_XS_SCALES - 128);
    for (int l = 0; l < GROUP; l++) {
        const uint8_t *b = src + l * nb * IQ4_XS_BYTES;
        const int h = b[2] | (b[3] << 8);
        memcpy(dst + IQ4_XS_D + 2 * l, b, 2);
        for (int j = 0; j < 8; j++) {
            dst[IQ4_XS_SCALES + GROUP * j + l] =
                (uint8_t)(int8_t)((((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((h >> (2 * j)) & 3) << 4)) - 32);
            for (int p = 0; p < 4; p++) memcpy(dst + 256 * j + 64 * p + 4 * l, b + 8 + 16 * j + 4 * p, 4);
        }
    }
}

#define BCAST4(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define IQ4_VNNI_TARGET VNNI_TARGET ",avx2,fma"

/* the sum of sub-block j's 32 activation quants (Q8_K keeps sums of 16) */
static inline int32_t sub_sum(const Row *r, int64_t b, int j) { return r->bs[16 * b + 2 * j] + r->bs[16 * b + 2 * j + 1]; }

/* T activation rows times one packed group (nb blocks): o[i · ldo + l] */
__attribute__((target(IQ4_VNNI_TARGET), always_inline))
static inline void iq4_xs_x16(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                              Ahead *ah) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i tab = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KV_IQ4NL)),
                                        _mm512_set1_epi8((char)0x80));
    __m512 acc[X16_TILE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * IQ4_XS_GROUP_BYTES;
        __m512i isum[X16_TILE];
        for (int i = 0; i < T; i++) isum[i] = _mm512_setzero_si512();
        _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) {
            ahead_step(ah, IQ4_XS_GROUP_BYTES / 8);
            __m512i v[8];
            for (int p = 0; p < 4; p++) {
                const __m512i q = _mm512_loadu_si512(blk + 256 * j + 64 * p);
                v[p] = _mm512_shuffle_epi8(tab, _mm512_and_si512(q, m4));
                v[p + 4] = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
            }
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + IQ4_XS_SCALES + GROUP * j)));
            for (int i = 0; i < T; i++) {
                const int8_t *x = rows[i].q + b * QK_K + 32 * j;
                __m512i s0 = _mm512_set1_epi32(-128 * sub_sum(&rows[i], b, j)), s1 = _mm512_setzero_si512();
                for (int p = 0; p < 4; p++) {
                    s0 = _mm512_dpbusd_epi32(s0, v[p], BCAST4(x + 4 * p));
                    s1 = _mm512_dpbusd_epi32(s1, v[p + 4], BCAST4(x + 16 + 4 * p));
                }
                isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + IQ4_XS_D)));
        for (int i = 0; i < T; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, _mm512_set1_ps(rows[i].d[b])), acc[i]);
    }
    for (int i = 0; i < T; i++) _mm512_storeu_ps(o + i * ldo, acc[i]);
}

/* The 8 value vectors of sub-block j's 8-row half h: `tab`'s entries (the values, or the values + 128) */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void iq4_xs_half(const uint8_t *blk, int j, int h, __m256i tab, __m256i *v) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 256 * j + 64 * p + 32 * h));
        v[p] = _mm256_shuffle_epi8(tab, _mm256_and_si256(q, m4));
        v[p + 4] = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
    }
}

/* The 256-bit forms' float step at the end of block b: acc = fma(float(Σ), d_w·d_x, acc), half by half */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void iq4_xs_float256(const uint8_t *blk, const Row *rows, int64_t b, __m256i isum[][2], __m256 acc[][2],
                                   const int T) {
    for (int h = 0; h < 2; h++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + IQ4_XS_D + 16 * h)));
        for (int i = 0; i < T; i++)
            acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][h]), _mm256_mul_ps(d, _mm256_set1_ps(rows[i].d[b])),
                                        acc[i][h]);
    }
}

/* One activation row's step on one 8-row half of sub-block j in each 256-bit form: the values v (`tab`'s entries)
 * against its 32 quants x (their sum sx), times the scales sc (int32 lanes), into isum */
__attribute__((target(AVXVNNI_TARGET), always_inline))
static inline __m256i iq4_xs_step_avxvnni(const __m256i *v, __m256i sc, const int8_t *x, int32_t sx, __m256i isum) {
    __m256i s0 = _mm256_set1_epi32(-128 * sx), s1 = _mm256_setzero_si256();  /* the values went in + 128 */
    for (int p = 0; p < 4; p++) {
        s0 = _mm256_dpbusd_avx_epi32(s0, v[p], _mm256_set1_epi32(*(const int32_t *)(x + 4 * p)));
        s1 = _mm256_dpbusd_avx_epi32(s1, v[p + 4], _mm256_set1_epi32(*(const int32_t *)(x + 16 + 4 * p)));
    }
    return _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_add_epi32(s0, s1), sc));
}

/* |v| and x·sign(v) into maddubs, madd by the scale in both int16 halves of a lane (v signed; the loop-invariant
 * parts are hoisted out of the rows' loop once inlined) */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i iq4_xs_step_avx2(const __m256i *v, __m256i sc, const int8_t *x, int32_t sx, __m256i isum) {
    (void)sx;
    const __m256i sc16 = _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16));
    for (int p = 0; p < 8; p++) {  /* v[p]: values 4p … (p < 4), 16 + 4(p − 4) … */
        const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(x + 4 * p));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v[p]),
                                                                             _mm256_sign_epi8(xb, v[p])), sc16));
    }
    return isum;
}

/* iq4_xs_x16 in a 256-bit form (TAB: its table, STEP: its per-row step): each 64-byte vector's two 8-row halves */
#define IQ4_256(NAME, TARGET, TAB, STEP)                                                                          \
    __attribute__((target(TARGET), always_inline))                                                                \
    static inline void NAME(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,    \
                            Ahead *ah) {                                                                          \
        const __m256i tab = TAB;                                                                                  \
        __m256 acc[X16_TILE][2];                                                                                  \
        for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < nb; b++) {                                                                        \
            const uint8_t *blk = g + b * IQ4_XS_GROUP_BYTES;                                                      \
            __m256i isum[X16_TILE][2];                                                                            \
            for (int i = 0; i < T; i++) isum[i][0] = isum[i][1] = _mm256_setzero_si256();                         \
            _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) {                                                 \
                ahead_step(ah, IQ4_XS_GROUP_BYTES / 8);                                                           \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                             \
                    __m256i v[8];                                                                                 \
                    iq4_xs_half(blk, j, h, tab, v);                                                               \
                    const __m256i sc = _mm256_cvtepi8_epi32(                                                      \
                        _mm_loadl_epi64((const __m128i *)(blk + IQ4_XS_SCALES + GROUP * j + 8 * h)));             \
                    for (int i = 0; i < T; i++)                                                                   \
                        isum[i][h] = STEP(v, sc, rows[i].q + b * QK_K + 32 * j, sub_sum(&rows[i], b, j), isum[i][h]); \
                }                                                                                                 \
            }                                                                                                     \
            iq4_xs_float256(blk, rows, b, isum, acc, T);                                                          \
        }                                                                                                         \
        store_x16_avx2(acc, o, ldo, T);                                                                           \
    }
IQ4_256(iq4_xs_x16_avxvnni, AVXVNNI_TARGET,
        _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KV_IQ4NL)), _mm256_set1_epi8((char)0x80)),
        iq4_xs_step_avxvnni)
IQ4_256(iq4_xs_x16_avx2, AVX2_TARGET, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KV_IQ4NL)),
        iq4_xs_step_avx2)

#define IQ4_ENTRY(NAME, TARGET, FN)                                                                               \
    __attribute__((target(TARGET))) void NAME(const uint8_t *g, int64_t nb, const Row *rows, float *o,             \
                                              int64_t ldo, int tn, Ahead *ah) {                                   \
        switch (tn) {                                                                                             \
        case 1: FN(g, nb, rows, o, ldo, 1, ah); break;                                                            \
        case 2: FN(g, nb, rows, o, ldo, 2, ah); break;                                                            \
        case 3: FN(g, nb, rows, o, ldo, 3, ah); break;                                                            \
        default: FN(g, nb, rows, o, ldo, 4, ah); break;                                                           \
        }                                                                                                         \
    }
IQ4_ENTRY(iq4_xs_x16_group_vnni, IQ4_VNNI_TARGET, iq4_xs_x16)
IQ4_ENTRY(iq4_xs_x16_group_avxvnni, AVXVNNI_TARGET, iq4_xs_x16_avxvnni)
IQ4_ENTRY(iq4_xs_x16_group_avx2, AVX2_TARGET, iq4_xs_x16_avx2)
#endif

/* The 16-row interleaved ("packed") layout of Q2_K and Q3_K and their products in AVX512-VNNI, AVX-VNNI and AVX2 (the
 * same bits), beside packed_x16.c's other K-quants: stored, they ran one weight row at a time (kquant_more.c) at
 * ~35-39 GB/s for one activation row and ~17-19 for four on a 2-core AVX512 host, ~24-26 and 8-10 in AVX2.
 *
 * A packed group block (16 rows, one 256-value block), per run u of 32 values (sub-blocks 2u and 2u + 1):
 *   two 64-byte vectors of the values' low 2 bits, byte 4l + e of vector k holding those of value 32u + 16k + 4s + e
 *   of row l at bits 2s, 2s + 1 (s < 4);
 *   Q3_K: one 64-byte vector of their high bits, byte 4l + e holding that of value 32u + 4s + e at bit s (s < 8);
 *   32 bytes of the two sub-blocks' scales, byte 2l + t = sub-block 2u + t's of row l (Q2_K: scale | min << 4 as
 *   stored; Q3_K: the 6-bit scale − 32);
 * then d [16] f16 (Q2_K: and dmin [16] f16), then padding to whole cache lines: Q2_K 84 bytes a row and block (the
 * stored size), Q3_K 116 (stored 110).
 *
 * Integers, per row and block, exact whatever the form: Σ_j sc_j · Σ q·x over the 16 sub-blocks, with Q3_K's values
 * taken as q + 4 (0 … 7) and 4 · Σ_j sc_j · bsum_j taken off; Q2_K's Σ_j m_j · bsum_j beside it (bsum_j: Q8_K's sums of
 * 16 quants). VNNI and AVX-VNNI: dpbusd of the values by 4 broadcast quants, times the sub-block's scale (mullo),
 * dpwssd of the scale or min pairs by the bsum pairs; AVX2: maddubs (pairs of at most 2·7·127, four summed in int16),
 * madd by the scale in both int16 halves of a lane, madd of the pairs. Floats, lane by lane in every form:
 * acc = fma(float(Σ), d_w·d_x, acc), Q2_K then acc = fnma(float(Σ m·bsum), dmin_w·d_x, acc) (Q4_K's steps). */
#include "kernels.h"

#if defined(__x86_64__)
#define Q2K_GROUP_BYTES 1344  /* 8 · (128 + 32) + 64 */
#define Q3K_GROUP_BYTES 1856  /* 8 · (128 + 64 + 32) + 32 + 32 of padding */

static inline int run_bytes(int q3) { return q3 ? 224 : 160; }  /* a run's low bits, Q3_K's high bits, its scales */
static inline int group_bytes(int q3) { return q3 ? Q3K_GROUP_BYTES : Q2K_GROUP_BYTES; }

int64_t packed_q23_k_bytes(int qtype) { return group_bytes(qtype == T_Q3_K) / GROUP; }

void repack_q23_k_group(int qtype, const uint8_t *src, int64_t nb, uint8_t *dst) {
    const int q3 = qtype == T_Q3_K, bytes = q3 ? 110 : 84, rb = run_bytes(q3);
    memset(dst + 8 * rb, 0, group_bytes(q3) - 8 * rb);
    for (int l = 0; l < GROUP; l++) {
        const uint8_t *b = src + l * nb * bytes, *qs = b + (q3 ? 32 : 16);
        int8_t sc3[16];
        if (q3) q3_k_scales(b, sc3);
        /* value v = 128n + 32j + t (t < 32): low bits (qs[32n + t] >> 2j) & 3, Q3_K's high bit (hmask[t] >> (4n + j)) & 1 */
        for (int u = 0; u < 8; u++) {
            uint8_t *r = dst + rb * u;
            for (int e = 0; e < 4; e++) {
                uint8_t lo[2] = {0, 0}, hi = 0;
                for (int s = 0; s < 8; s++) {
                    const int v = 32 * u + 4 * s + e, n = v / 128, j = (v % 128) / 32, t = v % 32;
                    lo[s / 4] |= (uint8_t)(((qs[32 * n + t] >> (2 * j)) & 3) << (2 * (s % 4)));
                    if (q3) hi |= (uint8_t)(((b[t] >> (4 * n + j)) & 1) << s);
                }
                r[4 * l + e] = lo[0];
                r[64 + 4 * l + e] = lo[1];
                if (q3) r[128 + 4 * l + e] = hi;
            }
            for (int t = 0; t < 2; t++) r[rb - 32 + 2 * l + t] = q3 ? (uint8_t)sc3[2 * u + t] : b[2 * u + t];
        }
        memcpy(dst + 8 * rb + 2 * l, b + (q3 ? 108 : 80), 2);
        if (!q3) memcpy(dst + 8 * rb + 32 + 2 * l, b + 82, 2);
    }
}

#define BCAST4(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define Q23_VNNI_TARGET VNNI_TARGET ",avx2,fma"

/* Q8_K's sums of 16 quants of sub-blocks 2u, 2u + 1 as one int32 (a pair for dpwssd / madd) */
static inline int32_t bs_pair(const Row *r, int64_t b, int u) { return *(const int32_t *)(r->bs + 16 * b + 2 * u); }

/* Q3_K's high bit j of each byte of hb moved to bit 2 (and nothing else kept): one shift (none for j = 2) and a mask */
__attribute__((target(Q23_VNNI_TARGET), always_inline))
static inline __m512i q3_high_at_2_512(__m512i hb, int j) {
    const __m512i m4 = _mm512_set1_epi8(4);
    return _mm512_and_si512(j < 2 ? _mm512_slli_epi16(hb, 2 - j) : j > 2 ? _mm512_srli_epi16(hb, j - 2) : hb, m4);
}

/* T activation rows times one packed group (nb blocks) of Q2_K (q3 = 0) or Q3_K: o[i · ldo + l] */
__attribute__((target(Q23_VNNI_TARGET), always_inline))
static inline void q23_x16(const int q3, const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo,
                           const int T, Ahead *ah) {
    const int rb = run_bytes(q3), gb = group_bytes(q3);
    const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi32(0xF),
                  mpair = _mm512_set1_epi32(0x000F000F);
    __m512 acc[X16_TILE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gb;
        __m512i isum[X16_TILE], ssum[X16_TILE];
        for (int i = 0; i < T; i++) isum[i] = ssum[i] = _mm512_setzero_si512();
        _Pragma("GCC unroll 1") for (int u = 0; u < 8; u++) {
            ahead_step(ah, gb / 8);
            const uint8_t *r = blk + rb * u;
            const __m512i l0 = _mm512_loadu_si512(r), l1 = _mm512_loadu_si512(r + 64);
            const __m512i hb = q3 ? _mm512_loadu_si512(r + 128) : _mm512_setzero_si512();
            __m512i v[8];
            for (int s = 0; s < 4; s++) {
                const __m512i a = _mm512_srli_epi16(l0, 2 * s), b = _mm512_srli_epi16(l1, 2 * s);
                if (q3) {  /* (a & 3) | high bit at 2, in one ternary op (0xEA: (x & y) | z) */
                    v[s] = _mm512_ternarylogic_epi32(a, m3, q3_high_at_2_512(hb, s), 0xEA);
                    v[s + 4] = _mm512_ternarylogic_epi32(b, m3, q3_high_at_2_512(hb, s + 4), 0xEA);
                } else {
                    v[s] = _mm512_and_si512(a, m3);
                    v[s + 4] = _mm512_and_si512(b, m3);
                }
            }
            /* lane l: sub-block 2u's byte | 2u + 1's << 16, as int16 pairs */
            const __m256i sb = _mm256_loadu_si256((const __m256i *)(r + rb - 32));
            const __m512i pairs = q3 ? _mm512_cvtepi8_epi16(sb) : _mm512_cvtepu8_epi16(sb);
            const __m512i sca = q3 ? _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16) : _mm512_and_si512(pairs, m4);
            const __m512i scb = q3 ? _mm512_srai_epi32(pairs, 16) : _mm512_and_si512(_mm512_srli_epi32(pairs, 16), m4);
            /* the pairs against the bsum pairs: Q3_K's scales (its offset), Q2_K's mins */
            const __m512i spair = q3 ? pairs : _mm512_and_si512(_mm512_srli_epi16(pairs, 4), mpair);
            for (int i = 0; i < T; i++) {
                const int8_t *x = rows[i].q + b * QK_K + 32 * u;
                __m512i da = _mm512_setzero_si512(), db = _mm512_setzero_si512();
                for (int s = 0; s < 4; s++) {
                    da = _mm512_dpbusd_epi32(da, v[s], BCAST4(x + 4 * s));
                    db = _mm512_dpbusd_epi32(db, v[s + 4], BCAST4(x + 16 + 4 * s));
                }
                isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(da, sca),
                                                                     _mm512_mullo_epi32(db, scb)));
                ssum[i] = _mm512_dpwssd_epi32(ssum[i], spair, _mm512_set1_epi32(bs_pair(&rows[i], b, u)));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 8 * rb)));
        const __m512 dmin = q3 ? d : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 8 * rb + 32)));
        for (int i = 0; i < T; i++) {
            const __m512 dx = _mm512_set1_ps(rows[i].d[b]);
            if (q3) {
                const __m512i p = _mm512_sub_epi32(isum[i], _mm512_slli_epi32(ssum[i], 2));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, dx), acc[i]);
            } else {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, dx), acc[i]);
                acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ssum[i]), _mm512_mul_ps(dmin, dx), acc[i]);
            }
        }
    }
    for (int i = 0; i < T; i++) _mm512_storeu_ps(o + i * ldo, acc[i]);
}

/* q3_high_at_2_512 in 256 bits */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i q3_high_at_2(__m256i hb, int j) {
    const __m256i m4 = _mm256_set1_epi8(4);
    return _mm256_and_si256(j < 2 ? _mm256_slli_epi16(hb, 2 - j) : j > 2 ? _mm256_srli_epi16(hb, j - 2) : hb, m4);
}

/* The 8 value vectors of run u's 8-row half h (q + 4 for Q3_K), and its scale bytes as int16 pairs per lane */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i q23_half(const int q3, const uint8_t *r, int rb, int h, __m256i *v) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(r + 32 * h)),
                  l1 = _mm256_loadu_si256((const __m256i *)(r + 64 + 32 * h));
    const __m256i hb = q3 ? _mm256_loadu_si256((const __m256i *)(r + 128 + 32 * h)) : _mm256_setzero_si256();
    for (int s = 0; s < 4; s++) {
        v[s] = _mm256_and_si256(_mm256_srli_epi16(l0, 2 * s), m3);
        v[s + 4] = _mm256_and_si256(_mm256_srli_epi16(l1, 2 * s), m3);
        if (q3) {  /* bits 0-1 and bit 2 are disjoint: the OR is their sum */
            v[s] = _mm256_or_si256(v[s], q3_high_at_2(hb, s));
            v[s + 4] = _mm256_or_si256(v[s + 4], q3_high_at_2(hb, s + 4));
        }
    }
    const __m128i sb = _mm_loadu_si128((const __m128i *)(r + rb - 32 + 16 * h));
    return q3 ? _mm256_cvtepi8_epi16(sb) : _mm256_cvtepu8_epi16(sb);
}

/* The 256-bit forms' float step at the end of block b, half by half: as q23_x16's (tail: the group block's d, dmin) */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void q23_float_avx2(const int q3, const uint8_t *tail, const Row *rows, int64_t b, __m256i isum[][2],
                                  __m256i ssum[][2], __m256 acc[][2], const int T) {
    for (int h = 0; h < 2; h++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tail + 16 * h)));
        const __m256 dmin = q3 ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tail + 32 + 16 * h)));
        for (int i = 0; i < T; i++) {
            const __m256 dx = _mm256_set1_ps(rows[i].d[b]);
            if (q3) {
                const __m256i p = _mm256_sub_epi32(isum[i][h], _mm256_slli_epi32(ssum[i][h], 2));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d, dx), acc[i][h]);
            } else {
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][h]), _mm256_mul_ps(d, dx), acc[i][h]);
                acc[i][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ssum[i][h]), _mm256_mul_ps(dmin, dx), acc[i][h]);
            }
        }
    }
}

/* One activation row's step on one 8-row half of run u in each 256-bit form: the values v against the run's 32 quants
 * x, each sub-block's sum times its scale into isum, the scale or min pairs against the bsum pair into ssum. */
__attribute__((target(AVXVNNI_TARGET), always_inline))
static inline void q23_step_avxvnni(const int q3, const __m256i *v, __m256i pairs, const int8_t *x, int32_t bsp,
                                    __m256i *isum, __m256i *ssum) {
    const __m256i m4 = _mm256_set1_epi32(0xF);
    /* each sub-block's scale as an int32 lane, and the pairs dpwssd takes */
    const __m256i sca = q3 ? _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16) : _mm256_and_si256(pairs, m4);
    const __m256i scb = q3 ? _mm256_srai_epi32(pairs, 16) : _mm256_and_si256(_mm256_srli_epi32(pairs, 16), m4);
    const __m256i spair = q3 ? pairs : _mm256_and_si256(_mm256_srli_epi16(pairs, 4), _mm256_set1_epi32(0x000F000F));
    __m256i da = _mm256_setzero_si256(), db = _mm256_setzero_si256();
    for (int s = 0; s < 4; s++) {
        da = _mm256_dpbusd_avx_epi32(da, v[s], _mm256_set1_epi32(*(const int32_t *)(x + 4 * s)));
        db = _mm256_dpbusd_avx_epi32(db, v[s + 4], _mm256_set1_epi32(*(const int32_t *)(x + 16 + 4 * s)));
    }
    *isum = _mm256_add_epi32(*isum, _mm256_add_epi32(_mm256_mullo_epi32(da, sca), _mm256_mullo_epi32(db, scb)));
    *ssum = _mm256_dpwssd_avx_epi32(*ssum, spair, _mm256_set1_epi32(bsp));
}

/* maddubs of each sub-block's four vectors summed in int16, madd by its scale in both int16 halves of a lane */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void q23_step_avx2(const int q3, const __m256i *v, __m256i pairs, const int8_t *x, int32_t bsp,
                                 __m256i *isum, __m256i *ssum) {
    const __m256i m4 = _mm256_set1_epi32(0xF);
    const __m256i a = q3 ? _mm256_and_si256(pairs, _mm256_set1_epi32(0xFFFF)) : _mm256_and_si256(pairs, m4);
    const __m256i bb = q3 ? _mm256_srli_epi32(pairs, 16) : _mm256_and_si256(_mm256_srli_epi32(pairs, 16), m4);
    const __m256i sca = _mm256_or_si256(a, _mm256_slli_epi32(a, 16)), scb = _mm256_or_si256(bb, _mm256_slli_epi32(bb, 16));
    const __m256i spair = q3 ? pairs : _mm256_and_si256(_mm256_srli_epi16(pairs, 4), _mm256_set1_epi32(0x000F000F));
    __m256i da = _mm256_setzero_si256(), db = _mm256_setzero_si256();
    for (int s = 0; s < 4; s++) {
        da = _mm256_add_epi16(da, _mm256_maddubs_epi16(v[s], _mm256_set1_epi32(*(const int32_t *)(x + 4 * s))));
        db = _mm256_add_epi16(db, _mm256_maddubs_epi16(v[s + 4], _mm256_set1_epi32(*(const int32_t *)(x + 16 + 4 * s))));
    }
    *isum = _mm256_add_epi32(*isum, _mm256_add_epi32(_mm256_madd_epi16(da, sca), _mm256_madd_epi16(db, scb)));
    *ssum = _mm256_add_epi32(*ssum, _mm256_madd_epi16(spair, _mm256_set1_epi32(bsp)));
}

/* q23_x16 in a 256-bit form (STEP: its per-row step): each 64-byte vector's two 8-row halves in turn */
#define Q23_256(NAME, TARGET, STEP)                                                                               \
    __attribute__((target(TARGET), always_inline))                                                                \
    static inline void NAME(const int q3, const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo,   \
                            const int T, Ahead *ah) {                                                             \
        const int rb = run_bytes(q3), gb = group_bytes(q3);                                                       \
        __m256 acc[X16_TILE][2];                                                                                  \
        for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                                  \
        for (int64_t b = 0; b < nb; b++) {                                                                        \
            const uint8_t *blk = g + b * gb;                                                                      \
            __m256i isum[X16_TILE][2], ssum[X16_TILE][2];                                                         \
            for (int i = 0; i < T; i++) isum[i][0] = isum[i][1] = ssum[i][0] = ssum[i][1] = _mm256_setzero_si256(); \
            _Pragma("GCC unroll 1") for (int u = 0; u < 8; u++) {                                                 \
                ahead_step(ah, gb / 8);                                                                           \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                             \
                    __m256i v[8];                                                                                 \
                    const __m256i pairs = q23_half(q3, blk + rb * u, rb, h, v);                                   \
                    for (int i = 0; i < T; i++)                                                                   \
                        STEP(q3, v, pairs, rows[i].q + b * QK_K + 32 * u, bs_pair(&rows[i], b, u), &isum[i][h],   \
                             &ssum[i][h]);                                                                        \
                }                                                                                                 \
            }                                                                                                     \
            q23_float_avx2(q3, blk + 8 * rb, rows, b, isum, ssum, acc, T);                                        \
        }                                                                                                         \
        store_x16_avx2(acc, o, ldo, T);                                                                           \
    }
Q23_256(q23_x16_avxvnni, AVXVNNI_TARGET, q23_step_avxvnni)
Q23_256(q23_x16_avx2, AVX2_TARGET, q23_step_avx2)

#define Q23_CASES(FN, Q3)                                                                                         \
    switch (tn) {                                                                                                 \
    case 1: FN(Q3, g, nb, rows, o, ldo, 1, ah); break;                                                            \
    case 2: FN(Q3, g, nb, rows, o, ldo, 2, ah); break;                                                            \
    case 3: FN(Q3, g, nb, rows, o, ldo, 3, ah); break;                                                            \
    default: FN(Q3, g, nb, rows, o, ldo, 4, ah); break;                                                           \
    }
#define Q23_ENTRY(NAME, TARGET, FN)                                                                               \
    __attribute__((target(TARGET))) void NAME(int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o, \
                                              int64_t ldo, int tn, Ahead *ah) {                                   \
        if (qtype == T_Q3_K) { Q23_CASES(FN, 1) } else { Q23_CASES(FN, 0) }                                       \
    }
Q23_ENTRY(q23_k_x16_group_vnni, Q23_VNNI_TARGET, q23_x16)
Q23_ENTRY(q23_k_x16_group_avxvnni, AVXVNNI_TARGET, q23_x16_avxvnni)
Q23_ENTRY(q23_k_x16_group_avx2, AVX2_TARGET, q23_x16_avx2)
#endif

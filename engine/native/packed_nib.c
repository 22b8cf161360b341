/* The 16-row interleaved ("packed") layout of the 32-value nibble types — Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 — and
 * their products in AVX512-VNNI, AVX-VNNI and AVX2 (the same bits), beside packed_x16.c's Q4_K, Q6_K and Q8_0.
 *
 * Stored, these types are multiplied one weight row at a time (legacy.c): each block's scale converted, multiplied by
 * the activation's and broadcast on its own, its nibbles unpacked for 8 lanes of one row — ~30 GB/s for one
 * activation row and ~10 for four, against ~80 and ~55 for packed Q4_K. Packed, one vector holds 4 values of each of
 * 16 rows, so a dpbusd against 4 broadcast activation quants adds 4 products for 16 rows, and a block's scales are one
 * conversion and one multiply for 16 rows.
 *
 * A packed group (16 rows of nb blocks): the scales, [block][row] — f16 as stored, or MXFP4's E8M0 byte then 16 bytes
 * of padding, 32 bytes a block either way; Q4_1's and Q5_1's minimums, [block][row] f16, 32 bytes a block; then per
 * block four 64-byte vectors p, byte 4l + e = stored quant byte 4p + e of row l (its low nibble is value 4p + e, its
 * high nibble value 16 + 4p + e), and for Q5_0 / Q5_1 one more of the fifth bits, byte 4l + e holding those of values
 * 4p + e at bit 2p and 16 + 4p + e at bit 2p + 1 (p < 4). The stored size a row and block (Q4_0, IQ4_NL 18; Q4_1 20;
 * Q5_0 22; Q5_1 24), MXFP4's 17 + 1.
 *
 * Integers: the exact Σ v·x of a row's block, whatever the form. VNNI and AVX-VNNI take the values unsigned, as
 * dpbusd does: Q4_0's and Q5_0's (v + 8, v + 16), IQ4_NL's and MXFP4's table entry + 128, from −8, −16 or −128·Σx;
 * Q4_1's and Q5_1's as they are. AVX2's maddubs takes the same unsigned values of the non-table types (int16 pairs of
 * at most 2·15·127, eight of them summed before madd widens them; five bits: 2·31·127, four), the table types' values
 * signed, as |v| and x·sign(v) (IQ4_NL's pairs reach 2·127·127, so each is widened by madd at once; MXFP4's at most
 * 2·12·127, eight summed). Floats, lane by lane in every form: acc = fma(float(Σ v·x), d_w·d_x, acc), then with a
 * minimum acc = fma(m_w, s_x, acc).
 * They group differently from the stored products (legacy.c reduces 8 lanes per row at the end of it): float
 * rounding apart, as the other packed types are from theirs. */
#include "kernels.h"

#if defined(__x86_64__)
#define NIB_VNNI_TARGET VNNI_TARGET ",avx2,fma"

static const int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline int has_min(int qtype) { return qtype == T_Q4_1 || qtype == T_Q5_1; }
static inline int five_bits(int qtype) { return qtype == T_Q5_0 || qtype == T_Q5_1; }

int64_t packed_nib_bytes(int qtype) { return 18 + 2 * has_min(qtype) + 4 * five_bits(qtype); }

/* where a packed group's quant vectors start, and the bytes of one block's */
static inline int64_t quants_at(int qtype, int64_t nb) { return (has_min(qtype) ? 64 : 32) * nb; }
static inline int block_quants(int qtype) { return 256 + 64 * five_bits(qtype); }

void repack_nib_group(int qtype, const uint8_t *src, int64_t nb, uint8_t *dst) {
    const int mx = qtype == T_MXFP4, mn = has_min(qtype), five = five_bits(qtype);
    const int bytes = mx ? 17 : (int)packed_nib_bytes(qtype), bq = block_quants(qtype);
    uint8_t *mins = dst + 32 * nb, *q = dst + quants_at(qtype, nb);
    for (int64_t b = 0; b < nb; b++) {
        if (mx) memset(dst + 32 * b + GROUP, 0, 32 - GROUP);
        for (int l = 0; l < GROUP; l++) {
            const uint8_t *blk = src + (l * nb + b) * bytes;
            if (mx) dst[32 * b + l] = blk[0];
            else memcpy(dst + 32 * b + 2 * l, blk, 2);
            if (mn) memcpy(mins + 32 * b + 2 * l, blk + 2, 2);
            const uint8_t *qs = blk + (mx ? 1 : 2 + 2 * mn + 4 * five);
            for (int p = 0; p < 4; p++) memcpy(q + bq * b + 64 * p + 4 * l, qs + 4 * p, 4);
            if (five) {
                uint32_t qh;
                memcpy(&qh, blk + 2 + 2 * mn, 4);
                for (int e = 0; e < 4; e++) {
                    uint8_t h = 0;
                    for (int p = 0; p < 4; p++)
                        h |= (uint8_t)((((qh >> (4 * p + e)) & 1) << (2 * p)) | (((qh >> (16 + 4 * p + e)) & 1) << (2 * p + 1)));
                    q[bq * b + 256 + 4 * l + e] = h;
                }
            }
        }
    }
}

/* a table type's values + 128 (unsigned, as dpbusd takes them), in each 128-bit lane of a 512-bit vector */
static inline const int8_t *table_of(int qtype) { return qtype == T_MXFP4 ? KV_MXFP4 : KV_IQ4NL; }

/* 16 E8M0 scales as ggml_e8m0_to_fp32_half makes them: 2^(e − 127) / 2, a subnormal below e = 2 */
__attribute__((target(VNNI_TARGET), always_inline))
static inline __m512 e8m0_half16(const uint8_t *p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, sub));
}

__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256 e8m0_half8(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* Σ of an activation block's 32 quants (the dpbusd forms' offset) */
__attribute__((target(AVX2_TARGET), always_inline))
static inline int32_t quant_sum(const int8_t *x) {
    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i *)x)),
                                        _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

/* what a dpbusd form's block sum starts from: −(v's offset)·Σx */
static inline int32_t offset_of(int qtype) {
    return has_min(qtype) ? 0 : qtype == T_Q4_0 ? 8 : qtype == T_Q5_0 ? 16 : 128;
}

#define BCAST4(p) _mm512_set1_epi32(*(const int32_t *)(p))

/* T activation rows times one packed group of type qtype (constants once inlined): o[i · ldo + l] */
__attribute__((target(NIB_VNNI_TARGET), always_inline))
static inline void nib_x16(const int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo,
                           const int T, Ahead *ah) {
    const int mn = has_min(qtype), five = five_bits(qtype), bq = block_quants(qtype);
    const int table = qtype == T_IQ4_NL || qtype == T_MXFP4, off = offset_of(qtype);
    const uint8_t *mins = g + 32 * nb, *qv = g + quants_at(qtype, nb);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i tab = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table_of(qtype))),
                                        _mm512_set1_epi8((char)0x80));
    __m512 acc[X16_TILE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        ahead_step(ah, bq + 32 + 32 * mn);
        __m512i v[8];
        const __m512i hb = five ? _mm512_loadu_si512(qv + bq * b + 256) : _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            const __m512i q = _mm512_loadu_si512(qv + bq * b + 64 * p);
            v[p] = _mm512_and_si512(q, m4);
            v[p + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            if (table) v[p] = _mm512_shuffle_epi8(tab, v[p]), v[p + 4] = _mm512_shuffle_epi8(tab, v[p + 4]);
            if (five)
                v[p] = _mm512_or_si512(v[p], fifth512(hb, 2 * p)),
                v[p + 4] = _mm512_or_si512(v[p + 4], fifth512(hb, 2 * p + 1));
        }
        const __m512 d = qtype == T_MXFP4 ? e8m0_half16(g + 32 * b)
                                          : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32 * b)));
        for (int i = 0; i < T; i++) {
            const int8_t *x = rows[i].q + b * 32;
            __m512i s0 = _mm512_set1_epi32(off ? -off * quant_sum(x) : 0), s1 = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) {
                s0 = _mm512_dpbusd_epi32(s0, v[p], BCAST4(x + 4 * p));
                s1 = _mm512_dpbusd_epi32(s1, v[p + 4], BCAST4(x + 16 + 4 * p));
            }
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                     _mm512_mul_ps(d, _mm512_set1_ps(rows[i].d[b])), acc[i]);
            if (mn)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + 32 * b))),
                                         _mm512_set1_ps(rows[i].s[b]), acc[i]);
        }
    }
    for (int i = 0; i < T; i++) _mm512_storeu_ps(o + i * ldo, acc[i]);
}

/* The 8 value vectors of one 8-row half of a block's quants at q (its vectors 64 bytes apart, the fifth bits after
 * them): nibbles (with their fifth bit) or, for the table types, the table's entries */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void nib_values256(const int qtype, const uint8_t *q, __m256i tab, __m256i *v) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int table = qtype == T_IQ4_NL || qtype == T_MXFP4, five = five_bits(qtype);
    const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(q + 256)) : _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 64 * p));
        v[p] = _mm256_and_si256(w, m4);
        v[p + 4] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        if (table) v[p] = _mm256_shuffle_epi8(tab, v[p]), v[p + 4] = _mm256_shuffle_epi8(tab, v[p + 4]);
        if (five)
            v[p] = _mm256_or_si256(v[p], fifth256(hb, 2 * p)), v[p + 4] = _mm256_or_si256(v[p + 4], fifth256(hb, 2 * p + 1));
    }
}

/* The 256-bit forms' float step for one activation row's block b: its integer sum s times d_w·d_x, then (where the type
 * has minimums, mins: the 8 rows' f16) m_w·s_x */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256 nib_float256(__m256i s, __m256 d, const uint8_t *mins, const Row *r, int64_t b, __m256 acc) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(r->d[b])), acc);
    if (mins) acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mins)), _mm256_set1_ps(r->s[b]), acc);
    return acc;
}

/* The same in AVX-VNNI: each 64-byte vector's two 8-row halves, dpbusd on 256 bits */
__attribute__((target(AVXVNNI_TARGET), always_inline))
static inline void nib_x16_avxvnni(const int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o,
                                   int64_t ldo, const int T, Ahead *ah) {
    const int mn = has_min(qtype), bq = block_quants(qtype), off = offset_of(qtype);
    const uint8_t *mins = g + 32 * nb, *qv = g + quants_at(qtype, nb);
    const __m256i tab = _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table_of(qtype))),
                                        _mm256_set1_epi8((char)0x80));
    __m256 acc[X16_TILE][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        ahead_step(ah, bq + 32 + 32 * mn);
        int32_t base[X16_TILE];
        for (int i = 0; i < T; i++) base[i] = off ? -off * quant_sum(rows[i].q + b * 32) : 0;
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            __m256i v[8];
            nib_values256(qtype, qv + bq * b + 32 * h, tab, v);
            const __m256 d = qtype == T_MXFP4 ? e8m0_half8(g + 32 * b + 8 * h)
                                              : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 * b + 16 * h)));
            for (int i = 0; i < T; i++) {
                const int8_t *x = rows[i].q + b * 32;
                __m256i s0 = _mm256_set1_epi32(base[i]), s1 = _mm256_setzero_si256();
                for (int p = 0; p < 4; p++) {
                    s0 = _mm256_dpbusd_avx_epi32(s0, v[p], _mm256_set1_epi32(*(const int32_t *)(x + 4 * p)));
                    s1 = _mm256_dpbusd_avx_epi32(s1, v[p + 4], _mm256_set1_epi32(*(const int32_t *)(x + 16 + 4 * p)));
                }
                acc[i][h] = nib_float256(_mm256_add_epi32(s0, s1), d, mn ? mins + 32 * b + 16 * h : NULL, &rows[i], b,
                                         acc[i][h]);
            }
        }
    }
    store_x16_avx2(acc, o, ldo, T);
}

/* The same in AVX2: maddubs of the unsigned nibbles (Q4_0 from −8·Σx, Q4_1) or of |v| and x·sign(v) (the tables) */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void nib_x16_avx2(const int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o,
                                int64_t ldo, const int T, Ahead *ah) {
    const int mn = has_min(qtype), bq = block_quants(qtype), table = qtype == T_IQ4_NL || qtype == T_MXFP4;
    /* maddubs results summed in int16 before madd widens them: IQ4_NL's pairs reach 2·127·127, five bits' 2·31·127 */
    const int run = qtype == T_IQ4_NL ? 1 : five_bits(qtype) ? 4 : 8;
    const uint8_t *mins = g + 32 * nb, *qv = g + quants_at(qtype, nb);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table_of(qtype)));
    __m256 acc[X16_TILE][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        ahead_step(ah, bq + 32 + 32 * mn);
        int32_t base[X16_TILE];  /* the unsigned values' offset; the tables' values go in signed */
        for (int i = 0; i < T; i++) base[i] = table || mn ? 0 : -offset_of(qtype) * quant_sum(rows[i].q + b * 32);
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            __m256i v[8];
            nib_values256(qtype, qv + bq * b + 32 * h, tab, v);
            __m256i u[8];
            for (int j = 0; j < 8; j++) u[j] = table ? _mm256_abs_epi8(v[j]) : v[j];
            const __m256 d = qtype == T_MXFP4 ? e8m0_half8(g + 32 * b + 8 * h)
                                              : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32 * b + 16 * h)));
            for (int i = 0; i < T; i++) {
                const int8_t *x = rows[i].q + b * 32;
                __m256i s32 = _mm256_set1_epi32(base[i]), s16 = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(x + 4 * j));  /* v[j]: values 4j … */
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[j], table ? _mm256_sign_epi8(xb, v[j]) : xb));
                    if ((j + 1) % run == 0)
                        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(s16, ones)), s16 = _mm256_setzero_si256();
                }
                acc[i][h] = nib_float256(s32, d, mn ? mins + 32 * b + 16 * h : NULL, &rows[i], b, acc[i][h]);
            }
        }
    }
    store_x16_avx2(acc, o, ldo, T);
}

/* one form's entry: the type and the tile's row count made constants */
#define NIB_CASES(FN, QT)                                                                                         \
    switch (tn) {                                                                                                 \
    case 1: FN(QT, g, nb, rows, o, ldo, 1, ah); break;                                                            \
    case 2: FN(QT, g, nb, rows, o, ldo, 2, ah); break;                                                            \
    case 3: FN(QT, g, nb, rows, o, ldo, 3, ah); break;                                                            \
    default: FN(QT, g, nb, rows, o, ldo, 4, ah); break;                                                           \
    }
#define NIB_ENTRY(NAME, TARGET, FN)                                                                               \
    __attribute__((target(TARGET))) void NAME(int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o, \
                                              int64_t ldo, int tn, Ahead *ah) {                                   \
        switch (qtype) {                                                                                          \
        case T_Q4_0: NIB_CASES(FN, T_Q4_0) break;                                                                 \
        case T_Q4_1: NIB_CASES(FN, T_Q4_1) break;                                                                 \
        case T_Q5_0: NIB_CASES(FN, T_Q5_0) break;                                                                 \
        case T_Q5_1: NIB_CASES(FN, T_Q5_1) break;                                                                 \
        case T_IQ4_NL: NIB_CASES(FN, T_IQ4_NL) break;                                                             \
        default: NIB_CASES(FN, T_MXFP4) break;                                                                    \
        }                                                                                                         \
    }
NIB_ENTRY(nib_x16_group_vnni, NIB_VNNI_TARGET, nib_x16)
NIB_ENTRY(nib_x16_group_avxvnni, AVXVNNI_TARGET, nib_x16_avxvnni)
NIB_ENTRY(nib_x16_group_avx2, AVX2_TARGET, nib_x16_avx2)
#endif

/* The 16-row interleaved ("packed") layout of Q4_K, Q5_K, Q6_K and Q8_0 weights for AVX512-VNNI, AVX-VNNI and AVX2:
 * repacking the stored blocks, and the products over the packed groups in the three forms (the same bits); the
 * 32-value nibble types', IQ4_XS's and Q2_K / Q3_K's groups are packed_nib.c's, packed_iq4_xs.c's and
 * packed_q23_k.c's, repacked and driven from here. */
#include <omp.h>
#include "kernels.h"

#if defined(__x86_64__)
/* ---- packed: 16 rows interleaved, for AVX512-VNNI (and AVX2, below) -----------------------------------
 *
 * A packed weight (repack_x16) is made of groups of 16 rows (a row chunk of ROW_CHUNK = 16 rows; an expert's
 * matrix is whole groups), each group its rows' bytes (Q6_K: and a little padding): for each block index b the
 * 16 rows' blocks b are stored together, interleaved so that int32 lane l of every vector belongs to row l. A dpbusd of a vector of
 * values against a broadcast of 4 activation quants then adds 4 products for each of the 16 rows, and every
 * scale, min and float step that the per-row layout took once per row (a madd, a conversion, two fmadds per row
 * and block) is one instruction for 16 rows. The integers are those of the stored layout; each output's float
 * sum is one lane accumulated block by block (as ggml's dot products do, and unlike the stored layout's lanes
 * reduced at the end), the same whatever the number of activation rows.
 *
 * Q4_K group block (16 · 144 bytes): d [16] fp16, dmin [16] fp16; the 12 scale bytes of each row as three 32-bit
 * words, word w of row l at 64 + 4 (16 w + l); then per sub-block j (32 values) four 64-byte vectors p, byte 4l + e
 * = value 32j + 4p + e of row l | value 32j + 16 + 4p + e << 4.
 * Q5_K group block (16 · 176 bytes): Q4_K's, then per sub-block j a 64-byte vector of the values' fifth bits, byte
 * 4l + e holding those of values 32j + 4p + e at bit 2p and 32j + 16 + 4p + e at bit 2p + 1 (p < 4): one shift and
 * mask puts each under its nibble.
 * Q6_K group block (Q6K_GROUP_BYTES: 16 · 210 bytes and 32 of padding, 212 per row and block): per 32 values u
 * (sub-blocks 2u, 2u+1), in pairs of u in the order the kernel reads them (Q6K_UNIT: with the low nibbles, the high
 * bits and the scales in three regions of the block, products reading from memory ran at about half the speed),
 * four 64-byte vectors p of low nibbles as Q4_K's, two vectors h of high bit pairs, byte 4l + e holding bits 4-5 of value 32u + 4(h + 2s) + e at bits 2s, 2s+1
 * (s < 4), and the two sub-blocks' int8 scales, [sub-block][row]; at 3328 d [16] fp16.
 * Q8_0 group (16 rows of nb blocks, 16 · nb · 34 bytes): the scales, [block][row] as f16, then per block eight
 * 64-byte vectors v, byte 4l + e = quant 4v + e of row l offset by 128 (unsigned, as dpbusd takes it; each
 * block's sum starts from −128 · Σx, so each lane is the exact Σ w·x). */
_Static_assert(GROUP == ROW_CHUNK, "the products' row chunks are the packed groups");
/* a packed Q6_K group block: 16 · 210 bytes and 32 of padding, so that every group block starts on a cache line
 * and no 64-byte load of it straddles two */
#define Q6K_GROUP_BYTES 3392
/* where the bytes of values 32u … 32u+31 start in a packed Q6_K group block: pairs of them (832 bytes, whole lines) */
#define Q6K_UNIT(u) (832 * ((u) / 2) + 256 * ((u) & 1))

/* The 16 bytes (as two words) of a packed nibble vector row: for t < 16, nibble `shift` of q[t] | of q[16 + t] << 4
 * (values t and 16 + t of a 32-value run: the four dwords go to vectors p = 0…3 of the run) */
static inline void nibble_pairs(const uint8_t *q, int shift, uint64_t o[2]) {
    const uint64_t m = 0x0F0F0F0F0F0F0F0FULL;
    uint64_t w[4];
    memcpy(w, q, 32);
    o[0] = ((w[0] >> shift) & m) | (((w[2] >> shift) & m) << 4);
    o[1] = ((w[1] >> shift) & m) | (((w[3] >> shift) & m) << 4);
}

/* dword p of a row's 16 bytes into lane l of vector p (64 bytes apart) */
static inline void to_lanes(const uint64_t o[2], uint8_t *vec, int l) {
    for (int p = 0; p < 4; p++) memcpy(vec + 64 * p + 4 * l, (const uint8_t *)o + 4 * p, 4);
}

/* a packed Q4_K (five = 0) or Q5_K (five = 1) group block's bytes, and a stored block's */
#define QK_GROUP_BYTES(five) (GROUP * (144 + 32 * (five)))

static void repack_q4k_group(const uint8_t *src, int64_t nb, uint8_t *dst, int five) {
    const int64_t bytes = 144 + 32 * five;
    for (int l = 0; l < GROUP; l++) {
        const uint8_t *b = src + l * nb * bytes, *qs = b + 16 + 32 * five;
        memcpy(dst + 2 * l, b, 2);
        memcpy(dst + 32 + 2 * l, b + 2, 2);
        for (int w = 0; w < 3; w++) memcpy(dst + 64 + 4 * (GROUP * w + l), b + 4 + 4 * w, 4);
        /* sub-block j: the low (j even) or high nibbles of quant bytes 32 (j / 2) … */
        for (int j = 0; j < 8; j++) {
            uint64_t o[2];
            nibble_pairs(qs + 32 * (j / 2), 4 * (j % 2), o);
            to_lanes(o, dst + 256 + 256 * j, l);
            /* Q5_K: value 32j + t's fifth bit is bit j of qh[t] */
            for (int e = 0; five && e < 4; e++) {
                uint8_t h = 0;
                for (int p = 0; p < 4; p++)
                    h |= (uint8_t)((((b[16 + 4 * p + e] >> j) & 1) << (2 * p)) | (((b[32 + 4 * p + e] >> j) & 1) << (2 * p + 1)));
                dst[GROUP * 144 + 64 * j + 4 * l + e] = h;
            }
        }
    }
}

static void repack_q6k_group(const uint8_t *src, int64_t nb, uint8_t *dst) {
    const uint64_t m3 = 0x0303030303030303ULL;
    for (int l = 0; l < GROUP; l++) {
        const uint8_t *b = src + l * nb * 210, *ql = b, *qh = b + 128;
        for (int u = 0; u < 8; u++) {
            /* values 32u + t, t < 32: in half n = u / 4, quarter qq = u % 4 of ggml's layout, low 4 bits in nibble
             * qq / 2 of ql[64n + 32 (qq % 2) + t], high 2 bits at bits 2qq of qh[32n + t] */
            const int n = u / 4, qq = u % 4;
            uint8_t *lo = dst + Q6K_UNIT(u), *hi = lo + 512 - 128 * (u & 1), *sc = lo + 768 - 224 * (u & 1);
            uint64_t o[2];
            nibble_pairs(ql + 64 * n + 32 * (qq % 2), 4 * (qq / 2), o);
            to_lanes(o, lo, l);
            uint64_t w[4];
            memcpy(w, qh + 32 * n, 32);
            /* byte 4h + e: the high bits of values t = 4h + 8s + e, s < 4, at bits 2s */
            const uint64_t h8 = ((w[0] >> 2 * qq) & m3) | (((w[1] >> 2 * qq) & m3) << 2) |
                                (((w[2] >> 2 * qq) & m3) << 4) | (((w[3] >> 2 * qq) & m3) << 6);
            memcpy(hi + 4 * l, &h8, 4);
            memcpy(hi + 64 + 4 * l, (const uint8_t *)&h8 + 4, 4);
            sc[l] = b[192 + 2 * u];
            sc[GROUP + l] = b[192 + 2 * u + 1];
        }
        memcpy(dst + 3328 + 2 * l, b + 208, 2);
    }
    memset(dst + 3328 + 2 * GROUP, 0, Q6K_GROUP_BYTES - 3328 - 2 * GROUP);
}

static void repack_q8_0_group(const uint8_t *src, int64_t nb, uint8_t *dst) {
    uint8_t *q = dst + 2 * GROUP * nb;
    for (int l = 0; l < GROUP; l++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + (l * nb + b) * 34;
            memcpy(dst + 2 * (GROUP * b + l), blk, 2);
            uint64_t w[4];
            memcpy(w, blk + 2, 32);
            for (int v = 0; v < 4; v++) w[v] ^= 0x8080808080808080ULL;  /* + 128: unsigned, as dpbusd takes it */
            for (int v = 0; v < 8; v++) memcpy(q + 512 * b + 64 * v + 4 * l, (const uint8_t *)w + 4 * v, 4);
        }
}

/* n_rows (a multiple of 16) rows of nb blocks each, stored, into the packed layout (the native-avx512vnni and
 * native-avx2 backends); dst holds packed_x16_bytes(qtype) per row and block. */
static int nibble_type(int qtype) {
    return qtype == T_Q4_0 || qtype == T_Q4_1 || qtype == T_Q5_0 || qtype == T_Q5_1 || qtype == T_IQ4_NL ||
           qtype == T_MXFP4;
}

int64_t packed_x16_bytes(int qtype) {
    if (nibble_type(qtype)) return packed_nib_bytes(qtype);
    switch (qtype) {
    case T_Q8_0: return 34;
    case T_Q4_K: return QK_GROUP_BYTES(0) / GROUP;
    case T_Q5_K: return QK_GROUP_BYTES(1) / GROUP;
    case T_IQ4_XS: return packed_iq4_xs_bytes();
    case T_Q2_K: case T_Q3_K: return packed_q23_k_bytes(qtype);
    default: return Q6K_GROUP_BYTES / GROUP;
    }
}

void repack_x16(int qtype, const uint8_t *src, int64_t n_rows, int64_t nb, uint8_t *dst, int n_threads) {
    const int64_t n_groups = n_rows / GROUP;
    if (qtype == T_Q8_0 || nibble_type(qtype)) {  /* a group laid out whole (its scales first) */
        const int64_t bytes = qtype == T_Q8_0 ? 34 : qtype == T_MXFP4 ? 17 : packed_nib_bytes(qtype);  /* stored */
        const int64_t packed = packed_x16_bytes(qtype);
        #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
        for (int64_t g = 0; g < n_groups; g++) {
            if (qtype == T_Q8_0) repack_q8_0_group(src + g * GROUP * nb * bytes, nb, dst + g * GROUP * nb * packed);
            else repack_nib_group(qtype, src + g * GROUP * nb * bytes, nb, dst + g * GROUP * nb * packed);
        }
        return;
    }
    const int64_t bytes = qtype == T_Q4_K ? 144 : qtype == T_Q5_K ? 176 : qtype == T_IQ4_XS ? 136 : qtype == T_Q2_K ? 84
                        : qtype == T_Q3_K ? 110 : 210;
    const int64_t group_bytes = GROUP * packed_x16_bytes(qtype);
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (int64_t gb = 0; gb < n_groups * nb; gb++) {
        const int64_t g = gb / nb, b = gb % nb;
        const uint8_t *s = src + (g * GROUP * nb + b) * bytes;
        uint8_t *d = dst + (g * nb + b) * group_bytes;
        if (qtype == T_Q4_K || qtype == T_Q5_K) repack_q4k_group(s, nb, d, qtype == T_Q5_K);
        else if (qtype == T_IQ4_XS) repack_iq4_xs_group(s, nb, d);
        else if (qtype == T_Q2_K || qtype == T_Q3_K) repack_q23_k_group(qtype, s, nb, d);
        else repack_q6k_group(s, nb, d);
    }
}

/* 4 activation quants broadcast to every lane */
#define BCAST4(p) _mm512_set1_epi32(*(const int32_t *)(p))

/* Σ over 16 activation quants x of the value vectors v[0..3] (4 values of each of 16 rows per vector): two chains of
 * two dpbusd (integers: any grouping gives the same sums) */
__attribute__((target(VNNI_TARGET), always_inline))
static inline __m512i dot16_x16(const __m512i *v, const int8_t *x) {
    __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], BCAST4(x));
    __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[1], BCAST4(x + 4));
    s0 = _mm512_dpbusd_epi32(s0, v[2], BCAST4(x + 8));
    s1 = _mm512_dpbusd_epi32(s1, v[3], BCAST4(x + 12));
    return _mm512_add_epi32(s0, s1);
}

/* T activation rows (a constant once inlined) times one group of 16 packed Q4_K rows (five: Q5_K's, their values'
 * fifth bits or'ed in): o[i · ldo + l]. */
__attribute__((target(VNNI_TARGET), always_inline))
static inline void qk_x16(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                          Ahead *ah, const int five) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3f = _mm512_set1_epi32(0x3f3f3f3f), m0f = _mm512_set1_epi32(0x0f0f0f0f),
                  m03 = _mm512_set1_epi32(0x03030303), ff = _mm512_set1_epi32(0xFF);
    __m512 acc[X16_TILE_WIDE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * QK_GROUP_BYTES(five);
        const __m512i u0 = _mm512_loadu_si512(blk + 64), u1 = _mm512_loadu_si512(blk + 128),
                      u2 = _mm512_loadu_si512(blk + 192);
        /* per lane (row): bytes sc0..3, sc4..7, mn0..3, mn4..7, as q4_k_scales decodes one row */
        const __m512i sc[2] = {_mm512_and_si512(u0, m3f),
                               _mm512_or_si512(_mm512_and_si512(u2, m0f),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), m03), 4))};
        const __m512i mn03 = _mm512_and_si512(u1, m3f);
        const __m512i mn47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m0f),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), m03), 4));
        __m512i isum[X16_TILE_WIDE];
        for (int i = 0; i < T; i++) isum[i] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            ahead_step(ah, QK_GROUP_BYTES(five) / 8);
            const uint8_t *qv = blk + 256 + 256 * j;
            __m512i v[8];
            for (int p = 0; p < 4; p++) {
                const __m512i q = _mm512_loadu_si512(qv + 64 * p);
                v[p] = _mm512_and_si512(q, m4);
                v[p + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                if (five) {
                    const __m512i hb = _mm512_loadu_si512(blk + GROUP * 144 + 64 * j);
                    v[p] = _mm512_or_si512(v[p], fifth512(hb, 2 * p));
                    v[p + 4] = _mm512_or_si512(v[p + 4], fifth512(hb, 2 * p + 1));
                }
            }
            const __m512i scj = _mm512_and_si512(_mm512_srli_epi32(sc[j / 4], 8 * (j % 4)), ff);
            for (int i = 0; i < T; i++) {
                const int8_t *x = rows[i].q + b * QK_K + 32 * j;
                const __m512i dot = _mm512_add_epi32(dot16_x16(v, x), dot16_x16(v + 4, x + 16));
                isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(dot, scj));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        for (int i = 0; i < T; i++) {
            /* Σ_j min_j · (sum of the sub-block's 32 quants), that sum split into 7 low bits and the rest so that
             * both fit dpbusd's signed bytes: exact integers, as ggml's */
            const __m256i s32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(rows[i].bs + b * 16)),
                                                  _mm256_set1_epi16(1));
            const __m128i lo = _mm256_cvtepi32_epi8(_mm256_and_si256(s32, _mm256_set1_epi32(127)));
            const __m128i hi = _mm256_cvtepi32_epi8(_mm256_srai_epi32(s32, 7));
            __m512i ml = _mm512_dpbusd_epi32(_mm512_setzero_si512(), mn03, _mm512_set1_epi32(_mm_extract_epi32(lo, 0)));
            ml = _mm512_dpbusd_epi32(ml, mn47, _mm512_set1_epi32(_mm_extract_epi32(lo, 1)));
            __m512i mh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), mn03, _mm512_set1_epi32(_mm_extract_epi32(hi, 0)));
            mh = _mm512_dpbusd_epi32(mh, mn47, _mm512_set1_epi32(_mm_extract_epi32(hi, 1)));
            const __m512i msum = _mm512_add_epi32(ml, _mm512_slli_epi32(mh, 7));
            const __m512 dx = _mm512_set1_ps(rows[i].d[b]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, dx), acc[i]);
            acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), acc[i]);
        }
    }
    for (int i = 0; i < T; i++) _mm512_storeu_ps(o + i * ldo, acc[i]);
}

__attribute__((target(VNNI_TARGET), always_inline))
static inline void q4_k_x16(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                            Ahead *ah) { qk_x16(g, nb, rows, o, ldo, T, ah, 0); }
__attribute__((target(VNNI_TARGET), always_inline))
static inline void q5_k_x16(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                            Ahead *ah) { qk_x16(g, nb, rows, o, ldo, T, ah, 1); }

/* The same for packed Q6_K: values q (0…63) against the quants, times the sub-block's scale, less 32 · the
 * sub-blocks' sums of 16 quants times their scales: Σ_j sc_j dot_j − 32 Σ_j sc_j bsum_j, the integer of the stored
 * layout's products. */
__attribute__((target(VNNI_TARGET), always_inline))
static inline void q6_k_x16(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                            Ahead *ah) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[X16_TILE_WIDE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * Q6K_GROUP_BYTES;
        __m512i isum[X16_TILE_WIDE], ssum[X16_TILE_WIDE];
        for (int i = 0; i < T; i++) isum[i] = ssum[i] = _mm512_setzero_si512();
        for (int u = 0; u < 8; u++) {
            ahead_step(ah, Q6K_GROUP_BYTES / 8);
            const uint8_t *lo = blk + Q6K_UNIT(u), *hb = lo + 512 - 128 * (u & 1), *scb8 = lo + 768 - 224 * (u & 1);
            const __m512i h0 = _mm512_loadu_si512(hb), h1 = _mm512_loadu_si512(hb + 64);
            __m512i v[8];
            for (int p = 0; p < 4; p++) {
                const __m512i q = _mm512_loadu_si512(lo + 64 * p);
                v[p] = _mm512_and_si512(q, m4);
                v[p + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            }
            /* value group g's high bits: vector g % 2, bits 2s, 2s+1 with s = g / 2, moved to bits 4-5 */
            v[0] = _mm512_ternarylogic_epi32(v[0], _mm512_slli_epi16(h0, 4), m30, 0xF8);
            v[1] = _mm512_ternarylogic_epi32(v[1], _mm512_slli_epi16(h1, 4), m30, 0xF8);
            v[2] = _mm512_ternarylogic_epi32(v[2], _mm512_slli_epi16(h0, 2), m30, 0xF8);
            v[3] = _mm512_ternarylogic_epi32(v[3], _mm512_slli_epi16(h1, 2), m30, 0xF8);
            v[4] = _mm512_ternarylogic_epi32(v[4], h0, m30, 0xF8);
            v[5] = _mm512_ternarylogic_epi32(v[5], h1, m30, 0xF8);
            v[6] = _mm512_ternarylogic_epi32(v[6], _mm512_srli_epi16(h0, 2), m30, 0xF8);
            v[7] = _mm512_ternarylogic_epi32(v[7], _mm512_srli_epi16(h1, 2), m30, 0xF8);
            const __m512i sca = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)scb8)),
                          scb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(scb8 + 16)));
            /* the two sub-blocks' scales as an int16 pair per lane, for Σ_j sc_j · bsum_j by dpwssd */
            const __m512i scp = _mm512_or_si512(_mm512_and_si512(sca, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(scb, 16));
            for (int i = 0; i < T; i++) {
                const int8_t *x = rows[i].q + b * QK_K + 32 * u;
                isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(dot16_x16(v, x), sca),
                                                                     _mm512_mullo_epi32(dot16_x16(v + 4, x + 16), scb)));
                ssum[i] = _mm512_dpwssd_epi32(ssum[i], scp, BCAST4(rows[i].bs + b * 16 + 2 * u));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 3328)));
        for (int i = 0; i < T; i++) {
            const __m512i p = _mm512_sub_epi32(isum[i], _mm512_slli_epi32(ssum[i], 5));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, _mm512_set1_ps(rows[i].d[b])), acc[i]);
        }
    }
    for (int i = 0; i < T; i++) _mm512_storeu_ps(o + i * ldo, acc[i]);
}

/* The same for a packed Q8_0 group (blocks of 32; rows[i].d: the activation row's Q8_0 scales). */
__attribute__((target(VNNI_TARGET), always_inline))
static inline void q8_0_x16(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                            Ahead *ah) {
    const uint8_t *qv = g + 2 * GROUP * nb;
    const __m256i ones = _mm256_set1_epi8(1);
    __m512 acc[X16_TILE_WIDE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[8];
        ahead_step(ah, 512 + 2 * GROUP);
        for (int v = 0; v < 8; v++) w[v] = _mm512_loadu_si512(qv + 512 * b + 64 * v);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 2 * GROUP * b)));
        for (int i = 0; i < T; i++) {
            const int8_t *x = rows[i].q + b * 32;
            const __m256i sx = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, _mm256_loadu_si256((const __m256i *)x));
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sx), _mm256_extracti128_si256(sx, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
            const __m512i dot = _mm512_add_epi32(_mm512_add_epi32(dot16_x16(w, x), dot16_x16(w + 4, x + 16)),
                                                 _mm512_set1_epi32(-128 * _mm_cvtsi128_si32(h)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(rows[i].d[b])), acc[i]);
        }
    }
    for (int i = 0; i < T; i++) _mm512_storeu_ps(o + i * ldo, acc[i]);
}

/* ---- the same products in AVX2 (native-avx2) -------------------------------------------------------------
 *
 * Each 64-byte vector is read as two 32-byte halves, rows 0-7 and rows 8-15: both against the same broadcast quants
 * where the registers allow it, else one half after the other within a block.
 * maddubs sums pairs of unsigned values times signed quants into int16 and madd widens them, by one or by a scale
 * in both int16 halves of a lane: the exact int32 lanes dpbusd makes, no sum near int16's range (Q4_K: 8 pairs of
 * at most 2·15·127; Q6_K: 2 pairs of at most 2·63·127; Q8_0 the stored AVX2 product's |w| and x·sign(w), one pair
 * of at most 2·128·127, the activation quants being within ±127). The float work after the integers is the VNNI
 * form's, lane by lane: the same bits. */

/* pshufb patterns taking bytes a and b of each 32-bit lane to its two int16 halves (zero-extended): (j, j) for
 * j < 4 (a sub-block's scale), (0, 1) and (2, 3) (pairs of mins). Loaded from a table: built in registers from a
 * loop index they cost more than the products. */
#define SPREAD_LANE(a, b) a, -128, b, -128, 4 + a, -128, 4 + b, -128, 8 + a, -128, 8 + b, -128, 12 + a, -128, 12 + b, -128
#define SPREAD(a, b) {SPREAD_LANE(a, b), SPREAD_LANE(a, b)}
static const int8_t spread16[6][32] __attribute__((aligned(32))) = {SPREAD(0, 0), SPREAD(1, 1), SPREAD(2, 2),
                                                                    SPREAD(3, 3), SPREAD(0, 1), SPREAD(2, 3)};
#define SPREAD16(i) _mm256_load_si256((const __m256i *)spread16[i])

/* Σ over 8 activation quants x of the value vectors v[0], v[1] (4 values of each of 8 rows per vector): int16 pairs */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i dot8_x8(const __m256i *v, const int8_t *x) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(v[0], _mm256_set1_epi32(*(const int32_t *)x)),
                            _mm256_maddubs_epi16(v[1], _mm256_set1_epi32(*(const int32_t *)(x + 4))));
}

/* qk_x16 in AVX2: per sub-block, each vector's two halves against the same broadcast quants (Q5_K: the int16 sums
 * of four maddubs each, widened in two runs: five-bit values' pairs reach 2·31·127) */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void qk_x16_avx2(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                               Ahead *ah, const int five) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3f = _mm256_set1_epi32(0x3f3f3f3f), m0f = _mm256_set1_epi32(0x0f0f0f0f),
                  m03 = _mm256_set1_epi32(0x03030303), ones = _mm256_set1_epi16(1);
    __m256 acc[X16_TILE][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * QK_GROUP_BYTES(five);
        __m256i isum[X16_TILE][2];
        for (int i = 0; i < T; i++) isum[i][0] = isum[i][1] = _mm256_setzero_si256();
        /* not unrolled: unrolled, the compiler unpacked all 8 sub-blocks ahead and spilled them */
        _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) {
            ahead_step(ah, QK_GROUP_BYTES(five) / 8);
            const uint8_t *qv = blk + 256 + 256 * j;
            __m256i s16[X16_TILE][4];  /* [h]: vectors 0-3 (Q5_K: 0-1), [2 + h]: Q5_K's 2-3 */
            for (int i = 0; i < T; i++) s16[i][0] = s16[i][1] = s16[i][2] = s16[i][3] = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                __m256i lo[2], hi[2];
                const int run = five && p >= 2 ? 2 : 0;
                for (int h = 0; h < 2; h++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(qv + 64 * p + 32 * h));
                    lo[h] = _mm256_and_si256(q, m4);
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    if (five) {
                        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + GROUP * 144 + 64 * j + 32 * h));
                        lo[h] = _mm256_or_si256(lo[h], fifth256(hb, 2 * p));
                        hi[h] = _mm256_or_si256(hi[h], fifth256(hb, 2 * p + 1));
                    }
                }
                for (int i = 0; i < T; i++) {
                    const int8_t *x = rows[i].q + b * QK_K + 32 * j + 4 * p;
                    const __m256i xl = _mm256_set1_epi32(*(const int32_t *)x),
                                  xh = _mm256_set1_epi32(*(const int32_t *)(x + 16));
                    for (int h = 0; h < 2; h++)
                        s16[i][run + h] = _mm256_add_epi16(s16[i][run + h],
                                                           _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                                            _mm256_maddubs_epi16(hi[h], xh)));
                }
            }
            for (int h = 0; h < 2; h++) {
                /* sub-block j's scale of each row, in both int16 halves of its lane */
                const __m256i u0 = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * h));
                const __m256i sc = j < 4 ? _mm256_and_si256(u0, m3f)
                                         : _mm256_or_si256(_mm256_and_si256(_mm256_loadu_si256(
                                                               (const __m256i *)(blk + 192 + 32 * h)), m0f),
                                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6),
                                                                                              m03), 4));
                const __m256i scj = _mm256_shuffle_epi8(sc, SPREAD16(j % 4));
                for (int i = 0; i < T; i++) {
                    isum[i][h] = _mm256_add_epi32(isum[i][h], _mm256_madd_epi16(s16[i][h], scj));
                    if (five) isum[i][h] = _mm256_add_epi32(isum[i][h], _mm256_madd_epi16(s16[i][2 + h], scj));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            /* the mins as int16 pairs (mn0, mn1) … (mn6, mn7) per lane, against each row's sums of 32 quants as
             * int16 pairs (s0, s1) … (s6, s7) broadcast */
            const __m256i u1 = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)),
                          u2 = _mm256_loadu_si256((const __m256i *)(blk + 192 + 32 * h));
            const __m256i mn03 = _mm256_and_si256(u1, m3f);
            const __m256i mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m0f),
                                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m03), 4));
            const __m256i mn[4] = {_mm256_shuffle_epi8(mn03, SPREAD16(4)), _mm256_shuffle_epi8(mn03, SPREAD16(5)),
                                   _mm256_shuffle_epi8(mn47, SPREAD16(4)), _mm256_shuffle_epi8(mn47, SPREAD16(5))};
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)));
            for (int i = 0; i < T; i++) {
                const __m256i s32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(rows[i].bs + b * 16)), ones);
                const __m256i s16 = _mm256_packs_epi32(s32, s32);  /* dwords 0, 1 of each 128-bit lane: s0…s3 | s4…s7 */
                __m256i msum = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++)
                    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mn[k], _mm256_permutevar8x32_epi32(
                                                                       s16, _mm256_set1_epi32(k % 2 + 4 * (k / 2)))));
                const __m256 dx = _mm256_set1_ps(rows[i].d[b]);
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][h]), _mm256_mul_ps(d, dx), acc[i][h]);
                acc[i][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), acc[i][h]);
            }
        }
    }
    store_x16_avx2(acc, o, ldo, T);
}

__attribute__((target(AVX2_TARGET), always_inline))
static inline void q4_k_x16_avx2(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                                 Ahead *ah) { qk_x16_avx2(g, nb, rows, o, ldo, T, ah, 0); }
__attribute__((target(AVX2_TARGET), always_inline))
static inline void q5_k_x16_avx2(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                                 Ahead *ah) { qk_x16_avx2(g, nb, rows, o, ldo, T, ah, 1); }

/* q6_k_x16 in AVX2 for one activation row (a decode step): per 32 values, each vector's two halves against the same
 * broadcast quants (more rows keep their sums in registers better one half at a time, as q6_k_x16_avx2 goes) */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void q6_k_x16_avx2_row(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                                 Ahead *ah) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[X16_TILE][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * Q6K_GROUP_BYTES;
        __m256i isum[X16_TILE][2], ssum[X16_TILE][2];
        for (int i = 0; i < T; i++) isum[i][0] = isum[i][1] = ssum[i][0] = ssum[i][1] = _mm256_setzero_si256();
        _Pragma("GCC unroll 1") for (int u = 0; u < 8; u++) {
            ahead_step(ah, Q6K_GROUP_BYTES / 8);
            const uint8_t *lo = blk + Q6K_UNIT(u), *hb = lo + 512 - 128 * (u & 1), *scb8 = lo + 768 - 224 * (u & 1);
            __m256i sca[2], scb[2];
            for (int h = 0; h < 2; h++) {
                /* the 8 rows' scales of the two sub-blocks as int16 pairs (a, a), (b, b) per lane, and (a, b) for
                 * Σ_j sc_j · bsum_j */
                const __m128i a8 = _mm_loadl_epi64((const __m128i *)(scb8 + 8 * h)),
                              b8 = _mm_loadl_epi64((const __m128i *)(scb8 + GROUP + 8 * h));
                sca[h] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a8, a8));
                scb[h] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b8, b8));
                const __m256i scp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a8, b8));
                for (int i = 0; i < T; i++)
                    ssum[i][h] = _mm256_add_epi32(ssum[i][h], _mm256_madd_epi16(
                        scp, _mm256_set1_epi32(*(const int32_t *)(rows[i].bs + b * 16 + 2 * u))));
            }
            /* vectors p = 2pp, 2pp+1: low nibbles values 4p + e (sub-block a), high nibbles 16 + 4p + e (b); the
             * high bits of value group g in vector g % 2 of hb, bits 2s, 2s+1 with s = g / 2, moved to bits 4-5 */
            for (int pp = 0; pp < 2; pp++) {
                __m256i v[2][4];
                for (int h = 0; h < 2; h++)
                    for (int e = 0; e < 2; e++) {
                        const __m256i q = _mm256_loadu_si256((const __m256i *)(lo + 64 * (2 * pp + e) + 32 * h)),
                                      hh = _mm256_loadu_si256((const __m256i *)(hb + 64 * e + 32 * h));
                        v[h][e] = _mm256_or_si256(_mm256_and_si256(q, m4),
                                                  _mm256_and_si256(pp ? _mm256_slli_epi16(hh, 2) : _mm256_slli_epi16(hh, 4),
                                                                   m30));
                        v[h][2 + e] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                                                      _mm256_and_si256(pp ? _mm256_srli_epi16(hh, 2) : hh, m30));
                    }
                for (int i = 0; i < T; i++) {
                    const int8_t *x = rows[i].q + b * QK_K + 32 * u + 8 * pp;
                    const __m256i x0 = _mm256_set1_epi32(*(const int32_t *)x),
                                  x1 = _mm256_set1_epi32(*(const int32_t *)(x + 4)),
                                  x2 = _mm256_set1_epi32(*(const int32_t *)(x + 16)),
                                  x3 = _mm256_set1_epi32(*(const int32_t *)(x + 20));
                    for (int h = 0; h < 2; h++) {
                        const __m256i da = _mm256_add_epi16(_mm256_maddubs_epi16(v[h][0], x0),
                                                            _mm256_maddubs_epi16(v[h][1], x1)),
                                      db = _mm256_add_epi16(_mm256_maddubs_epi16(v[h][2], x2),
                                                            _mm256_maddubs_epi16(v[h][3], x3));
                        isum[i][h] = _mm256_add_epi32(isum[i][h], _mm256_add_epi32(_mm256_madd_epi16(da, sca[h]),
                                                                                   _mm256_madd_epi16(db, scb[h])));
                    }
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 3328 + 16 * h)));
            for (int i = 0; i < T; i++) {
                const __m256i p = _mm256_sub_epi32(isum[i][h], _mm256_slli_epi32(ssum[i][h], 5));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d, _mm256_set1_ps(rows[i].d[b])),
                                            acc[i][h]);
            }
        }
    }
    store_x16_avx2(acc, o, ldo, T);
}

/* The 8 value vectors (0…63, 4 values of each of 8 rows per vector) of half h (rows 8h … 8h+7) of a packed Q6_K
 * unit's 32 values: the low nibbles at lo, the high bit pairs at hb (already offset to the half) */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void q6_k_half_values(const uint8_t *lo, const uint8_t *hb, int h, __m256i *v) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i h0 = _mm256_loadu_si256((const __m256i *)hb), h1 = _mm256_loadu_si256((const __m256i *)(hb + 64));
    for (int p = 0; p < 4; p++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(lo + 64 * p + 32 * h));
        v[p] = _mm256_and_si256(q, m4);
        v[p + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
    /* value group g's high bits: vector g % 2, bits 2s, 2s+1 with s = g / 2, moved to bits 4-5 */
    v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(h0, 4), m30));
    v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(h1, 4), m30));
    v[2] = _mm256_or_si256(v[2], _mm256_and_si256(_mm256_slli_epi16(h0, 2), m30));
    v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_slli_epi16(h1, 2), m30));
    v[4] = _mm256_or_si256(v[4], _mm256_and_si256(h0, m30));
    v[5] = _mm256_or_si256(v[5], _mm256_and_si256(h1, m30));
    v[6] = _mm256_or_si256(v[6], _mm256_and_si256(_mm256_srli_epi16(h0, 2), m30));
    v[7] = _mm256_or_si256(v[7], _mm256_and_si256(_mm256_srli_epi16(h1, 2), m30));
}

/* q6_k_x16 in AVX2: half h (rows 8h … 8h+7) of each group block in turn */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void q6_k_x16_avx2(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                                 Ahead *ah) {
    if (T == 1) {
        q6_k_x16_avx2_row(g, nb, rows, o, ldo, 1, ah);
        return;
    }
    __m256 acc[X16_TILE][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * Q6K_GROUP_BYTES;
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            __m256i isum[X16_TILE], ssum[X16_TILE];
            for (int i = 0; i < T; i++) isum[i] = ssum[i] = _mm256_setzero_si256();
            _Pragma("GCC unroll 1") for (int u = 0; u < 8; u++) {
                if (h == 0) ahead_step(ah, Q6K_GROUP_BYTES / 8);
                const uint8_t *lo = blk + Q6K_UNIT(u), *hb = lo + 512 - 128 * (u & 1) + 32 * h,
                              *scb8 = lo + 768 - 224 * (u & 1) + 8 * h;
                __m256i v[8];
                q6_k_half_values(lo, hb, h, v);
                /* the 8 rows' scales of the two sub-blocks as int16 pairs: (a, a), (b, b) and (a, b) per lane */
                const __m128i a8 = _mm_loadl_epi64((const __m128i *)scb8),
                              b8 = _mm_loadl_epi64((const __m128i *)(scb8 + GROUP));
                const __m256i sca = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a8, a8)),
                              scb = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b8, b8)),
                              scp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a8, b8));
                for (int i = 0; i < T; i++) {
                    const int8_t *x = rows[i].q + b * QK_K + 32 * u;
                    const __m256i da = _mm256_add_epi32(_mm256_madd_epi16(dot8_x8(v, x), sca),
                                                        _mm256_madd_epi16(dot8_x8(v + 2, x + 8), sca));
                    const __m256i db = _mm256_add_epi32(_mm256_madd_epi16(dot8_x8(v + 4, x + 16), scb),
                                                        _mm256_madd_epi16(dot8_x8(v + 6, x + 24), scb));
                    isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(da, db));
                    ssum[i] = _mm256_add_epi32(ssum[i], _mm256_madd_epi16(
                        scp, _mm256_set1_epi32(*(const int32_t *)(rows[i].bs + b * 16 + 2 * u))));
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 3328 + 16 * h)));
            for (int i = 0; i < T; i++) {
                const __m256i p = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(ssum[i], 5));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d, _mm256_set1_ps(rows[i].d[b])),
                                            acc[i][h]);
            }
        }
    }
    store_x16_avx2(acc, o, ldo, T);
}

/* q8_0_x16 in AVX2: the quants back to signed (w = v − 128), Σ w·x as the stored AVX2 product takes it */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void q8_0_x16_avx2(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T,
                                 Ahead *ah) {
    const uint8_t *qv = g + 2 * GROUP * nb;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[X16_TILE][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        ahead_step(ah, 512 + 2 * GROUP);
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            __m256i w[8], aw[8];
            for (int v = 0; v < 8; v++) {
                w[v] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qv + 512 * b + 64 * v + 32 * h)), flip);
                aw[v] = _mm256_abs_epi8(w[v]);
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 2 * GROUP * b + 16 * h)));
            for (int i = 0; i < T; i++) {
                const int8_t *x = rows[i].q + b * 32;
                __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int v = 0; v < 8; v++) {
                    const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(*(const int32_t *)(x + 4 * v)), w[v]);
                    s[v & 1] = _mm256_add_epi32(s[v & 1], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[v], xs), ones));
                }
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s[0], s[1])),
                                            _mm256_mul_ps(d, _mm256_set1_ps(rows[i].d[b])), acc[i][h]);
            }
        }
    }
    store_x16_avx2(acc, o, ldo, T);
}

/* ---- the same products in AVX-VNNI (VEX dpbusd/dpwssd on 256 bits: native-avxvnni) -------------------------
 *
 * The AVX2 forms' halves, with the integer steps that AVX-VNNI folds: Q4_K's and Q6_K's values against the quants
 * by dpbusd (a sub-block's exact int32 sum, then times its scale, as the VNNI form), Q8_0's offset quants by dpbusd
 * as the VNNI form takes them. The integers are the other forms'; the float work is the AVX2
 * form's, lane by lane: the same bits. */

/* q4_k_x16 in AVX-VNNI: per sub-block, each row's values against its 32 quants in int32 lanes by dpbusd (two chains
 * where few activation rows leave the latency uncovered), times the sub-block's scale */
__attribute__((target(AVXVNNI_TARGET), always_inline))
static inline void qk_x16_avxvnni(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo,
                                  const int T, Ahead *ah, const int five) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3f = _mm256_set1_epi32(0x3f3f3f3f), m0f = _mm256_set1_epi32(0x0f0f0f0f),
                  m03 = _mm256_set1_epi32(0x03030303), ff = _mm256_set1_epi32(0xFF), ones = _mm256_set1_epi16(1);
    const int chains = T <= 2 ? 2 : 1;
    __m256 acc[X16_TILE][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * QK_GROUP_BYTES(five);
        __m256i isum[X16_TILE][2];
        for (int i = 0; i < T; i++) isum[i][0] = isum[i][1] = _mm256_setzero_si256();
        _Pragma("GCC unroll 1") for (int j = 0; j < 8; j++) {
            ahead_step(ah, QK_GROUP_BYTES(five) / 8);
            const uint8_t *qv = blk + 256 + 256 * j;
            __m256i s32[X16_TILE][2][2];
            for (int i = 0; i < T; i++)
                for (int h = 0; h < 2; h++) s32[i][h][0] = s32[i][h][1] = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                __m256i lo[2], hi[2];
                for (int h = 0; h < 2; h++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(qv + 64 * p + 32 * h));
                    lo[h] = _mm256_and_si256(q, m4);
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    if (five) {
                        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + GROUP * 144 + 64 * j + 32 * h));
                        lo[h] = _mm256_or_si256(lo[h], fifth256(hb, 2 * p));
                        hi[h] = _mm256_or_si256(hi[h], fifth256(hb, 2 * p + 1));
                    }
                }
                for (int i = 0; i < T; i++) {
                    const int8_t *x = rows[i].q + b * QK_K + 32 * j + 4 * p;
                    const __m256i xl = _mm256_set1_epi32(*(const int32_t *)x),
                                  xh = _mm256_set1_epi32(*(const int32_t *)(x + 16));
                    for (int h = 0; h < 2; h++) {
                        s32[i][h][0] = _mm256_dpbusd_avx_epi32(s32[i][h][0], lo[h], xl);
                        s32[i][h][chains - 1] = _mm256_dpbusd_avx_epi32(s32[i][h][chains - 1], hi[h], xh);
                    }
                }
            }
            for (int h = 0; h < 2; h++) {
                /* sub-block j's scale of each row, as an int32 lane */
                const __m256i u0 = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * h));
                const __m256i sc = j < 4 ? _mm256_and_si256(u0, m3f)
                                         : _mm256_or_si256(_mm256_and_si256(_mm256_loadu_si256(
                                                               (const __m256i *)(blk + 192 + 32 * h)), m0f),
                                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6),
                                                                                              m03), 4));
                const __m256i scj = _mm256_and_si256(_mm256_srli_epi32(sc, 8 * (j % 4)), ff);
                for (int i = 0; i < T; i++) {
                    const __m256i dot = chains == 2 ? _mm256_add_epi32(s32[i][h][0], s32[i][h][1]) : s32[i][h][0];
                    isum[i][h] = _mm256_add_epi32(isum[i][h], _mm256_mullo_epi32(dot, scj));
                }
            }
        }
        for (int h = 0; h < 2; h++) {  /* the mins as the AVX2 form takes them */
            const __m256i u1 = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)),
                          u2 = _mm256_loadu_si256((const __m256i *)(blk + 192 + 32 * h));
            const __m256i mn03 = _mm256_and_si256(u1, m3f);
            const __m256i mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m0f),
                                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m03), 4));
            const __m256i mn[4] = {_mm256_shuffle_epi8(mn03, SPREAD16(4)), _mm256_shuffle_epi8(mn03, SPREAD16(5)),
                                   _mm256_shuffle_epi8(mn47, SPREAD16(4)), _mm256_shuffle_epi8(mn47, SPREAD16(5))};
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)));
            for (int i = 0; i < T; i++) {
                const __m256i s32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(rows[i].bs + b * 16)), ones);
                const __m256i s16 = _mm256_packs_epi32(s32, s32);
                __m256i msum = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++)
                    msum = _mm256_dpwssd_avx_epi32(msum, mn[k], _mm256_permutevar8x32_epi32(
                                                                    s16, _mm256_set1_epi32(k % 2 + 4 * (k / 2))));
                const __m256 dx = _mm256_set1_ps(rows[i].d[b]);
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][h]), _mm256_mul_ps(d, dx), acc[i][h]);
                acc[i][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), acc[i][h]);
            }
        }
    }
    store_x16_avx2(acc, o, ldo, T);
}

__attribute__((target(AVXVNNI_TARGET), always_inline))
static inline void q4_k_x16_avxvnni(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo,
                                    const int T, Ahead *ah) { qk_x16_avxvnni(g, nb, rows, o, ldo, T, ah, 0); }
__attribute__((target(AVXVNNI_TARGET), always_inline))
static inline void q5_k_x16_avxvnni(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo,
                                    const int T, Ahead *ah) { qk_x16_avxvnni(g, nb, rows, o, ldo, T, ah, 1); }

/* q6_k_x16 in AVX-VNNI: half h (rows 8h … 8h+7) of each group block in turn; per 32 values, each row's values against
 * its quants by dpbusd into one int32 sum per sub-block (the AVX2 form's int16 pairs, widened), times the sub-block's
 * scale; the scales against the sums of 16 quants by dpwssd */
__attribute__((target(AVXVNNI_TARGET), always_inline))
static inline void q6_k_x16_avxvnni(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo,
                                    const int T, Ahead *ah) {
    if (T == 1) {  /* one row: the AVX2 row form, both halves per 32 values (bench/results/products_avxvnni.json) */
        q6_k_x16_avx2_row(g, nb, rows, o, ldo, 1, ah);
        return;
    }
    __m256 acc[X16_TILE][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * Q6K_GROUP_BYTES;
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            __m256i isum[X16_TILE], ssum[X16_TILE];
            for (int i = 0; i < T; i++) isum[i] = ssum[i] = _mm256_setzero_si256();
            _Pragma("GCC unroll 1") for (int u = 0; u < 8; u++) {
                if (h == 0) ahead_step(ah, Q6K_GROUP_BYTES / 8);
                const uint8_t *lo = blk + Q6K_UNIT(u), *hb = lo + 512 - 128 * (u & 1) + 32 * h,
                              *scb8 = lo + 768 - 224 * (u & 1) + 8 * h;
                __m256i v[8];
                q6_k_half_values(lo, hb, h, v);
                const __m128i a8 = _mm_loadl_epi64((const __m128i *)scb8),
                              b8 = _mm_loadl_epi64((const __m128i *)(scb8 + GROUP));
                const __m256i sca = _mm256_cvtepi8_epi32(a8), scb = _mm256_cvtepi8_epi32(b8),
                              scp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a8, b8));
                for (int i = 0; i < T; i++) {
                    const int8_t *x = rows[i].q + b * QK_K + 32 * u;
                    __m256i da = _mm256_setzero_si256(), db = _mm256_setzero_si256();
                    for (int p = 0; p < 4; p++) {
                        da = _mm256_dpbusd_avx_epi32(da, v[p], _mm256_set1_epi32(*(const int32_t *)(x + 4 * p)));
                        db = _mm256_dpbusd_avx_epi32(db, v[p + 4], _mm256_set1_epi32(*(const int32_t *)(x + 16 + 4 * p)));
                    }
                    isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_mullo_epi32(da, sca),
                                                                         _mm256_mullo_epi32(db, scb)));
                    ssum[i] = _mm256_dpwssd_avx_epi32(ssum[i], scp,
                                                      _mm256_set1_epi32(*(const int32_t *)(rows[i].bs + b * 16 + 2 * u)));
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 3328 + 16 * h)));
            for (int i = 0; i < T; i++) {
                const __m256i p = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(ssum[i], 5));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d, _mm256_set1_ps(rows[i].d[b])),
                                            acc[i][h]);
            }
        }
    }
    store_x16_avx2(acc, o, ldo, T);
}

/* q8_0_x16 in AVX-VNNI: the offset quants as stored against the quants by dpbusd (two chains), from −128·Σx */
__attribute__((target(AVXVNNI_TARGET), always_inline))
static inline void q8_0_x16_avxvnni(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo,
                                    const int T, Ahead *ah) {
    const uint8_t *qv = g + 2 * GROUP * nb;
    const __m256i ones = _mm256_set1_epi8(1);
    __m256 acc[X16_TILE][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        ahead_step(ah, 512 + 2 * GROUP);
        __m256i base[X16_TILE];
        for (int i = 0; i < T; i++) {
            const __m256i sx = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ones,
                                                       _mm256_loadu_si256((const __m256i *)(rows[i].q + b * 32)));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sx), _mm256_extracti128_si256(sx, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
            base[i] = _mm256_set1_epi32(-128 * _mm_cvtsi128_si32(t));
        }
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            __m256i w[8];
            for (int v = 0; v < 8; v++) w[v] = _mm256_loadu_si256((const __m256i *)(qv + 512 * b + 64 * v + 32 * h));
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 2 * GROUP * b + 16 * h)));
            for (int i = 0; i < T; i++) {
                const int8_t *x = rows[i].q + b * 32;
                __m256i s[2] = {base[i], _mm256_setzero_si256()};
                for (int v = 0; v < 8; v++)
                    s[v & 1] = _mm256_dpbusd_avx_epi32(s[v & 1], w[v], _mm256_set1_epi32(*(const int32_t *)(x + 4 * v)));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s[0], s[1])),
                                            _mm256_mul_ps(d, _mm256_set1_ps(rows[i].d[b])), acc[i][h]);
            }
        }
    }
    store_x16_avx2(acc, o, ldo, T);
}

#define X16_CASES(FN)                                                                                             \
    switch (tn) {                                                                                                 \
    case 1: FN(g, nb, rows, o, ldo, 1, ahead); break;                                                             \
    case 2: FN(g, nb, rows, o, ldo, 2, ahead); break;                                                             \
    case 3: FN(g, nb, rows, o, ldo, 3, ahead); break;                                                             \
    default: FN(g, nb, rows, o, ldo, 4, ahead); break;                                                            \
    }
#define X16_CASES_WIDE(FN)                                                                                        \
    switch (tn) {                                                                                                 \
    case 1: FN(g, nb, rows, o, ldo, 1, ahead); break;                                                             \
    case 2: FN(g, nb, rows, o, ldo, 2, ahead); break;                                                             \
    case 3: FN(g, nb, rows, o, ldo, 3, ahead); break;                                                             \
    case 4: FN(g, nb, rows, o, ldo, 4, ahead); break;                                                             \
    case 5: FN(g, nb, rows, o, ldo, 5, ahead); break;                                                             \
    default: FN(g, nb, rows, o, ldo, 6, ahead); break;                                                            \
    }

/* The activation rows of the next pass over a group, of `left`, at most `tile`: in the wide tile the passes evened out
 * (on 2 cores AVX512-VNNI, 4096 x 1024: 5 rows in one pass of Q4_K / Q6_K 12 % faster than 4 + 1, 9 as 5 + 4 5 %
 * faster than 6 + 3; the 4-row forms gained nothing from it) */
static inline int64_t tile_rows(int64_t left, int64_t tile) {
    if (tile < X16_TILE_WIDE || left <= tile) return left < tile ? left : tile;
    const int64_t passes = (left + tile - 1) / tile;
    return (left + passes - 1) / passes;
}

/* Packed weight rows [r0, r1) times activation rows xrow[0..m) (0..m when NULL), in one instruction-set form (the
 * suffix of its products: _x16 VNNI, _x16_avxvnni, _x16_avx2; NIB: packed_nib.c's, IQ4: packed_iq4_xs.c's, Q23:
 * packed_q23_k.c's). Groups of 16 rows; a matrix whose rows are not whole groups ends in one packed with zero rows
 * (NativeLinear.pack), its real rows' outputs copied out of a group's worth. */
#define X16_DRIVER(NAME, TARGET, SUFFIX, NIB, IQ4, Q23, WIDE, CASES)                                               \
    __attribute__((target(TARGET))) static void NAME(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0,   \
                                                     int64_t r1, const Acts *a, const int64_t *xrow, int64_t m,     \
                                                     float *out, int64_t ldy, Ahead *ahead) {                     \
        const int64_t nb = a->k / (act_format(qtype) == ACT_Q8_K ? QK_K : 32);                                    \
        Row rows[X16_TILE_WIDE];                                                                                  \
        float part[X16_TILE_WIDE * GROUP];                                                                        \
        const int64_t tile = WIDE && (qtype == T_Q4_K_PACKED || qtype == T_Q5_K_PACKED || qtype == T_Q6_K_PACKED \
                                      || qtype == T_Q8_0_PACKED) ? X16_TILE_WIDE : X16_TILE;                      \
        for (int64_t rc = r0; rc < r1; rc += GROUP) {                                                             \
            const uint8_t *g = w + rc * row_bytes;                                                                \
            const int64_t real = r1 - rc < GROUP ? r1 - rc : GROUP;                                               \
            const int64_t ldo = real < GROUP ? GROUP : ldy;                                                       \
            for (int64_t t0 = 0, tn; t0 < m; t0 += tn) {                                                          \
                tn = tile_rows(m - t0, tile);                                                                     \
                for (int64_t i = 0; i < tn; i++) {                                                                \
                    const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;                                              \
                    rows[i] = (Row){a->q + xr * a->k, a->d + xr * nb, a->bs ? a->bs + xr * nb * 16 : NULL,        \
                                    a->s ? a->s + xr * nb : NULL};                                                \
                }                                                                                                 \
                float *o = real < GROUP ? part : out + t0 * ldy + rc;                                             \
                if (nibble_type(qtype - PACKED_BASE)) {                                                           \
                    NIB(qtype - PACKED_BASE, g, nb, rows, o, ldo, (int)tn, ahead);                                \
                } else if (qtype == T_Q2_K_PACKED || qtype == T_Q3_K_PACKED) {                                    \
                    Q23(qtype - PACKED_BASE, g, nb, rows, o, ldo, (int)tn, ahead);                                \
                } else if (qtype == T_IQ4_XS_PACKED) {                                                            \
                    IQ4(g, nb, rows, o, ldo, (int)tn, ahead);                                                     \
                } else if (qtype == T_Q4_K_PACKED) {                                                              \
                    CASES(q4_k##SUFFIX)                                                                           \
                } else if (qtype == T_Q5_K_PACKED) {                                                              \
                    CASES(q5_k##SUFFIX)                                                                           \
                } else if (qtype == T_Q8_0_PACKED) {                                                              \
                    CASES(q8_0##SUFFIX)                                                                           \
                } else {                                                                                          \
                    CASES(q6_k##SUFFIX)                                                                           \
                }                                                                                                 \
                for (int64_t i = 0; real < GROUP && i < tn; i++)                                                  \
                    memcpy(out + (t0 + i) * ldy + rc, part + i * GROUP, (size_t)real * sizeof(float));            \
            }                                                                                                     \
        }                                                                                                         \
    }
X16_DRIVER(rows_times_x16_vnni, VNNI_TARGET, _x16, nib_x16_group_vnni, iq4_xs_x16_group_vnni, q23_k_x16_group_vnni, 1,
           X16_CASES_WIDE)
X16_DRIVER(rows_times_x16_avx2, AVX2_TARGET, _x16_avx2, nib_x16_group_avx2, iq4_xs_x16_group_avx2,
           q23_k_x16_group_avx2, 0, X16_CASES)
X16_DRIVER(rows_times_x16_avxvnni, AVXVNNI_TARGET, _x16_avxvnni, nib_x16_group_avxvnni,
           iq4_xs_x16_group_avxvnni, q23_k_x16_group_avxvnni, 0, X16_CASES)

void rows_times_x16(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                    const int64_t *xrow, int64_t m, float *out, int64_t ldo, Ahead *ahead, int isa) {
    if (isa_runs(isa, ISA_VNNI)) rows_times_x16_vnni(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo, ahead);
    else if (isa_runs(isa, ISA_AVXVNNI)) rows_times_x16_avxvnni(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo, ahead);
    else if (isa_runs(isa, ISA_AVX2)) rows_times_x16_avx2(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo, ahead);
}
#endif

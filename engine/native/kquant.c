/* K-quant products on the CPU, the way llama.cpp's CPU backend computes them.
 *
 * A Q4_K or Q6_K weight multiplies activations quantized to Q8_K (blocks of 256, float scale, sums per
 * 16): per block an exact integer dot product per sub-block, weighted by the sub-block's integer scale,
 * then scaled in float. Each weight block is unpacked once and multiplied by every activation row while
 * it is in L1, so a pass over N tokens reads the weights once, not N times.
 *
 * Bits: the integer sums are exact whatever the instruction set; the float work for an output element
 * (one weight row times one activation row) runs in the same order whatever the number of rows, the
 * grouping of rows or the thread split. Row i of a multi-token pass is bit-identical to a one-token pass.
 *
 * Loaded with ctypes (engine/nativelib.py, used by engine/kquant.py); no Python API. Threads: OpenMP (torch's runtime, which the
 * process has already loaded).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define QK 256
#define M_TILE 64
#define ROW_CHUNK 16  /* weight rows per work item, and per cross-lane sum (sum16) */
enum { T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };  /* ggml type ids */
/* Q4_K and Q6_K weights packed by kq_repack, 16 rows interleaved (not ggml types: ours, for the VNNI products) */
enum { T_Q8_0_PACKED = 108, T_Q4_K_PACKED = 112, T_Q6_K_PACKED = 114 };

/* q8_0.c: Q8_0 weight rows (stored blocks) times Q8_0 activation rows */
void q8_rows_times(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const int8_t *xq, const float *xd,
                   int64_t k, const int64_t *xrow, int64_t m, float *out, int64_t ldo, int portable);


static float fp16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- activations -------------------------------------------------------------------------------- */

/* ggml quantize_row_q8_K: per block of 256, scale from the signed extreme (first of equal magnitudes),
 * q = round-half-even(−127/max · x) capped at 127, d = 1/iscale, and the sums of q per 16. */
static void quantize_q8k_block(const float *xb, int8_t *qb, float *d, int16_t *bsums) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < QK; j++) {
        float ax = fabsf(xb[j]);
        if (ax > amax) { amax = ax; max = xb[j]; }
    }
    if (amax == 0.f) {
        *d = 0.f;
        memset(qb, 0, QK);
        memset(bsums, 0, 16 * sizeof(int16_t));
        return;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < QK; j++) {
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

int kq_isa(void);

void kq_quantize_q8k(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, int16_t *bsums, int portable) {
    const int64_t nb = k / QK;
#if defined(__x86_64__)
    if (!portable && kq_isa() == 1) {
        for (int64_t i = 0; i < m_rows * nb; i++)
            quantize_q8k_block_avx512(x + i * QK, q + i * QK, d + i, bsums + i * 16);
        return;
    }
#endif
    for (int64_t i = 0; i < m_rows * nb; i++) quantize_q8k_block(x + i * QK, q + i * QK, d + i, bsums + i * 16);
}

/* ---- weight blocks ------------------------------------------------------------------------------ */

/* A weight block unpacked for the dot products: unsigned values v[256] in natural order, the integer
 * scale of each group of 4 values (lane scales, one per int32 lane of a dot product), the float factors,
 * and the integer sub-block weights of the activation sums (Q4_K: mins per 32; Q6_K: scales per 16). */
typedef struct {
    uint8_t v[QK];
    int32_t lane[QK / 4];
    int32_t corr[16];  /* weight of bsum16[j] in the correction term */
    float d, dmin;
} Block;

static void unpack_q4_k(const uint8_t *b, Block *o) {
    const uint8_t *s = b + 4, *qs = b + 16;
    o->d = fp16(b);
    o->dmin = fp16(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        if (j < 4) {
            sc = s[j] & 63;
            mn = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        for (int l = 0; l < 8; l++) o->lane[j * 8 + l] = sc;
        o->corr[2 * j] = o->corr[2 * j + 1] = mn;
    }
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            o->v[64 * c + l] = qs[32 * c + l] & 0xF;
            o->v[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    }
}

static void unpack_q6_k(const uint8_t *b, Block *o) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    o->d = fp16(b + 208);
    o->dmin = 0.f;
    for (int j = 0; j < 16; j++) {
        for (int l = 0; l < 4; l++) o->lane[j * 4 + l] = sc[j];
        o->corr[j] = 32 * sc[j];  /* the stored values are q + 32 */
    }
    for (int n = 0; n < 2; n++) {
        const uint8_t *a = ql + 64 * n, *h = qh + 32 * n;
        uint8_t *v = o->v + 128 * n;
        for (int l = 0; l < 32; l++) {
            v[l] = (a[l] & 0xF) | ((h[l] & 3) << 4);
            v[l + 32] = (a[l + 32] & 0xF) | (((h[l] >> 2) & 3) << 4);
            v[l + 64] = (a[l] >> 4) | (((h[l] >> 4) & 3) << 4);
            v[l + 96] = (a[l + 32] >> 4) | (((h[l] >> 6) & 3) << 4);
        }
    }
}

/* ---- Σ_lanes lane_scale · (4-value dot product), exact int32 -------------------------------------- */

static int32_t dot_scalar(const Block *w, const int8_t *x) {
    int32_t s = 0;
    for (int i = 0; i < QK / 4; i++) {
        int32_t p = 0;
        for (int j = 0; j < 4; j++) p += (int32_t)w->v[4 * i + j] * x[4 * i + j];
        s += p * w->lane[i];
    }
    return s;
}

typedef struct {
    const int8_t *q;  /* [rows, k] */
    const float *d;  /* [rows, k/256] */
    const int16_t *bs;  /* [rows, k/16] */
    int64_t k;
} Acts;

/* AVX512BW products: a weight block is unpacked into registers once and multiplied by every activation
 * row of the tile (maddubs: u8 values × s8 quants → 16-bit pair sums; madd by the 16-bit sub-block scales
 * → int32), each row's float sum kept as 16 lanes until the end of the weight row. Q4_K takes the quants
 * in the nibble order of its blocks: per 64-value half, sub-blocks (0,2,1,3) then (4,6,5,7) (kq_q4k_order).
 * Measured and not kept: dpbusd then mullo by 32-bit scales on AVX512-VNNI (the same speed: two multiplies
 * per 64 values either way); the mins' term as per-block float weights of the activations' scaled sums of
 * 16 (no faster, and its rounding, unlike ggml's integer Σ min·bsum, doubled the KL to llama.cpp). */
#if defined(__x86_64__)
#define AVX512_TARGET "avx512f,avx512bw,f16c"

typedef struct {
    const int8_t *q;  /* the row's quants, block 0 */
    const float *d;  /* its block scales */
    const int16_t *bs;  /* its sums of 16 quants */
} Row;

__attribute__((target(AVX512_TARGET)))
static inline float fp16_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* A Q4_K block's 6-bit scales and mins, 8 of each, as bytes sc0..7, mn0..7 */
__attribute__((target(AVX512_TARGET)))
static inline __m128i q4_k_scales(const uint8_t *blk) {
    uint32_t u[3];
    memcpy(u, blk + 4, 12);
    return _mm_setr_epi32((int)(u[0] & 0x3f3f3f3f), (int)((u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4)),
                          (int)(u[1] & 0x3f3f3f3f), (int)(((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4)));
}

/* A Q6_K block's 256 values (q + 32, 0…63) as four vectors of 64 bytes in the order the block stores them:
 * vector 2n takes the low nibbles of ql[64n…] with qh[32n…] bits 0-1 (first 32) and 2-3, vector 2n + 1 the
 * high nibbles with bits 4-5 and 6-7 (the natural order). */
__attribute__((target(AVX512_TARGET)))
static inline void q6_k_values(const uint8_t *blk, __m512i *v) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
    for (int n = 0; n < 2; n++) {
        const __m512i q = _mm512_loadu_si512(blk + 64 * n);
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
        const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
        v[2 * n] = _mm512_or_si512(_mm512_and_si512(q, m4), _mm512_slli_epi16(_mm512_and_si512(hh, m3), 4));
        v[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hh, 4), m3), 4));
    }
}

/* Σ over a row's four 64-value vectors of scale·value·quant, int32 lanes */
__attribute__((target(AVX512_TARGET)))
static inline __m512i row_sum(const __m512i *v, const __m512i *s, const int8_t *x) {
    const __m512i p0 = _mm512_madd_epi16(_mm512_maddubs_epi16(v[0], _mm512_loadu_si512(x)), s[0]);
    const __m512i p1 = _mm512_madd_epi16(_mm512_maddubs_epi16(v[1], _mm512_loadu_si512(x + 64)), s[1]);
    const __m512i p2 = _mm512_madd_epi16(_mm512_maddubs_epi16(v[2], _mm512_loadu_si512(x + 128)), s[2]);
    const __m512i p3 = _mm512_madd_epi16(_mm512_maddubs_epi16(v[3], _mm512_loadu_si512(x + 192)), s[3]);
    return _mm512_add_epi32(_mm512_add_epi32(p0, p1), _mm512_add_epi32(p2, p3));
}

/* Per block: the exact Σ scale·value·quant of each activation row (row_sum), then the float step as ggml computes
 * it: p · d·d_x, less the mins' term Σ min·bsum (integers, each min twice: one per sum of 16) · dmin·d_x. Q4_K takes
 * the quants in its nibble order (kq_q4k_order). */
__attribute__((target(AVX512_TARGET)))
static void rows_q4_k(const uint8_t *row, int64_t nb, const Row *rows, int64_t tn, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i im = _mm512_castsi256_si512(_mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14,
                                                                14, 15, 15));
    /* 16-bit lanes of [sc0..7, mn0..7] picked for each product: the scales of the two sub-blocks a 64-value
     * vector holds (lanes 0-15, 16-31) */
    const __m512i id16[4] = {_mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1),
                             _mm512_inserti64x4(_mm512_set1_epi16(1), _mm256_set1_epi16(3), 1),
                             _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1),
                             _mm512_inserti64x4(_mm512_set1_epi16(5), _mm256_set1_epi16(7), 1)};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 144;
        const float d = fp16_f16c(blk), dmin = fp16_f16c(blk + 2);
        const __m512i w16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(q4_k_scales(blk)));
        const __m256i mins = _mm512_castsi512_si256(_mm512_permutexvar_epi16(im, w16));
        const __m512i q0 = _mm512_loadu_si512(blk + 16), q1 = _mm512_loadu_si512(blk + 80);
        /* vectors 0, 1: low, high nibbles of the first 64 quant bytes; 2, 3: of the second 64 */
        const __m512i v[4] = {_mm512_and_si512(q0, m4), _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4),
                              _mm512_and_si512(q1, m4), _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4)};
        __m512i s[4];
        for (int c = 0; c < 4; c++) s[c] = _mm512_permutexvar_epi16(id16[c], w16);
        for (int64_t i = 0; i < tn; i++) {
            const __m512i p = row_sum(v, s, rows[i].q + b * QK);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(rows[i].bs + b * 16));
            const __m256 c = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins));
            const float dx = rows[i].d[b];
            const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(dx * d), acc[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_zextps256_ps512(c), _mm512_set1_ps(-dx * dmin), f);
        }
    }
}

/* Per block: each activation row's exact Σ scale·value·quant (row_sum; the stored values are q + 32, so 32 · Σ
 * sc·bsum comes off), then p scaled by d·d_x into the sum. */
__attribute__((target(AVX512_TARGET)))
static void rows_q6_k(const uint8_t *row, int64_t nb, const Row *rows, int64_t tn, __m512 *acc) {
    /* lane i of 32 (2 values each) of a 64-value vector belongs to its sub-block of 16: i / 8 */
    const __m512i idx0 = _mm512_setr_epi32(0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00010001, 0x00010001,
                                           0x00010001, 0x00010001, 0x00020002, 0x00020002, 0x00020002, 0x00020002,
                                           0x00030003, 0x00030003, 0x00030003, 0x00030003);
    const __m512i id16[4] = {idx0, _mm512_add_epi16(idx0, _mm512_set1_epi16(4)),
                             _mm512_add_epi16(idx0, _mm512_set1_epi16(8)), _mm512_add_epi16(idx0, _mm512_set1_epi16(12))};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210;
        const float d = fp16_f16c(blk + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        __m512i v[4], s[4];
        q6_k_values(blk, v);
        for (int t = 0; t < 4; t++) s[t] = _mm512_permutexvar_epi16(id16[t], _mm512_castsi256_si512(sc16));
        for (int64_t i = 0; i < tn; i++) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(rows[i].bs + b * 16));
            const __m256i c = _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5);
            const __m512i p = _mm512_sub_epi32(row_sum(v, s, rows[i].q + b * QK), _mm512_zextsi256_si512(c));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(rows[i].d[b] * d), acc[i]);
        }
    }
}

/* Weight bytes requested ahead of the row being multiplied. The hardware prefetcher alone left the products
 * waiting on memory between a thread's short runs of rows (a routed expert's slice is a few KiB to a few
 * hundred). In in-process A/B runs on the mid-size MoE, 4 KiB ahead cut the routed experts' time of a 4-token
 * pass by about a quarter while other processes loaded the memory bus, and changed nothing measurable when the
 * host was quiet (2, 8 and 16 KiB: no better). Past the end of a matrix the requests are wasted, never faulting. */
#define PREFETCH_BYTES 4096

#define VNNI_TARGET "avx512f,avx512bw,avx512vl,f16c,avx512vnni"

/* ---- packed: 16 rows interleaved, for AVX512-VNNI ----------------------------------------------------
 *
 * A packed weight (kq_repack) is made of groups of 16 rows (a row chunk of ROW_CHUNK = 16 rows; an expert's
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
 * Q6_K group block (Q6K_GROUP_BYTES: 16 · 210 bytes and 32 of padding, 212 per row and block): per 32 values u
 * (sub-blocks 2u, 2u+1), in pairs of u in the order the kernel reads them (Q6K_UNIT: with the low nibbles, the high
 * bits and the scales in three regions of the block, products reading from memory ran at about half the speed),
 * four 64-byte vectors p of low nibbles as Q4_K's, two vectors h of high bit pairs, byte 4l + e holding bits 4-5 of value 32u + 4(h + 2s) + e at bits 2s, 2s+1
 * (s < 4), and the two sub-blocks' int8 scales, [sub-block][row]; at 3328 d [16] fp16.
 * Q8_0 group (16 rows of nb blocks, 16 · nb · 34 bytes): the scales, [block][row] as f16, then per block eight
 * 64-byte vectors v, byte 4l + e = quant 4v + e of row l offset by 128 (unsigned, as dpbusd takes it; each
 * block's sum starts from −128 · Σx, so each lane is the exact Σ w·x). */
#define GROUP 16
_Static_assert(GROUP == ROW_CHUNK, "the products' row chunks are the packed groups");
/* a packed Q6_K group block: 16 · 210 bytes and 32 of padding, so that every group block starts on a cache line
 * and no 64-byte load of it straddles two */
#define Q6K_GROUP_BYTES 3392
/* where the bytes of values 32u … 32u+31 start in a packed Q6_K group block: pairs of them (832 bytes, whole lines) */
#define Q6K_UNIT(u) (832 * ((u) / 2) + 256 * ((u) & 1))
#ifndef X16_PREFETCH
#define X16_PREFETCH 16384
#endif
#define X16_TILE 4  /* activation rows per pass over a group block (their sums stay in registers) */

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

static void repack_q4k_group(const uint8_t *src, int64_t nb, uint8_t *dst) {
    for (int l = 0; l < GROUP; l++) {
        const uint8_t *b = src + l * nb * 144;
        memcpy(dst + 2 * l, b, 2);
        memcpy(dst + 32 + 2 * l, b + 2, 2);
        for (int w = 0; w < 3; w++) memcpy(dst + 64 + 4 * (GROUP * w + l), b + 4 + 4 * w, 4);
        /* sub-block j: the low (j even) or high nibbles of quant bytes 32 (j / 2) … */
        for (int j = 0; j < 8; j++) {
            uint64_t o[2];
            nibble_pairs(b + 16 + 32 * (j / 2), 4 * (j % 2), o);
            to_lanes(o, dst + 256 + 256 * j, l);
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

/* n_rows (a multiple of 16) rows of nb blocks each, stored, into the packed layout (engine.kquant.packs: only where
 * the VNNI products run); dst holds kq_packed_bytes(qtype) per row and block. */
int64_t kq_packed_bytes(int qtype) { return qtype == T_Q8_0 ? 34 : qtype == T_Q4_K ? 144 : Q6K_GROUP_BYTES / GROUP; }

void kq_repack(int qtype, const uint8_t *src, int64_t n_rows, int64_t nb, uint8_t *dst, int n_threads) {
    const int64_t bytes = qtype == T_Q8_0 ? 34 : qtype == T_Q4_K ? 144 : 210, n_groups = n_rows / GROUP;
    if (qtype == T_Q8_0) {  /* a Q8_0 group is laid out whole (its scales first) */
        #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
        for (int64_t g = 0; g < n_groups; g++)
            repack_q8_0_group(src + g * GROUP * nb * bytes, nb, dst + g * GROUP * nb * bytes);
        return;
    }
    const int64_t group_bytes = qtype == T_Q4_K ? GROUP * 144 : Q6K_GROUP_BYTES;
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (int64_t gb = 0; gb < n_groups * nb; gb++) {
        const int64_t g = gb / nb, b = gb % nb;
        const uint8_t *s = src + (g * GROUP * nb + b) * bytes;
        uint8_t *d = dst + (g * nb + b) * group_bytes;
        if (qtype == T_Q4_K) repack_q4k_group(s, nb, d);
        else repack_q6k_group(s, nb, d);
    }
}

/* Part s of 8 of the group block PREFETCH_BYTES ahead of blk (bytes long): spread over the block's eight steps,
 * as a burst of all its lines at the block's start stalled on the core's outstanding misses. */
static inline void x16_prefetch(const uint8_t *blk, int64_t bytes, int s) {
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t c = s * lines / 8; c < (s + 1) * lines / 8; c++)
        _mm_prefetch((const char *)blk + X16_PREFETCH + 64 * c, _MM_HINT_T0);
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

/* T activation rows (a constant once inlined) times one group of 16 packed Q4_K rows: o[i · ldo + l]. */
__attribute__((target(VNNI_TARGET), always_inline))
static inline void q4_k_x16(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3f = _mm512_set1_epi32(0x3f3f3f3f), m0f = _mm512_set1_epi32(0x0f0f0f0f),
                  m03 = _mm512_set1_epi32(0x03030303), ff = _mm512_set1_epi32(0xFF);
    __m512 acc[X16_TILE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * GROUP * 144;
        const __m512i u0 = _mm512_loadu_si512(blk + 64), u1 = _mm512_loadu_si512(blk + 128),
                      u2 = _mm512_loadu_si512(blk + 192);
        /* per lane (row): bytes sc0..3, sc4..7, mn0..3, mn4..7, as q4_k_scales decodes one row */
        const __m512i sc[2] = {_mm512_and_si512(u0, m3f),
                               _mm512_or_si512(_mm512_and_si512(u2, m0f),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), m03), 4))};
        const __m512i mn03 = _mm512_and_si512(u1, m3f);
        const __m512i mn47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m0f),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), m03), 4));
        __m512i isum[X16_TILE];
        for (int i = 0; i < T; i++) isum[i] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            x16_prefetch(blk, GROUP * 144, j);
            const uint8_t *qv = blk + 256 + 256 * j;
            __m512i v[8];
            for (int p = 0; p < 4; p++) {
                const __m512i q = _mm512_loadu_si512(qv + 64 * p);
                v[p] = _mm512_and_si512(q, m4);
                v[p + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            }
            const __m512i scj = _mm512_and_si512(_mm512_srli_epi32(sc[j / 4], 8 * (j % 4)), ff);
            for (int i = 0; i < T; i++) {
                const int8_t *x = rows[i].q + b * QK + 32 * j;
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

/* The same for packed Q6_K: values q (0…63) against the quants, times the sub-block's scale, less 32 · the
 * sub-blocks' sums of 16 quants times their scales: Σ_j sc_j dot_j − 32 Σ_j sc_j bsum_j, the integer of the stored
 * layout's products. */
__attribute__((target(VNNI_TARGET), always_inline))
static inline void q6_k_x16(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[X16_TILE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * Q6K_GROUP_BYTES;
        __m512i isum[X16_TILE], ssum[X16_TILE];
        for (int i = 0; i < T; i++) isum[i] = ssum[i] = _mm512_setzero_si512();
        for (int u = 0; u < 8; u++) {
            x16_prefetch(blk, Q6K_GROUP_BYTES, u);
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
                const int8_t *x = rows[i].q + b * QK + 32 * u;
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
static inline void q8_0_x16(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, const int T) {
    const uint8_t *qv = g + 2 * GROUP * nb;
    const __m256i ones = _mm256_set1_epi8(1);
    __m512 acc[X16_TILE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[8];
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

#define X16_CASES(FN)                                                                                             \
    switch (tn) {                                                                                                 \
    case 1: FN(g, nb, rows, o, ldo, 1); break;                                                                    \
    case 2: FN(g, nb, rows, o, ldo, 2); break;                                                                    \
    case 3: FN(g, nb, rows, o, ldo, 3); break;                                                                    \
    default: FN(g, nb, rows, o, ldo, 4); break;                                                                   \
    }

/* Packed weight rows [r0, r1) (whole groups of 16) times activation rows xrow[0..m) (0..m when NULL). */
__attribute__((target(VNNI_TARGET)))
static void rows_times_x16(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                           const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    const int64_t nb = a->k / (qtype == T_Q8_0_PACKED ? 32 : QK);
    Row rows[X16_TILE];
    for (int64_t rc = r0; rc < r1; rc += GROUP) {
        const uint8_t *g = w + rc * row_bytes;
        for (int64_t t0 = 0; t0 < m; t0 += X16_TILE) {
            const int64_t tn = m - t0 < X16_TILE ? m - t0 : X16_TILE;
            for (int64_t i = 0; i < tn; i++) {
                const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
                rows[i] = (Row){a->q + xr * a->k, a->d + xr * nb, a->bs ? a->bs + xr * nb * 16 : NULL};
            }
            float *o = out + t0 * ldo + rc;
            if (qtype == T_Q4_K_PACKED) {
                X16_CASES(q4_k_x16)
            } else if (qtype == T_Q8_0_PACKED) {
                X16_CASES(q8_0_x16)
            } else {
                X16_CASES(q6_k_x16)
            }
        }
    }
}

/* Row r of the result is the horizontal sum of v[r], for 16 vectors at once, each with exactly the additions of
 * _mm512_reduce_add_ps (halves, then quarters, then pairs of the last four lanes: the same bits), in a
 * quarter of the instructions of 16 separate reductions and without their serial dependency chains. */
__attribute__((target(AVX512_TARGET)))
static inline __m512 sum16(const __m512 *v, int64_t stride) {
    __m512 b[8], c[4], d[2];
    for (int p = 0; p < 8; p++) {  /* lanes j + j+8: rows 2p | 2p+1 */
        const __m512 x = v[2 * p * stride], y = v[(2 * p + 1) * stride];
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int q = 0; q < 4; q++)  /* j + j+4: one row per quarter, rows 4q … 4q+3 */
        c[q] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], 0xDD));
    for (int s = 0; s < 2; s++)  /* lanes 0+2 and 1+3 of each quarter */
        d[s] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * s], c[2 * s + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * s], c[2 * s + 1], 0xEE));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    /* lane 4k + j of e holds row 4j + k */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, e);
}


/* Each thread's float sums of the weight rows of one chunk (≤ ROW_CHUNK) for the tile's activation rows,
 * [weight row][activation row], summed across lanes 16 weight rows at a time. */
static __thread __m512 ACC[ROW_CHUNK * M_TILE] __attribute__((aligned(64)));

/* no-tree-loop-distribute-patterns: GCC would make the accumulators' zeroing a memset call per weight row */
__attribute__((target(AVX512_TARGET), optimize("no-tree-loop-distribute-patterns")))
static void rows_times_avx512(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                              const Acts *a, const int8_t *xperm, const int64_t *xrow, int64_t m, float *out,
                              int64_t ldo) {
    const int64_t nb = a->k / QK;
    const int8_t *xq = qtype == T_Q4_K ? xperm : a->q;
    Row rows[M_TILE];
    for (int64_t rc = r0; rc < r1; rc += ROW_CHUNK) {
        const int64_t rn = r1 - rc < ROW_CHUNK ? r1 - rc : ROW_CHUNK;
        for (int64_t t0 = 0; t0 < m; t0 += M_TILE) {
            const int64_t tn = m - t0 < M_TILE ? m - t0 : M_TILE;
            for (int64_t i = 0; i < tn; i++) {
                const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
                rows[i] = (Row){xq + xr * a->k, a->d + xr * nb, a->bs + xr * nb * 16};
            }
            for (int64_t j = 0; j < ROW_CHUNK; j++) {
                __m512 *acc = ACC + j * M_TILE;
                for (int64_t i = 0; i < tn; i++) acc[i] = _mm512_setzero_ps();
                if (j >= rn) continue;  /* a short chunk's missing rows sum to 0, and are not stored */
                const int64_t r = rc + j;
                const char *ahead = (const char *)w + r * row_bytes + PREFETCH_BYTES;
                for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
                if (qtype == T_Q4_K) rows_q4_k(w + r * row_bytes, nb, rows, tn, acc);
                else rows_q6_k(w + r * row_bytes, nb, rows, tn, acc);
            }
            const __mmask16 keep = (__mmask16)((1u << rn) - 1);
            for (int64_t i = 0; i < tn; i++)
                _mm512_mask_storeu_ps(out + (t0 + i) * ldo + rc, keep, sum16(ACC + i, M_TILE));
        }
    }
}
#endif

static int FEATURES = -1;

static int features(void) {
    if (FEATURES < 0) {
        FEATURES = 0;
#if defined(__x86_64__)
        __builtin_cpu_init();
        const int bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("f16c");
        if (bw) FEATURES |= 1;
        if (bw && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
            __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
            FEATURES |= 2;
#endif
    }
    return FEATURES;
}

/* Which K-quant products run: 1 AVX512BW, 0 portable C (the integer sums are the same; the float sums of a
 * row are grouped differently, so the two give results a few ulps apart, each batch-invariant). */
int kq_isa(void) { return features() & 1; }

/* Which Q8_0 products run (q8_0.c): 2 AVX512-VNNI, 0 portable C. */
int q8_isa(void) { return features() & 2; }

/* ---- products ----------------------------------------------------------------------------------- */

/* Weight rows [r0, r1) of one matrix (rows of row_bytes) times activation rows xrow[0..m) (0..m when
 * xrow is NULL) into out[i * ldo + r]. The float accumulation for (r, xrow[i]) does not depend on m or i. */
static void rows_times(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                       const int8_t *xperm, const int64_t *xrow, int64_t m, float *out, int64_t ldo, int portable) {
    if (qtype == T_Q8_0) {
        q8_rows_times(w, row_bytes, r0, r1, a->q, a->d, a->k, xrow, m, out, ldo, portable);
        return;
    }
#if defined(__x86_64__)
    if (qtype >= T_Q8_0_PACKED) {  /* packed weights come only with VNNI */
        rows_times_x16(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
        return;
    }
    if (!portable && kq_isa() == 1) {
        rows_times_avx512(qtype, w, row_bytes, r0, r1, a, xperm, xrow, m, out, ldo);
        return;
    }
#endif
    const int64_t nb = a->k / QK, bbytes = qtype == T_Q4_K ? 144 : 210;
    Block blk;
    float acc[M_TILE];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t t0 = 0; t0 < m; t0 += M_TILE) {
            const int64_t tn = m - t0 < M_TILE ? m - t0 : M_TILE;
            for (int64_t i = 0; i < tn; i++) acc[i] = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                if (qtype == T_Q4_K) unpack_q4_k(row + b * bbytes, &blk);
                else unpack_q6_k(row + b * bbytes, &blk);
                for (int64_t i = 0; i < tn; i++) {
                    const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
                    const int16_t *bs = a->bs + (xr * nb + b) * 16;
                    const int32_t isum = dot_scalar(&blk, a->q + xr * a->k + b * QK);
                    int32_t c = 0;
                    for (int j = 0; j < 16; j++) c += blk.corr[j] * bs[j];
                    const float dx = a->d[xr * nb + b];
                    if (qtype == T_Q4_K) acc[i] += dx * (blk.d * (float)isum - blk.dmin * (float)c);
                    else acc[i] += dx * blk.d * (float)(isum - c);
                }
            }
            for (int64_t i = 0; i < tn; i++) out[(t0 + i) * ldo + r] = acc[i];
        }
    }
}

/* the unpacking of a weight block, in products of it by one activation row (measured: ~2.4 on AVX512) */
#define UNPACK_COST 2

/* y[i, r] = W[r] · x[i] for a Q4_K/Q6_K weight W [n_rows, k] and Q8_K rows x [m, k], or a Q8_0 weight and
 * Q8_0 rows (xd [m, k/32], xbs unused); y row stride ldy.
 * xperm: the quants in Q4_K nibble order (kq_q4k_order; Q4_K on the AVX512 path only, else unused). */
void kq_matmul(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n_rows, const int8_t *xq, const float *xd,
               const int16_t *xbs, const int8_t *xperm, int64_t k, int64_t m, float *y, int64_t ldy, int n_threads,
               int portable) {
    const Acts a = {xq, xd, xbs, k};
    const int64_t n_chunks = (n_rows + ROW_CHUNK - 1) / ROW_CHUNK;
    kq_isa();
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t r0 = c * ROW_CHUNK, r1 = r0 + ROW_CHUNK < n_rows ? r0 + ROW_CHUNK : n_rows;
        rows_times(qtype, w, row_bytes, r0, r1, &a, xperm, NULL, m, y, ldy, portable);
    }
}

/* Routed experts: pairs sorted by expert, group g = pairs [starts[g], starts[g+1]) all on expert
 * experts[g]; pair p multiplies activation row xrow[p] by expert experts[g]'s matrix (n_rows rows in the
 * stack W [E, n_rows, k], expert_bytes apart). out [P, n_rows]. */
void kq_matmul_pairs(int qtype, const uint8_t *w, int64_t expert_bytes, int64_t row_bytes, int64_t n_rows,
                     const int8_t *xq, const float *xd, const int16_t *xbs, const int8_t *xperm, int64_t k,
                     const int64_t *xrow, int64_t n_groups, const int64_t *experts, const int64_t *starts, float *out,
                     int n_threads, int portable) {
    const Acts a = {xq, xd, xbs, k};
    const int64_t per = (n_rows + ROW_CHUNK - 1) / ROW_CHUNK;
    kq_isa();
    /* Work items are (group, chunk of rows), split into contiguous runs of equal cost: an item costs the
     * unpacking of its weight rows plus one product per pair, so experts with more pairs weigh more (an
     * even split by item count left one thread waiting for the other). */
    #pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t total = 0;
        for (int64_t g = 0; g < n_groups; g++) total += per * (UNPACK_COST + starts[g + 1] - starts[g]);
        const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
        int64_t at = 0;
        for (int64_t g = 0; g < n_groups && at < hi; g++) {
            const int64_t p0 = starts[g], p1 = starts[g + 1], cost = UNPACK_COST + p1 - p0;
            for (int64_t c = 0; c < per; c++, at += cost) {
                if (at < lo || at >= hi) continue;
                const int64_t r0 = c * ROW_CHUNK, r1 = r0 + ROW_CHUNK < n_rows ? r0 + ROW_CHUNK : n_rows;
                rows_times(qtype, w + experts[g] * expert_bytes, row_bytes, r0, r1, &a, xperm, xrow + p0, p1 - p0,
                           out + p0 * n_rows, n_rows, portable);
            }
        }
    }
}

/* The quants of rows [m, k] in the order Q4_K's nibbles come in: per 128 values, 32-value sub-blocks
 * (0, 2, 1, 3) — the low nibbles of two 32-byte chunks, then their high nibbles. */
void kq_q4k_order(const int8_t *q, int64_t m, int64_t k, int8_t *out) {
    for (int64_t h = 0; h < m * k / 128; h++) {
        const int8_t *s = q + h * 128;
        int8_t *o = out + h * 128;
        memcpy(o, s, 32);
        memcpy(o + 32, s + 64, 32);
        memcpy(o + 64, s + 32, 32);
        memcpy(o + 96, s + 96, 32);
    }
}

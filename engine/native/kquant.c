/* K-quant products on the CPU, the way llama.cpp's CPU backend computes them.
 *
 * A Q4_K or Q6_K weight (and Q5_K, Q3_K, Q2_K, IQ4_XS, whose blocks kquant_more.c decodes) multiplies
 * activations quantized to Q8_K (blocks of 256, float scale, sums per 16): per block an exact integer dot
 * product per sub-block, weighted by the sub-block's integer scale, then scaled in float. Each weight block is
 * unpacked once and multiplied by every activation row while it is in L1, so a pass over N tokens reads the
 * weights once, not N times. The drivers here (matrix products, routed-expert pairs) run every product type:
 * rows_times sends the others to q8_0.c, legacy.c and half.c.
 *
 * Bits: the integer sums are exact whatever the instruction set; the float work for an output element
 * (one weight row times one activation row) runs in the same order whatever the number of rows, the
 * grouping of rows or the thread split. Row i of a multi-token pass is bit-identical to a one-token pass.
 *
 * Loaded with ctypes (engine/ops/native.py); no Python API. Threads: the kernels' pool (pool.c).
 */
#include "kernels.h"

/* ---- weight blocks ------------------------------------------------------------------------------ */

static void unpack_q4_k(const uint8_t *b, Block *o) {
    const uint8_t *s = b + 4, *qs = b + 16;
    o->d = fp16_to_f32(b);
    o->dmin = fp16_to_f32(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k4_scale_min(s, j, &sc, &mn);
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
    o->d = fp16_to_f32(b + 208);
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
    for (int i = 0; i < QK_K / 4; i++) {
        int32_t p = 0;
        for (int j = 0; j < 4; j++) p += (int32_t)w->v[4 * i + j] * x[4 * i + j];
        s += p * w->lane[i];
    }
    return s;
}

/* AVX512BW products: a weight block is unpacked into registers once and multiplied by every activation
 * row of the tile (maddubs: u8 values × s8 quants → 16-bit pair sums; madd by the 16-bit sub-block scales
 * → int32), each row's float sum kept as 16 lanes until the end of the weight row. Q4_K takes the quants
 * in the nibble order of its blocks: per 64-value half, sub-blocks (0,2,1,3) then (4,6,5,7) (q8_k_to_q4_k_order).
 * Measured and not kept: dpbusd then mullo by 32-bit scales on AVX512-VNNI (the same speed: two multiplies
 * per 64 values either way); the mins' term as per-block float weights of the activations' scaled sums of
 * 16 (no faster, and its rounding, unlike ggml's integer Σ min·bsum, doubled the KL to llama.cpp). */
#if defined(__x86_64__)
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

/* Per block: the exact Σ scale·value·quant of each activation row (row_sum), then the float step as ggml computes
 * it: p · d·d_x, less the mins' term Σ min·bsum (integers, each min twice: one per sum of 16) · dmin·d_x. Q4_K takes
 * the quants in its nibble order (q8_k_to_q4_k_order). */
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
            const __m512i p = row_sum(v, s, rows[i].q + b * QK_K);
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
            const __m512i p = _mm512_sub_epi32(row_sum(v, s, rows[i].q + b * QK_K), _mm512_zextsi256_si512(c));
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
    const int64_t nb = a->k / QK_K;
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
                else if (qtype == T_Q6_K) rows_q6_k(w + r * row_bytes, nb, rows, tn, acc);
                else rows_k_more_avx512(qtype, w + r * row_bytes, nb, rows, tn, acc);
            }
            const __mmask16 keep = (__mmask16)((1u << rn) - 1);
            for (int64_t i = 0; i < tn; i++)
                _mm512_mask_storeu_ps(out + (t0 + i) * ldo + rc, keep, sum16(ACC + i, M_TILE));
        }
    }
}

/* AVX2 products (with FMA and F16C: the x86-64 desktop CPUs without AVX512), on the stored blocks as ggml's AVX2 dot
 * products read them: a 32-byte vector holds one 32-value sub-block of Q4_K (the low or the high nibbles of a
 * 32-byte chunk, so the quants stay in their natural order) or two 16-value sub-blocks of Q6_K; maddubs (u8 values ×
 * s8 quants → 16-bit pair sums, at most 2·63·127) then madd by the sub-blocks' 16-bit scales give exact int32 lanes.
 * Per block, as in the AVX512 form: p · d·d_x (Q4_K: less Σ min·bsum · dmin·d_x) into the row's 8 float lanes, summed
 * across (hsum8) at the end of the weight row. vector j of a block multiplies quants 32j … 32j+31. */
__attribute__((target(AVX2_TARGET)))
static void rows_q4_k_avx2(const uint8_t *row, int64_t nb, const Row *rows, int64_t tn, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 144;
        const float d = fp16_f16c(blk), dmin = fp16_f16c(blk + 2);
        const __m128i sm = q4_k_scales(blk);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  /* sc0..7 as 16-bit, both halves */
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));  /* mn0 mn0 mn1 mn1 …: one per bsum */
        __m256i v[8], s[8];
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            v[2 * c] = _mm256_and_si256(q, m4);
            v[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        }
        for (int j = 0; j < 8; j++) s[j] = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
        if (tn == 1) {  /* a decode step's one row: its sums and accumulator stay in registers (1.3x, measured) */
            const __m256i p = dot8(v, s, rows[0].q + b * QK_K, _mm256_setzero_si256());
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(rows[0].bs + b * 16));
            const __m256 cc = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins));
            const float dx = rows[0].d[b];
            const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx * d), acc[0]);
            acc[0] = _mm256_fmadd_ps(cc, _mm256_set1_ps(-dx * dmin), f);
            continue;
        }
        for (int64_t i = 0; i < tn; i++) {
            const __m256i p = dot8(v, s, rows[i].q + b * QK_K, _mm256_setzero_si256());
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(rows[i].bs + b * 16));
            const __m256 c = _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins));
            const float dx = rows[i].d[b];
            const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx * d), acc[i]);
            acc[i] = _mm256_fmadd_ps(c, _mm256_set1_ps(-dx * dmin), f);
        }
    }
}

/* Q6_K: the stored values are q + 32, so 32 · Σ sc·bsum comes off p. Vector 4n + t holds quants 128n + 32t …, the
 * sub-blocks 8n + 2t (low 128 bits) and 8n + 2t + 1 (high). */
__attribute__((target(AVX2_TARGET)))
static void rows_q6_k_avx2(const uint8_t *row, int64_t nb, const Row *rows, int64_t tn, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    __m256i pick[4];  /* per 128-bit half, the 16-bit scale 2t (low) and 2t + 1 (high) into every lane */
    for (int t = 0; t < 4; t++)
        pick[t] = _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 * (4 * t + 3) + 4 * t + 2)),
                                   _mm_set1_epi16((short)(0x0100 * (4 * t + 1) + 4 * t)));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210;
        const float d = fp16_f16c(blk + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        __m256i v[8], s[8];
        for (int n = 0; n < 2; n++) {
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            v[4 * n] = _mm256_or_si256(_mm256_and_si256(q0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
            v[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(q1, m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
            v[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q0, 4), m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
            v[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q1, 4), m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
            const __m256i half = _mm256_permute2x128_si256(sc16, sc16, n ? 0x11 : 0x00);  /* sc 8n … 8n+7, twice */
            for (int t = 0; t < 4; t++) s[4 * n + t] = _mm256_shuffle_epi8(half, pick[t]);
        }
        if (tn == 1) {  /* a decode step's one row: its sums and accumulator stay in registers (1.3x, measured) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(rows[0].bs + b * 16));
            const __m256i off = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
            const __m256i p = dot8(v, s, rows[0].q + b * QK_K, off);
            acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(rows[0].d[b] * d), acc[0]);
            continue;
        }
        for (int64_t i = 0; i < tn; i++) {
            const int8_t *x = rows[i].q + b * QK_K;
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(rows[i].bs + b * 16));
            __m256i p = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
            for (int j = 0; j < 8; j++)
                p = _mm256_add_epi32(p, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(v[j], _mm256_loadu_si256((const __m256i *)(x + 32 * j))), s[j]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(rows[i].d[b] * d), acc[i]);
        }
    }
}

/* Weight rows [r0, r1) times the activation rows, a tile of M_TILE at a time; each weight row's blocks are
 * unpacked once per tile and multiplied by every row of it. */
__attribute__((target(AVX2_TARGET)))
static void rows_times_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                            const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    const int64_t nb = a->k / QK_K;
    Row rows[M_TILE];
    __m256 acc[M_TILE];
    for (int64_t t0 = 0; t0 < m; t0 += M_TILE) {
        const int64_t tn = m - t0 < M_TILE ? m - t0 : M_TILE;
        for (int64_t i = 0; i < tn; i++) {
            const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
            rows[i] = (Row){a->q + xr * a->k, a->d + xr * nb, a->bs + xr * nb * 16};
        }
        for (int64_t r = r0; r < r1; r++) {
            const char *ahead = (const char *)w + r * row_bytes + PREFETCH_BYTES;
            for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
            for (int64_t i = 0; i < tn; i++) acc[i] = _mm256_setzero_ps();
            if (qtype == T_Q4_K) rows_q4_k_avx2(w + r * row_bytes, nb, rows, tn, acc);
            else if (qtype == T_Q6_K) rows_q6_k_avx2(w + r * row_bytes, nb, rows, tn, acc);
            else rows_k_more_avx2(qtype, w + r * row_bytes, nb, rows, tn, acc);
            for (int64_t i = 0; i < tn; i++) out[(t0 + i) * ldo + r] = hsum8(acc[i]);
        }
    }
}
#endif

/* ---- products ----------------------------------------------------------------------------------- */

/* The K-quant types (Q8_K activations): block bytes, whether dmin scales a mins' term (else the block's offset
 * is inside the integer sum), and the portable unpacking. */
typedef struct {
    int qtype, bytes, has_min;
    void (*unpack)(const uint8_t *b, Block *o);
} KType;

static const KType K_TYPES[] = {
    {T_Q4_K, 144, 1, unpack_q4_k}, {T_Q6_K, 210, 0, unpack_q6_k}, {T_Q5_K, 176, 1, unpack_q5_k},
    {T_Q3_K, 110, 0, unpack_q3_k}, {T_Q2_K, 84, 1, unpack_q2_k}, {T_IQ4_XS, 136, 0, unpack_iq4_xs},
};

static const KType *k_type(int qtype) {
    for (size_t i = 0; i < sizeof K_TYPES / sizeof K_TYPES[0]; i++)
        if (K_TYPES[i].qtype == qtype) return K_TYPES + i;
    return NULL;
}

/* Rows ids[0..n) of a K-quant (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS), Q8_0 or 32-value (legacy.c) matrix (row_bytes
 * per row, k values) as float32 into out [n, k]: a prompt's or a step's token embeddings (llama.cpp's mixes store them
 * in the mix's type: Q3_K in Q3_K_M, Q2_K in Q2_K, IQ4_XS in IQ4_XS, Q4_0 in Q4_0). The arithmetic of
 * engine/storage/qtensor.py's dequantization, so the bits are the same: with a min (Q4_K, Q5_K, Q2_K)
 * q·(d·sc) − dmin·m; else (q − offset)·(d·sc), the value stored with the offset the unpacking gives it (Q6_K 32,
 * Q3_K 4, IQ4_XS 128); Q8_0 q·d; the 32-value types legacy_row's. Returns 0, RC_ROW_TYPE for another type,
 * RC_ROW_ID for an id outside [0, n_rows). */
int dequant_rows(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n_rows, const int64_t *ids, int64_t n,
                 int64_t k, float *out) {
    const KType *t = k_type(qtype);
    const int legacy = !t && qtype != T_Q8_0 && legacy_row(qtype, NULL, 0, NULL) == 0;  /* no row: the type's test */
    if (!t && !legacy && qtype != T_Q8_0) return RC_ROW_TYPE;
    const int offset = qtype == T_Q6_K ? 32 : qtype == T_Q3_K ? 4 : 128;  /* of the types without a min */
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= n_rows) return RC_ROW_ID;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + ids[r] * row_bytes;
        float *o = out + r * k;
        if (legacy) {
            legacy_row(qtype, row, k, o);
            continue;
        }
        if (!t) {  /* Q8_0: blocks of 32, an fp16 scale then 32 int8 */
            for (int64_t b = 0; b < k / QK8_0; b++) {
                const uint8_t *blk = row + b * (2 + QK8_0);
                const float d = fp16_to_f32(blk);
                for (int i = 0; i < QK8_0; i++) o[b * QK8_0 + i] = (float)(int8_t)blk[2 + i] * d;
            }
            continue;
        }
        Block u;
        for (int64_t b = 0; b < k / QK_K; b++) {
            float *ob = o + b * QK_K;
            t->unpack(row + b * t->bytes, &u);
            for (int i = 0; i < QK_K; i++) {
                if (t->has_min) {
                    const float ds = u.d * (float)u.lane[i / 4], dm = u.dmin * (float)u.corr[i / 16];
                    ob[i] = (float)u.v[i] * ds - dm;
                } else {
                    ob[i] = (float)((int)u.v[i] - offset) * (u.d * (float)u.lane[i / 4]);
                }
            }
        }
    }
    return 0;
}

/* Weight rows [r0, r1) of one matrix (rows of row_bytes) times activation rows xrow[0..m) (0..m when
 * xrow is NULL) into out[i * ldo + r]. The float accumulation for (r, xrow[i]) does not depend on m or i.
 * The one dispatch by weight type: Q8_0 (q8_0.c), the other 32-value types (legacy.c), F16/BF16 (half.c), packed
 * weights (packed_x16.c), the K-quants here (Q4_K and Q6_K; Q5_K, Q3_K, Q2_K and IQ4_XS in kquant_more.c).
 * An unknown type leaves out untouched: native.PRODUCT_TYPES lists what binds. */
static void rows_times(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                       const int8_t *xperm, const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa,
                       Ahead *ahead) {
    if (iq_grid_type(qtype)) {
        rows_times_iq(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo, isa);
        return;
    }
    if (qtype == T_Q8_0) {
        q8_rows_times(w, row_bytes, r0, r1, a->q, a->d, a->k, xrow, m, out, ldo, isa);
        return;
    }
#if defined(__x86_64__)
    if (qtype > PACKED_BASE) {  /* packed weights come with VNNI or AVX2 */
        rows_times_x16(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo, ahead, isa);
        return;
    }
#endif
    const int fmt = act_format(qtype);
    if (fmt == ACT_Q8_0 || fmt == ACT_Q8_1) {
        rows_times_legacy(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo, isa, ahead);
        return;
    }
    if (fmt == ACT_F16 || fmt == ACT_BF16) {
        rows_times_half(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo, isa);
        return;
    }
    const KType *kt = k_type(qtype);
    if (!kt) return;
#if defined(__x86_64__)
    if (isa_runs(isa, ISA_AVX512)) {
        rows_times_avx512(qtype, w, row_bytes, r0, r1, a, xperm, xrow, m, out, ldo);
        return;
    }
    if (isa_runs(isa, ISA_AVX2)) {
        rows_times_avx2(qtype, w, row_bytes, r0, r1, a, xrow, m, out, ldo);
        return;
    }
#endif
    const int64_t nb = a->k / QK_K, bbytes = kt->bytes;
    Block blk;
    float acc[M_TILE];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t t0 = 0; t0 < m; t0 += M_TILE) {
            const int64_t tn = m - t0 < M_TILE ? m - t0 : M_TILE;
            for (int64_t i = 0; i < tn; i++) acc[i] = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                kt->unpack(row + b * bbytes, &blk);
                for (int64_t i = 0; i < tn; i++) {
                    const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
                    const int16_t *bs = a->bs + (xr * nb + b) * 16;
                    const int32_t isum = dot_scalar(&blk, a->q + xr * a->k + b * QK_K);
                    int32_t c = 0;
                    for (int j = 0; j < 16; j++) c += blk.corr[j] * bs[j];
                    const float dx = a->d[xr * nb + b];
                    if (kt->has_min) acc[i] += dx * (blk.d * (float)isum - blk.dmin * (float)c);
                    else acc[i] += dx * blk.d * (float)(isum - c);
                }
            }
            for (int64_t i = 0; i < tn; i++) out[(t0 + i) * ldo + r] = acc[i];
        }
    }
}


/* y[i, r] = W[r] · x[i] for a weight W [n_rows, k] of a product type and activation rows x [m, k] in its format
 * (kernels.h act_format: Q8_K quants xq, scales xd [m, k/256], sums xbs [m, k/16]; Q8_0 and Q8_1 quants, scales
 * [m, k/32] and for Q8_1 the sums xs [m, k/32]; F16/BF16 the values' 16 bits in xq); y row stride ldy.
 * xperm: the quants in Q4_K nibble order (q8_k_to_q4_k_order; Q4_K on the AVX512 path only, else unused).
 * isa: the instruction-set level asked for (kernels.h ISA_*). */
typedef struct {
    int qtype, isa;
    const uint8_t *w;
    int64_t row_bytes, n_rows, m, ldy;
    Acts a;
    const int8_t *xperm;
    float *y;
} Matmul;

static void matmul_item(void *ctx, int64_t c) {  /* one chunk of ROW_CHUNK weight rows */
    const Matmul *j = ctx;
    const int64_t r0 = c * ROW_CHUNK, r1 = r0 + ROW_CHUNK < j->n_rows ? r0 + ROW_CHUNK : j->n_rows;
    const int64_t r2 = r1 + ROW_CHUNK < j->n_rows ? r1 + ROW_CHUNK : j->n_rows;  /* the next chunk */
    Ahead next = {(const char *)j->w + r1 * j->row_bytes, (const char *)j->w + r2 * j->row_bytes, 0};
    rows_times(j->qtype, j->w, j->row_bytes, r0, r1, &j->a, j->xperm, NULL, j->m, j->y, j->ldy, j->isa, &next);
}

void quant_matmul(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n_rows, const int8_t *xq, const float *xd,
               const int16_t *xbs, const float *xs, const int8_t *xperm, int64_t k, int64_t m, float *y, int64_t ldy,
               int n_threads, int isa) {
    Matmul j = {qtype, isa, w, row_bytes, n_rows, m, ldy, {xq, xd, xbs, k, xs}, xperm, y};
    cpu_features();  /* detected before the threads start, not racily among them */
    pool_run(n_threads, (n_rows + ROW_CHUNK - 1) / ROW_CHUNK, matmul_item, &j);
}

/* Routed experts: pairs sorted by expert, group g = pairs [starts[g], starts[g+1]) all on expert
 * experts[g]; pair p multiplies activation row xrow[p] by expert experts[g]'s matrix (n_rows rows in the
 * stack W [E, n_rows, k], expert_bytes apart). out [P, n_rows]. Items are (group, chunk of rows), claimed in
 * order by whichever thread is free: an expert with more pairs weighs more, and the claiming evens it out. */
PairsJob pairs_job(int qtype, const uint8_t *w, int64_t expert_bytes, int64_t row_bytes, int64_t n_rows,
                   const int8_t *xq, const float *xd, const int16_t *xbs, const float *xs, const int8_t *xperm,
                   int64_t k, const int64_t *xrow, int64_t n_groups, const int64_t *experts, const int64_t *starts,
                   float *out, int isa) {
    return (PairsJob){qtype, isa, w, expert_bytes, row_bytes, n_rows, (n_rows + ROW_CHUNK - 1) / ROW_CHUNK,
                      {xq, xd, xbs, k, xs}, xperm, xrow, experts, starts, out, n_groups};
}

typedef struct {
    const PairsJob *jobs;
    int n;
} Jobs;

/* item's job (js's items one job after another) and its item within it; NULL past the last */
static const PairsJob *job_of(const Jobs *js, int64_t *item) {
    const PairsJob *j = js->jobs;
    for (int i = 0; i < js->n; i++, j++) {
        if (*item < j->n_groups * j->per) return j;
        *item -= j->n_groups * j->per;
    }
    return NULL;
}

/* item's group g and row chunk [r0, r1) within job j */
static void item_rows(const PairsJob *j, int64_t item, int64_t *g, int64_t *r0, int64_t *r1) {
    *g = item / j->per, *r0 = item % j->per * ROW_CHUNK;
    *r1 = *r0 + ROW_CHUNK < j->n_rows ? *r0 + ROW_CHUNK : j->n_rows;
}

static const uint8_t *expert_of(const PairsJob *j, int64_t g) { return j->w + j->experts[g] * j->expert_bytes; }

static void pairs_item(void *ctx, int64_t item) {
    const Jobs *js = ctx;
    int64_t next_item = item + 1, g, r0, r1;
    const PairsJob *j = job_of(js, &item), *jn = job_of(js, &next_item);
    Ahead next = {0};
    if (jn) {  /* the weight rows of this thread's likely next item, for the kernel to prefetch */
        item_rows(jn, next_item, &g, &r0, &r1);
        const char *e = (const char *)expert_of(jn, g);
        next = (Ahead){e + r0 * jn->row_bytes, e + r1 * jn->row_bytes, 0};
    }
    item_rows(j, item, &g, &r0, &r1);
    const int64_t p0 = j->starts[g], p1 = j->starts[g + 1];
    rows_times(j->qtype, expert_of(j, g), j->row_bytes, r0, r1, &j->a, j->xperm, j->xrow + p0, p1 - p0,
               j->out + p0 * j->n_rows, j->n_rows, j->isa, &next);
}

/* Group g of job j whole, chunk by chunk, on the calling thread: each chunk's kernel prefetches the next chunk's rows,
 * the last one the first chunk of group then_g of job `then` (the matrix this thread reads next; NULL: none). The
 * items of moe.c's small passes, each of which runs one expert's three products. */
void pairs_group(const PairsJob *j, int64_t g, const PairsJob *then, int64_t then_g) {
    const int64_t p0 = j->starts[g], p1 = j->starts[g + 1], n_rows = j->n_rows, rb = j->row_bytes;
    const char *e = (const char *)expert_of(j, g);
    for (int64_t r0 = 0; r0 < n_rows; r0 += ROW_CHUNK) {
        const int64_t r1 = r0 + ROW_CHUNK < n_rows ? r0 + ROW_CHUNK : n_rows;
        Ahead next = {0};
        if (r1 < n_rows) {
            next = (Ahead){e + r1 * rb, e + (r1 + ROW_CHUNK < n_rows ? r1 + ROW_CHUNK : n_rows) * rb, 0};
        } else if (then) {
            const char *t = (const char *)expert_of(then, then_g);
            next = (Ahead){t, t + (ROW_CHUNK < then->n_rows ? ROW_CHUNK : then->n_rows) * then->row_bytes, 0};
        }
        rows_times(j->qtype, (const uint8_t *)e, rb, r0, r1, &j->a, j->xperm, j->xrow + p0, p1 - p0,
                   j->out + p0 * n_rows, n_rows, j->isa, &next);
    }
}

/* Several pair products in one pool call, their items one after the other (the MoE layer's gate and up products of
 * its routed and shared experts, then the down products): one wait for the threads instead of one per product. */
void pairs_run(const PairsJob *jobs, int n_jobs, int n_threads) {
    Jobs js = {jobs, n_jobs};
    int64_t items = 0;
    for (int i = 0; i < n_jobs; i++) items += jobs[i].n_groups * jobs[i].per;
    cpu_features();
    pool_run(n_threads, items, pairs_item, &js);
}

void quant_matmul_pairs(int qtype, const uint8_t *w, int64_t expert_bytes, int64_t row_bytes, int64_t n_rows,
                     const int8_t *xq, const float *xd, const int16_t *xbs, const float *xs, const int8_t *xperm,
                     int64_t k, const int64_t *xrow, int64_t n_groups, const int64_t *experts, const int64_t *starts,
                     float *out, int n_threads, int isa) {
    const PairsJob j = pairs_job(qtype, w, expert_bytes, row_bytes, n_rows, xq, xd, xbs, xs, xperm, k, xrow, n_groups,
                                 experts, starts, out, isa);
    pairs_run(&j, 1, n_threads);
}

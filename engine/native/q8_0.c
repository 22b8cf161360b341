/* Q8_0 products on the CPU, the way llama.cpp's CPU backend computes them.
 *
 * A Q8_0 weight (blocks of 32 int8 quants with an f16 scale) multiplies activations quantized to Q8_0 the same
 * way: per block an exact integer dot product, scaled by d_w·d_x in float and summed over the blocks. The
 * weights are read packed (16 rows interleaved, q8_repack) or in their GGUF blocks, as they are mapped; each
 * block is loaded once and multiplied by every activation row of the tile while it is in registers, so a pass
 * over N tokens reads the weights once.
 *
 * Bits: the float work for an output element (one weight row times one activation row) runs in the same
 * order whatever the number of rows, the grouping of rows or the thread split, so row i of a multi-token pass
 * is bit-identical to a one-token pass. The AVX512-VNNI and portable products group the float sums
 * differently (a few ulps apart), each batch-invariant.
 *
 * Loaded with ctypes (engine/nativelib.py, used by engine/kquant.py); no Python API.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define QK 32
#define BLOCK_BYTES 34  /* f16 scale, 32 int8 quants */


static float f16_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* ggml quantize_row_q8_0: per block of 32, d = amax/127, q = round-half-even(x / d) (x · 1/d, 0 where d = 0),
 * and the scale stored as f16: d is returned rounded to f16 (as a float), which is what the products use. */
int q8_isa(void);  /* kquant.c: 2 AVX512-VNNI, 0 portable */
#if defined(__x86_64__)
static void quantize_vnni(const float *x, int64_t n_blocks, int8_t *q, float *d);
#endif

void q8_quantize_q8_0(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d) {
#if defined(__x86_64__)
    if (q8_isa() == 2) {
        quantize_vnni(x, m_rows * (k / QK), q, d);
        return;
    }
#endif
    for (int64_t i = 0; i < m_rows * (k / QK); i++) {
        const float *xb = x + i * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; j++) {
            const float a = fabsf(xb[j]);
            if (a > amax) amax = a;
        }
        const float dd = amax / 127.0f, id = dd != 0.f ? 1.0f / dd : 0.f;
        for (int j = 0; j < QK; j++) q[i * QK + j] = (int8_t)nearbyintf(xb[j] * id);
        d[i] = (float)(_Float16)dd;
    }
}

#if defined(__x86_64__)
#define R 8
#define NB_MAX 1024  /* blocks per row the SIMD products take (k ≤ 32768); wider rows run the portable ones */
/* Weight rows [r0, r1) times activation rows xrow[0..m), in AVX512-VNNI (256-bit), eight weight rows at a time:
 * per activation row, eight independent 8-lane float sums (one per weight row) keep the FMA chains apart and
 * share the activation's loads. dpbusd multiplies unsigned by signed bytes, so the weight quants go in offset
 * by 128 (w ^ 0x80) and each block's sum starts from −128·Σx (per lane, made once per activation block): each
 * int32 lane is then the exact sum of four products w·x, scaled by d_w·d_x into the row's float sum, reduced
 * at the end of the row. Every output element gets that same sequence (a leftover weight row reuses a lane of
 * the group), so the grouping and the number of rows change no bits. (Measured: summing eight blocks' lanes
 * across first, to scale exact block sums, was 1.3× slower here; four rows at a time 7 % slower.) */
#define VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"

__attribute__((target(VNNI_TARGET)))
static float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

__attribute__((target(VNNI_TARGET)))
static void rows_times_vnni(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const int8_t *xq,
                            const float *xd, int64_t k, const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    const int64_t nb = k / QK;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    float dws[R][nb];
    for (int64_t r = r0; r < r1; r += R) {
        const int nr = r1 - r < R ? (int)(r1 - r) : R;
        const uint8_t *rw[R];
        for (int j = 0; j < R; j++) {
            rw[j] = w + (r + (j < nr ? j : 0)) * row_bytes;
            for (int64_t b = 0; b < nb; b++) {
                uint16_t h;
                memcpy(&h, rw[j] + b * BLOCK_BYTES, 2);
                dws[j][b] = _cvtsh_ss(h);  /* F16C: the portable conversion is a library call */
            }
        }
        for (int64_t i = 0; i < m; i++) {
            const int64_t xr = xrow ? xrow[i] : i;
            const int8_t *x = xq + xr * k;
            const float *dx = xd + xr * nb;
            __m256 acc[R];
            for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + b * QK));
                const __m256i base = _mm256_sub_epi32(_mm256_setzero_si256(),
                                                      _mm256_dpbusd_epi32(_mm256_setzero_si256(), flip, xv));
                for (int j = 0; j < R; j++) {
                    const __m256i wv = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(rw[j] + b * BLOCK_BYTES + 2)), flip);
                    const __m256 p = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(base, wv, xv));
                    acc[j] = _mm256_fmadd_ps(p, _mm256_set1_ps(dws[j][b] * dx[b]), acc[j]);
                }
            }
            for (int j = 0; j < nr; j++) out[i * ldo + r + j] = hsum8(acc[j]);
        }
    }
}

/* Packed Q8_0 (q8_repack, for these products only): a group of 16 rows holds first the rows' scales, [block][row]
 * as f16, then per block eight 64-byte vectors g, byte 4l + e = quant 4g + e of row l, offset by 128 (unsigned, as
 * dpbusd takes it): int32 lane l of every vector is row l. A dpbusd against a broadcast of 4 activation quants
 * then adds 4 products for each of the 16 rows, and the scale, conversion and FMA of a block are one instruction
 * for 16 rows, where the stored layout took them per row (eight rows at a time, 8 lanes each). Each output's
 * float sum is one lane accumulated block by block, the same whatever the number of activation rows. The group
 * keeps its 16 · row_bytes bytes, so row chunks and experts' matrices stay where they were. */
#define GROUP 16
#define X16_TILE 4  /* activation rows per pass over a group (their sums stay in registers) */

void q8_repack(const uint8_t *src, int64_t n_rows, int64_t nb, uint8_t *dst, int n_threads) {
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (int64_t g = 0; g < n_rows / GROUP; g++) {
        const uint8_t *s = src + g * GROUP * nb * BLOCK_BYTES;
        uint8_t *d = dst + g * GROUP * nb * BLOCK_BYTES, *q = d + 2 * GROUP * nb;
        for (int64_t b = 0; b < nb; b++)
            for (int l = 0; l < GROUP; l++) memcpy(d + 2 * (GROUP * b + l), s + (l * nb + b) * BLOCK_BYTES, 2);
        for (int l = 0; l < GROUP; l++)
            for (int64_t b = 0; b < nb; b++) {
                uint64_t w[4];
                memcpy(w, s + (l * nb + b) * BLOCK_BYTES + 2, 32);
                for (int v = 0; v < 4; v++) w[v] ^= 0x8080808080808080ULL;  /* + 128: unsigned, as dpbusd takes it */
                for (int v = 0; v < 8; v++) memcpy(q + 512 * b + 64 * v + 4 * l, (const uint8_t *)w + 4 * v, 4);
            }
    }
}

#if defined(__x86_64__)
#define BCAST4(p) _mm512_set1_epi32(*(const int32_t *)(p))

/* T activation rows (a constant once inlined) times one packed group of 16 rows: o[i · ldo + l]. */
__attribute__((target(VNNI_TARGET), always_inline))
static inline void q8_x16(const uint8_t *g, int64_t nb, const int8_t *const *xs, const float *const *dxs, float *o,
                          int64_t ldo, const int T) {
    const uint8_t *qv = g + 2 * GROUP * nb;
    const __m256i ones = _mm256_set1_epi8(1);
    __m512 acc[X16_TILE];
    for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[8];
        for (int v = 0; v < 8; v++) w[v] = _mm512_loadu_si512(qv + 512 * b + 64 * v);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 2 * GROUP * b)));
        for (int i = 0; i < T; i++) {
            const int8_t *x = xs[i] + b * QK;
            /* the quants went in offset by 128: start from −128 · Σx, so each lane is the exact Σ w·x */
            const __m256i sx = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, _mm256_loadu_si256((const __m256i *)x));
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sx), _mm256_extracti128_si256(sx, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_set1_epi32(-128 * _mm_cvtsi128_si32(h)), w[0], BCAST4(x));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], BCAST4(x + 4));
            s0 = _mm512_dpbusd_epi32(s0, w[2], BCAST4(x + 8));
            s1 = _mm512_dpbusd_epi32(s1, w[3], BCAST4(x + 12));
            s0 = _mm512_dpbusd_epi32(s0, w[4], BCAST4(x + 16));
            s1 = _mm512_dpbusd_epi32(s1, w[5], BCAST4(x + 20));
            s0 = _mm512_dpbusd_epi32(s0, w[6], BCAST4(x + 24));
            s1 = _mm512_dpbusd_epi32(s1, w[7], BCAST4(x + 28));
            const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[i] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(dxs[i][b])), acc[i]);
        }
    }
    for (int i = 0; i < T; i++) _mm512_storeu_ps(o + i * ldo, acc[i]);
}

/* Packed weight rows [r0, r1) (whole groups of 16, rows row_bytes apart as stored) times activation rows. */
__attribute__((target(VNNI_TARGET)))
void q8_rows_times_x16(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const int8_t *xq,
                       const float *xd, int64_t k, const int64_t *xrow, int64_t m, float *out, int64_t ldo) {
    const int64_t nb = k / QK;
    const int8_t *xs[X16_TILE];
    const float *dxs[X16_TILE];
    for (int64_t rc = r0; rc < r1; rc += GROUP) {
        const uint8_t *g = w + rc * row_bytes;
        for (int64_t t0 = 0; t0 < m; t0 += X16_TILE) {
            const int64_t tn = m - t0 < X16_TILE ? m - t0 : X16_TILE;
            for (int64_t i = 0; i < tn; i++) {
                const int64_t xr = xrow ? xrow[t0 + i] : t0 + i;
                xs[i] = xq + xr * k;
                dxs[i] = xd + xr * nb;
            }
            float *o = out + t0 * ldo + rc;
            switch (tn) {
            case 1: q8_x16(g, nb, xs, dxs, o, ldo, 1); break;
            case 2: q8_x16(g, nb, xs, dxs, o, ldo, 2); break;
            case 3: q8_x16(g, nb, xs, dxs, o, ldo, 3); break;
            default: q8_x16(g, nb, xs, dxs, o, ldo, 4); break;
            }
        }
    }
}
#endif

/* The quantizer's SIMD twin: the same values (max of |x|, d = amax/127, x · 1/d rounded half to even by the
 * conversion, the scale rounded to f16). */
__attribute__((target(VNNI_TARGET)))
static void quantize_vnni(const float *x, int64_t n_blocks, int8_t *q, float *d) {
    for (int64_t i = 0; i < n_blocks; i++) {
        const __m512 a = _mm512_loadu_ps(x + i * QK), b = _mm512_loadu_ps(x + i * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float dd = amax / 127.0f, id = dd != 0.f ? 1.0f / dd : 0.f;
        const __m512 v = _mm512_set1_ps(id);
        _mm_storeu_si128((__m128i *)(q + i * QK), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, v))));
        _mm_storeu_si128((__m128i *)(q + i * QK + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, v))));
        d[i] = _cvtsh_ss(_cvtss_sh(dd, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}
#endif

/* Weight rows [r0, r1) of a Q8_0 matrix (rows row_bytes apart) times Q8_0 activation rows xrow[0..m) (0..m
 * when xrow is NULL: quants xq [·, k], scales xd [·, k/32]) into out[i * ldo + r]. The products' drivers
 * (row chunks over threads, expert pairs) are kquant.c's kq_matmul and kq_matmul_pairs. */
void q8_rows_times(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const int8_t *xq, const float *xd,
                   int64_t k, const int64_t *xrow, int64_t m, float *out, int64_t ldo, int portable) {
#if defined(__x86_64__)
    if (!portable && q8_isa() == 2 && k / QK <= NB_MAX) {
        rows_times_vnni(w, row_bytes, r0, r1, xq, xd, k, xrow, m, out, ldo);
        return;
    }
#endif
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < m; i++) {
        const int64_t xr = xrow ? xrow[i] : i;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = w + r * row_bytes;
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *wq = (const int8_t *)(row + b * BLOCK_BYTES + 2), *x = xq + xr * k + b * QK;
                int32_t s = 0;
                for (int j = 0; j < QK; j++) s += (int32_t)wq[j] * x[j];
                acc += f16_at(row + b * BLOCK_BYTES) * xd[xr * nb + b] * (float)s;
            }
            out[i * ldo + r] = acc;
        }
    }
}

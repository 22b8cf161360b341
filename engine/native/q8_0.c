/* Q8_0 products on the CPU, the way llama.cpp's CPU backend computes them.
 *
 * A Q8_0 weight (blocks of 32 int8 quants with an f16 scale) multiplies activations quantized to Q8_0 the same
 * way: per block an exact integer dot product, scaled by d_w·d_x in float and summed over the blocks. The
 * weights are read in their GGUF blocks, as they are mapped (packed weights, 16 rows interleaved, run in
 * kquant.c with the packed K-quants); each block is loaded once and multiplied by every activation row of the
 * tile while it is in registers, so a pass over N tokens reads the weights once.
 *
 * Bits: the float work for an output element (one weight row times one activation row) runs in the same
 * order whatever the number of rows, the grouping of rows or the thread split, so row i of a multi-token pass
 * is bit-identical to a one-token pass. The AVX512-VNNI and AVX2 products give the same bits; the portable one
 * groups the float sums differently (a few ulps apart), each batch-invariant.
 *
 * Called by kquant.c's product drivers; the activations are quantized in act_quant.c.
 */
#include "kernels.h"

#define QK 32
#define BLOCK_BYTES 34  /* f16 scale, 32 int8 quants */


static float f16_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

#if defined(__x86_64__)
#define R 8
#define NB_MAX 1024  /* blocks per row the SIMD products take (k ≤ 32768); wider rows run the portable ones */
/* Weight rows [r0, r1) times activation rows xrow[0..m), 256 bits at a time, eight weight rows at a time: per
 * activation row, eight independent 8-lane float sums (one per weight row) keep the FMA chains apart and share the
 * activation's loads. Int32 lane l of a block's product is the exact sum of the four products w·x of bytes
 * 4l … 4l+3, scaled by d_w·d_x into the row's float sum, reduced at the end of the row (hsum8). Every output element
 * gets that same sequence (a leftover weight row reuses a lane of the group), so the grouping and the number of rows
 * change no bits, and the two instruction sets below, having the same lanes, give the same bits.
 *   AVX512-VNNI: dpbusd multiplies unsigned by signed bytes, so the weight quants go in offset by 128 (w ^ 0x80)
 *   and each block's sum starts from −128·Σx (per lane, made once per activation block).
 *   AVX-VNNI: the same in its VEX encoding (Intel desktop cores without AVX512).
 *   AVX2: maddubs of |w| and x·sign(w) (pairs of at most 2·128·127, no saturation), then madd by ones.
 * (Measured on AVX512: summing eight blocks' lanes across first, to scale exact block sums, was 1.3× slower; four
 * rows at a time 7 % slower.) */
#define Q8_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"

#define DEFINE_Q8_ROWS_TIMES(NAME, TARGET, PER_BLOCK, DOT)                                                       \
__attribute__((target(TARGET)))                                                                                  \
static void NAME(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const int8_t *xq, const float *xd, \
                 int64_t k, const int64_t *xrow, int64_t m, float *out, int64_t ldo) {                          \
    const int64_t nb = k / QK;                                                                                   \
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);                              \
    float dws[R][nb];                                                                                            \
    for (int64_t r = r0; r < r1; r += R) {                                                                       \
        const int nr = r1 - r < R ? (int)(r1 - r) : R;                                                           \
        const uint8_t *rw[R];                                                                                    \
        for (int j = 0; j < R; j++) {                                                                            \
            rw[j] = w + (r + (j < nr ? j : 0)) * row_bytes;                                                      \
            for (int64_t b = 0; b < nb; b++) dws[j][b] = fp16_f16c(rw[j] + b * BLOCK_BYTES);                     \
        }                                                                                                        \
        for (int64_t i = 0; i < m; i++) {                                                                        \
            const int64_t xr = xrow ? xrow[i] : i;                                                               \
            const int8_t *x = xq + xr * k;                                                                       \
            const float *dx = xd + xr * nb;                                                                      \
            __m256 acc[R];                                                                                       \
            for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();                                            \
            for (int64_t b = 0; b < nb; b++) {                                                                   \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + b * QK));                            \
                PER_BLOCK                                                                                        \
                for (int j = 0; j < R; j++) {                                                                    \
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(rw[j] + b * BLOCK_BYTES + 2));       \
                    const __m256 p = _mm256_cvtepi32_ps(DOT);                                                    \
                    acc[j] = _mm256_fmadd_ps(p, _mm256_set1_ps(dws[j][b] * dx[b]), acc[j]);                      \
                }                                                                                                \
            }                                                                                                    \
            for (int j = 0; j < nr; j++) out[i * ldo + r + j] = hsum8(acc[j]);                                   \
        }                                                                                                        \
    }                                                                                                            \
    (void)flip, (void)ones;                                                                                      \
}

DEFINE_Q8_ROWS_TIMES(rows_times_vnni, Q8_VNNI_TARGET,
                     const __m256i base = _mm256_sub_epi32(_mm256_setzero_si256(),
                                                           _mm256_dpbusd_epi32(_mm256_setzero_si256(), flip, xv));,
                     _mm256_dpbusd_epi32(base, _mm256_xor_si256(wv, flip), xv))

DEFINE_Q8_ROWS_TIMES(rows_times_avxvnni, AVXVNNI_TARGET,
                     const __m256i base = _mm256_sub_epi32(_mm256_setzero_si256(),
                                                           _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), flip, xv));,
                     _mm256_dpbusd_avx_epi32(base, _mm256_xor_si256(wv, flip), xv))

DEFINE_Q8_ROWS_TIMES(rows_times_avx2, AVX2_TARGET, ,
                     _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones))
#endif

/* Weight rows [r0, r1) of a Q8_0 matrix (rows row_bytes apart) times Q8_0 activation rows xrow[0..m) (0..m
 * when xrow is NULL: quants xq [·, k], scales xd [·, k/32]) into out[i * ldo + r]. The products' drivers
 * (row chunks over threads, expert pairs) are kquant.c's quant_matmul and quant_matmul_pairs. */
void q8_rows_times(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const int8_t *xq, const float *xd,
                   int64_t k, const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa) {
#if defined(__x86_64__)
    if (k / QK <= NB_MAX && isa_runs(isa, ISA_AVX512) && (cpu_features() & CPU_VNNI)) {
        rows_times_vnni(w, row_bytes, r0, r1, xq, xd, k, xrow, m, out, ldo);
        return;
    }
    if (k / QK <= NB_MAX && isa_runs(isa, ISA_AVXVNNI)) {
        rows_times_avxvnni(w, row_bytes, r0, r1, xq, xd, k, xrow, m, out, ldo);
        return;
    }
    if (k / QK <= NB_MAX && isa_runs(isa, ISA_AVX2)) {
        rows_times_avx2(w, row_bytes, r0, r1, xq, xd, k, xrow, m, out, ldo);
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

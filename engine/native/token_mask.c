/* Token masks for constrained decoding (engine.constrain): a bit per vocabulary id, 32 ids a word, bit i % 32 of
 * word i / 32 set where id i may come next (llguidance's layout). One pass over a logit row, each lane keeping its
 * largest allowed value and the first id holding it, where numpy took an unpack, a select and an argmax (some 30 µs
 * on an 8k vocabulary: a tenth of the embedded model's decode step). Every form gives the same index: it is a
 * comparison. */
#include <math.h>
#include "kernels.h"

/* The lanes' best (value, first id; id -1: the lane saw no allowed id) folded into *top, *best: the largest value,
 * the smallest id on a tie, as one pass in id order would choose */
static void fold_lanes(const float *v, const int32_t *id, int lanes, float *top, int64_t *best) {
    for (int j = 0; j < lanes; j++)
        if (id[j] >= 0 && (*best < 0 || v[j] > *top || (v[j] == *top && id[j] < *best))) *top = v[j], *best = id[j];
}

#if defined(__x86_64__)
/* Whole words [0, nw): 1 with *best the first allowed NaN's id; else 0 with *top, *best the first maximum of the
 * allowed values (*best -1 where none is allowed) */
__attribute__((target(AVX512_TARGET)))
static int scan_avx512(const float *x, const uint32_t *bits, int64_t nw, float *top, int64_t *best) {
    __m512 acc = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_set1_epi32(-1);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t w = 0; w < nw; w++) {
        for (int h = 0; h < 2; h++) {
            const __mmask16 k = (__mmask16)(bits[w] >> (16 * h));
            if (!k) continue;
            const __m512 v = _mm512_loadu_ps(x + 32 * w + 16 * h);
            const __mmask16 nan = _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
            if (nan) return *best = 32 * w + 16 * h + __builtin_ctz(nan), 1;
            const __mmask16 up = k & (_mm512_cmp_ps_mask(v, acc, _CMP_GT_OQ) |
                                      _mm512_cmpeq_epi32_mask(at, _mm512_set1_epi32(-1)));
            acc = _mm512_mask_mov_ps(acc, up, v);
            at = _mm512_mask_mov_epi32(at, up, _mm512_add_epi32(lane, _mm512_set1_epi32((int)(32 * w + 16 * h))));
        }
    }
    float v[16];
    int32_t id[16];
    _mm512_storeu_ps(v, acc);
    _mm512_storeu_si512(id, at);
    fold_lanes(v, id, 16, top, best);
    return 0;
}

/* the same in 8 lanes: each byte of a mask word spread to lane masks */
__attribute__((target(AVX2_TARGET)))
static int scan_avx2(const float *x, const uint32_t *bits, int64_t nw, float *top, int64_t *best) {
    __m256 acc = _mm256_set1_ps(-INFINITY);
    __m256i at = _mm256_set1_epi32(-1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int64_t w = 0; w < nw; w++) {
        for (int q = 0; q < 4; q++) {
            const uint32_t byte = (bits[w] >> (8 * q)) & 0xFFu;
            if (!byte) continue;
            const __m256 k = _mm256_castsi256_ps(
                _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)byte), bit), bit));
            const __m256 v = _mm256_loadu_ps(x + 32 * w + 8 * q);
            const int nan = _mm256_movemask_ps(_mm256_and_ps(k, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
            if (nan) return *best = 32 * w + 8 * q + __builtin_ctz((unsigned)nan), 1;
            const __m256 up = _mm256_and_ps(k, _mm256_or_ps(_mm256_cmp_ps(v, acc, _CMP_GT_OQ), _mm256_castsi256_ps(
                _mm256_cmpeq_epi32(at, _mm256_set1_epi32(-1)))));
            acc = _mm256_blendv_ps(acc, v, up);
            at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(
                _mm256_add_epi32(lane, _mm256_set1_epi32((int)(32 * w + 8 * q)))), up));
        }
    }
    float v[8];
    int32_t id[8];
    _mm256_storeu_ps(v, acc);
    _mm256_storeu_si256((__m256i *)id, at);
    fold_lanes(v, id, 8, top, best);
    return 0;
}
#endif

/* The first maximum of x[i] over the ids i < n the mask allows, the first NaN among them if any (numpy's argmax on
 * the masked row: the caller refuses a row that is not finite); -1 where it allows none. */
int64_t masked_argmax(const float *x, const uint32_t *bits, int64_t n, int isa) {
    float top = -INFINITY;
    int64_t best = -1, w = 0;
#if defined(__x86_64__)
    const int64_t nw = n / 32;  /* whole words in vectors; the last, partial one below */
    if (isa_runs(isa, ISA_AVX512) || isa_runs(isa, ISA_AVX2)) {
        if (isa_runs(isa, ISA_AVX512) ? scan_avx512(x, bits, nw, &top, &best) : scan_avx2(x, bits, nw, &top, &best))
            return best;
        w = nw;
    }
#else
    (void)isa;
#endif
    for (; 32 * w < n; w++) {  /* ids in order: a later one wins only by a larger value */
        uint32_t m = bits[w];
        if (32 * w + 32 > n) m &= (1u << (n - 32 * w)) - 1u;  /* ids past the row */
        while (m) {
            const int64_t i = 32 * w + __builtin_ctz(m);
            m &= m - 1u;
            if (isnan(x[i])) return i;
            if (best < 0 || x[i] > top) top = x[i], best = i;
        }
    }
    return best;
}

#if defined(__x86_64__)
__attribute__((target(AVX512_TARGET)))
static void mask_words_avx512(float *x, const uint32_t *bits, int64_t nw) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t w = 0; w < nw; w++) {
        const uint32_t m = bits[w];
        if (m == 0xFFFFFFFFu) continue;
        _mm512_mask_storeu_ps(x + 32 * w, (__mmask16)~m, ninf);
        _mm512_mask_storeu_ps(x + 32 * w + 16, (__mmask16)~(m >> 16), ninf);
    }
}
#endif

/* x[i] = -inf for every id i < n the mask does not allow (ids at or past n_bits: none are allowed) */
void mask_row(float *x, const uint32_t *bits, int64_t n_bits, int64_t n, int isa) {
    int64_t i = 0;
#if defined(__x86_64__)
    if (isa_runs(isa, ISA_AVX512)) {
        const int64_t nw = (n < n_bits ? n : n_bits) / 32;
        mask_words_avx512(x, bits, nw);
        i = 32 * nw;
    }
#else
    (void)isa;
#endif
    for (; i < n; i++)
        if (i >= n_bits || !((bits[i >> 5] >> (i & 31)) & 1u)) x[i] = -INFINITY;
}

/* What the native kernel files share: ggml type ids, tile sizes, the activation rows' layout, instruction-set
 * targets, and the functions one file calls in another. The calls between files form a DAG: kquant.c (the
 * quantized products' drivers) calls q8_0.c, packed_x16.c and iq_grid.c; every file asks cpu.c which instruction sets
 * run. */
#ifndef FORETELL_KERNELS_H
#define FORETELL_KERNELS_H

#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define QK_K 256  /* values per K-quant block and per Q8_K activation block */
#define QK8_0 32  /* values per Q8_0 block */
#define M_TILE 64
#define ROW_CHUNK 16  /* weight rows per work item, and per cross-lane sum (sum16) */
enum { T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };  /* ggml type ids */
/* Q4_K, Q6_K and Q8_0 weights packed by repack_x16, 16 rows interleaved (not ggml types: ours, for the VNNI products) */
enum { T_Q8_0_PACKED = 108, T_Q4_K_PACKED = 112, T_Q6_K_PACKED = 114 };

/* q8_0.c: Q8_0 weight rows (stored blocks) times Q8_0 activation rows */
void q8_rows_times(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const int8_t *xq, const float *xd,
                   int64_t k, const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa);

/* cpu.c: what this CPU runs, detected once: CPU_AVX512 (AVX512F/BW and F16C: the stored-order K-quant products,
 * the Q8_K quantizer and the float kernels' register forms), CPU_VNNI (and AVX512VL, VNNI, FMA: the packed
 * products and the Q8_0 ones), CPU_AVX2 (and FMA, F16C: the 256-bit products). */
enum { CPU_AVX512 = 1, CPU_VNNI = 2, CPU_AVX2 = 4 };
int cpu_features(void);

/* The instruction-set level a call asks for (engine.ops.backend's isa, the one choice): every kernel runs its best
 * form at or below that level that this CPU has. isa_runs(isa, level): whether a form of `level` may run. */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_VNNI = 3 };
int isa_runs(int isa, int level);

/* The activations the float kernels share, one expression each, so every file computes the same bits. */
static inline float silu_f(float x) { return x / (1.f + expf(-x)); }
static inline float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

/* norm.c: per-row RMS (or L2) norm of x [n, d], times w [d], times gate [n, d], times post (each optional) */
void norm_rows(const float *x, int64_t n, int64_t d, const float *w, const float *gate, float eps, int l2,
               float post, float *y);

/* pool.c: fn(ctx, i) for i in [0, n_items) on up to n_threads threads (the caller's included), each item once;
 * returns when all are done. The caller works too and never waits for a thread that has not started an item. */
typedef void (*pool_fn)(void *ctx, int64_t item);
void pool_run(int n_threads, int64_t n_items, pool_fn fn, void *ctx);

typedef struct {
    const int8_t *q;  /* [rows, k] */
    const float *d;  /* [rows, k/256] */
    const int16_t *bs;  /* [rows, k/16] */
    int64_t k;
} Acts;

/* iq_grid.c: the grid-codebook IQ types (ggml type ids) against Q8_K activation rows. rows_times_iq: weight rows
 * [r0, r1) (stored blocks, rows row_bytes apart) times activation rows xrow[0..m) (0..m when NULL) into
 * out[i * ldo + r]; each output's bits independent of m, the row grouping and the threads. */
enum { T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ3_S = 21, T_IQ2_S = 22, T_IQ1_M = 29 };
int iq_grid_type(int qtype);
void rows_times_iq(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                   const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa);

#if defined(__x86_64__)
#define AVX512_TARGET "avx512f,avx512bw,f16c"
#define AVX2_TARGET "avx2,fma,f16c"

/* the horizontal sum of 8 float lanes, always in this order (halves, then pairs, then the last two) */
__attribute__((target("avx"), always_inline))
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

__attribute__((target("f16c"), always_inline))
static inline float fp16_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

typedef struct {
    const int8_t *q;  /* the row's quants, block 0 */
    const float *d;  /* its block scales */
    const int16_t *bs;  /* its sums of 16 quants */
} Row;
#define VNNI_TARGET "avx512f,avx512bw,avx512vl,f16c,avx512vnni"

/* packed_x16.c: packed weight rows [r0, r1) (whole groups of 16) times activation rows xrow[0..m) (0..m when NULL) */
void rows_times_x16(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                    const int64_t *xrow, int64_t m, float *out, int64_t ldo);
#endif

#endif

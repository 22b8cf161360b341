/* What the native kernel files share: ggml type ids, tile sizes, the activation rows' layout, instruction-set
 * targets, and the functions one file calls in another. The calls between files form a DAG: kquant.c (the
 * quantized products' drivers) calls q8_0.c, kquant_more.c, legacy.c, half.c, iq_grid.c and packed_x16.c; every file
 * asks cpu.c which instruction sets run. */
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
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
       T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30, T_MXFP4 = 39 };  /* ggml type ids */
/* the K-quants', Q8_0's, IQ4_XS's and the 32-value nibble types' weights packed by repack_x16, GROUP rows interleaved (not ggml
 * types: ours, for the VNNI and AVX2 packed products): PACKED_BASE + the ggml type */
#define PACKED_BASE 100
enum { T_Q4_0_PACKED = 102, T_Q4_1_PACKED = 103, T_Q5_0_PACKED = 106, T_Q5_1_PACKED = 107, T_Q8_0_PACKED = 108,
       T_Q2_K_PACKED = 110, T_Q3_K_PACKED = 111, T_Q4_K_PACKED = 112, T_Q5_K_PACKED = 113, T_Q6_K_PACKED = 114,
       T_IQ4_NL_PACKED = 120, T_IQ4_XS_PACKED = 123, T_MXFP4_PACKED = 139 };
#define GROUP 16
#define X16_TILE 4  /* activation rows per pass over a packed group block (their sums stay in registers) */
#define X16_TILE_WIDE 6  /* the same in AVX512's 32 registers, for packed_x16.c's types (at 8 their sums spill) */

/* What the exported calls return on failure (0 on success; group_expert_pairs a count). A call returns the failure
 * it meets as it is, in a call it makes too, so a code means the same whichever call returns it; engine/ops/native.py
 * raises one exception per code, by its name (border.c). */
enum { RC_NO_MEMORY = -1, RC_EXPERT_ID = -2, RC_MAX_EXPERTS = -3, RC_MAX_DV = -4, RC_ROW_ID = -5, RC_ROW_TYPE = -6 };
/* the limits behind RC_MAX_EXPERTS (moe_route: a token's expert probabilities are on the stack) and RC_MAX_DV
 * (gdn_recurrence: a value row in registers or on the stack) */
#define MAX_EXPERTS 1024
#define MAX_DV 1024

/* The weight bytes a thread reads next (its next work item: the following rows, or the next expert's matrix, which
 * is elsewhere in memory), prefetched while it works through the current item: ahead_step(h, bytes) after
 * consuming `bytes` of the current item asks for as many of the next. Prefetching a fixed distance past the current
 * bytes fetched the neighbouring expert's rows, unused, at the end of every expert matrix and nothing of the next
 * one. */
typedef struct {
    const char *p, *end;
    int64_t credit;
} Ahead;
static inline void ahead_step(Ahead *h, int64_t bytes) {
    h->credit += bytes;
    for (; h->credit >= 64 && h->p < h->end; h->credit -= 64, h->p += 64) __builtin_prefetch(h->p, 0, 3);
}

/* q8_0.c: Q8_0 weight rows (stored blocks) times Q8_0 activation rows */
void q8_rows_times(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const int8_t *xq, const float *xd,
                   int64_t k, const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa);

/* cpu.c: what this CPU runs, detected once: CPU_AVX512 (AVX512F/BW and F16C: the stored-order K-quant products,
 * the Q8_K quantizer and the float kernels' register forms), CPU_VNNI (and AVX512VL, VNNI, FMA: the packed
 * products and the Q8_0 ones), CPU_AVX2 (and FMA, F16C: the 256-bit products), CPU_AVXVNNI (AVX2 and the VEX
 * AVX-VNNI of Intel's desktop cores from Alder Lake on, most without AVX512: the 256-bit packed and Q8_0 products
 * with dpbusd). */
enum { CPU_AVX512 = 1, CPU_VNNI = 2, CPU_AVX2 = 4, CPU_AVXVNNI = 8 };
int cpu_features(void);

/* The instruction-set level a call asks for (engine.ops.backend's isa, the one choice): every kernel runs its best
 * form at or below that level that this CPU has. isa_runs(isa, level): whether a form of `level` may run. */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512 = 3, ISA_VNNI = 4 };
int isa_runs(int isa, int level);

/* The activations the float kernels share, one expression each, so every file computes the same bits. */
/* e^x in float operations only (Cephes' expf: x = n ln2 + r, |r| ≤ ln2/2, r split against ln2 in two parts, a
 * degree-6 polynomial, 2^n put in the exponent bits; within 2 ulp of the exact value), written so that a loop over it
 * vectorizes: a call to libm's expf per element made the silu and sigmoid of a decode step (some 9000 per layer of
 * the mid fixture) a twentieth of the step. Every ISA a loop is compiled for computes the same bits: the same IEEE
 * operations element by element, and no contraction into FMAs (-ffp-contract=off). Below −87.3 it gives e^−87.3,
 * above 88.72 +inf, between 88.38 and 88.72 e^88.38: none of these matter to silu or sigmoid. */
static inline float exp_f(float x) {
    const float big = x > 88.72283935546875f ? INFINITY : 0.f;
    x = x > 88.3762626647949f ? 88.3762626647949f : x;
    x = x < -87.3365478515625f ? -87.3365478515625f : x;
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.f) - 12582912.f;  /* t rounded to the nearest integer (|t| < 2^22) */
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    const float y = p * scale;
    return big > 0.f ? big : y;
}
static inline float silu_f(float x) { return x / (1.f + exp_f(-x)); }
static inline float sigmoid_f(float x) { return 1.f / (1.f + exp_f(-x)); }
/* the loops over them: one clone per vector width (the same bits, see exp_f) */
#define ELEMENTWISE __attribute__((target_clones("avx512f", "avx2", "default")))

/* norm.c: per-row RMS (or L2) norm of x [n, d], times w [d], times gate [n, d], times post (each optional) */
void norm_rows(const float *x, int64_t n, int64_t d, const float *w, const float *gate, float eps, int l2,
               float post, float *y);

/* moe.c: one projection's stack of experts as the products read them: bytes (stored blocks or packed), kernel type
 * code (a ggml type or a T_*_PACKED), n_expert matrices of n_rows × k, expert_bytes apart (a dense projection is a
 * stack of one); threads: the pool threads its products use. */
typedef struct {
    const uint8_t *w;
    int64_t expert_bytes, n_rows, k;
    int32_t code, threads;
} ExpertStack;

/* Activation rows in one weight type's format (act_format): Q8_K (with the Q4_K order of the quants where the
 * AVX512 stored-order Q4_K product reads them), Q8_0, Q8_1 (and its sums s), or the values rounded to F16/BF16
 * (16 bits each, in q). act_rows makes them for stack s's products (0, or -1 when out of memory); act_rows_free
 * releases them either way. */
typedef struct {
    int8_t *q, *perm;
    float *d, *s;
    int16_t *bs;
} QRows;
int act_rows(const ExpertStack *s, const float *x, int64_t m, int isa, QRows *r);
void act_rows_free(QRows *r);
int moe_layer(const float *router, const float *shared_inp, const ExpertStack *sg, const ExpertStack *su,
              const ExpertStack *sd, const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down,
              const float *x, int64_t n, int64_t k_used, int64_t n_expert, float *logits, float *wts, int64_t *idx,
              float *y, int isa);
void silu_mul(float *g, const float *u, int64_t n);

/* kquant.c: y [m, n_rows] (row stride ldy) = activation rows (act_rows' parts) × the weight rows w */
void quant_matmul(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n_rows, const int8_t *xq, const float *xd,
                  const int16_t *xbs, const float *xs, const int8_t *xperm, int64_t k, int64_t m, float *y,
                  int64_t ldy, int n_threads, int isa);

/* gdn.c, attention.c, norm.c: the mixers' pieces (engine.ops.native documents each) */
int gdn_recurrence(const float *q, const float *k, const float *v, const float *beta, const float *decay,
                   const float *S_in, float *S_out, float *o, int64_t n, int64_t H, int64_t Hk, int64_t dk,
                   int64_t dv, int n_threads, int isa);
void gdn_inputs(const float *window, const float *taps, int64_t n, int64_t c, int64_t kk, const float *b,
                const float *a, const float *A, const float *dt_bias, int64_t h, int64_t hk, int64_t dk, float eps,
                float q_scale, float *u, float *q, float *k, float *beta, float *g);
int attention_causal(const float *q, const float *k, const float *v, float *out, int64_t n, int64_t pos,
                     int64_t n_head, int64_t n_kv, int64_t dk, int64_t dv, float scale, int n_threads, int isa);
void rope_neox(float *x, int64_t n, int64_t h, int64_t d, int64_t n_rot, const float *cos_t, const float *sin_t);

/* sketch.c: a 2-bit sketch of a wide matrix (values per block of codes and one scale) and its product with a float
 * row, for the draft pass's logits */
#define SKETCH_BLOCK 128
/* kquant.c: rows ids[0..n) of a Q4_K, Q5_K, Q6_K or Q8_0 matrix as float32 rows of k values */
int dequant_rows(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n_rows, const int64_t *ids, int64_t n,
                 int64_t k, float *out);
int sketch_make(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *codes, float *scales,
                int threads);
int sketch_scores(const uint8_t *codes, const float *scales, int64_t n, int64_t k, const float *x, float *out,
                  int threads, int isa);
int sketch_logits(const uint8_t *codes, const float *scales, int64_t n, int64_t k, const float *x, const ExpertStack *head,
                  int64_t m, float *out, int threads, int isa);

/* token_mask.c: a logit row under a constrained decoding's token mask (a bit per id, 32 a word) */
int64_t masked_argmax(const float *x, const uint32_t *bits, int64_t n, int isa);
void mask_row(float *x, const uint32_t *bits, int64_t n_bits, int64_t n, int isa);

/* pool.c: fn(ctx, i) for i in [0, n_items) on up to n_threads threads (the caller's included), each item once;
 * returns when all are done. The caller works too and never waits for a thread that has not started an item. */
typedef void (*pool_fn)(void *ctx, int64_t item);
void pool_run(int n_threads, int64_t n_items, pool_fn fn, void *ctx);
/* the workers prefetch these byte ranges while the caller goes on (pool.c: the serial gaps between products) */
void pool_prefetch(int n_threads, const Ahead *ranges, int n);

/* trace.c: the step's time by section while tracing is on (bench/step_profile.py); TRACE_POOL_WAIT and
 * TRACE_PREFETCH are the pool's: a caller waiting for other threads' items (inside the other sections' time), and
 * the prefetch jobs handed to the workers (marks and bytes, no time). */
enum { TRACE_NORM, TRACE_ACT_QUANT, TRACE_PROJECTION, TRACE_GDN_INPUTS, TRACE_RECURRENCE, TRACE_GATED_NORM,
       TRACE_ATTENTION, TRACE_ROUTER, TRACE_EXPERT_PRODUCTS, TRACE_EXPERT_MISC,
       TRACE_POOL_WAIT, TRACE_PREFETCH, TRACE_N };
int64_t clock_ns(void);
int trace_on(void);
void trace_mark(int sec, int64_t bytes);
void trace_add(int sec, int64_t ns, int64_t bytes);
void trace_restart(void);

/* The activation rows a weight type's product takes (ggml-cpu's vec_dot_type): Q8_K for the K- and IQ-quants (and
 * any type not named here), Q8_0 for Q8_0 and the 32-value types without a minimum, Q8_1 (Q8_0's quants and scales
 * with s = fp16(d·Σq) per block) for Q4_1 and Q5_1, the values rounded to F16 / BF16 for half-precision weights. */
enum { ACT_Q8_K = 0, ACT_Q8_0 = 1, ACT_Q8_1 = 2, ACT_F16 = 3, ACT_BF16 = 4 };
static inline int act_format(int code) {
    switch (code) {
    case T_Q8_0: case T_Q8_0_PACKED: case T_Q4_0: case T_Q5_0: case T_IQ4_NL: case T_MXFP4: case T_Q4_0_PACKED:
    case T_Q5_0_PACKED: case T_IQ4_NL_PACKED: case T_MXFP4_PACKED: return ACT_Q8_0;
    case T_Q4_1: case T_Q5_1: case T_Q4_1_PACKED: case T_Q5_1_PACKED: return ACT_Q8_1;
    case T_F16: return ACT_F16;
    case T_BF16: return ACT_BF16;
    default: return ACT_Q8_K;
    }
}

typedef struct {
    const int8_t *q;  /* [rows, k]; F16/BF16 products: the rows' 16-bit values, [rows, k] uint16 */
    const float *d;  /* [rows, k/256] (Q8_K) or [rows, k/32] (Q8_0, Q8_1: f16-rounded) */
    const int16_t *bs;  /* Q8_K: [rows, k/16] */
    int64_t k;
    const float *s;  /* Q8_1: [rows, k/32], fp16(d·Σq) as a float */
} Acts;

/* kquant.c: one expert-pair product (quant_matmul_pairs's operands, pairs_job makes it); pairs_run runs several in
 * one pool call */
typedef struct {
    int qtype, isa;
    const uint8_t *w;
    int64_t expert_bytes, row_bytes, n_rows, per;
    Acts a;
    const int8_t *xperm;
    const int64_t *xrow, *experts, *starts;
    float *out;
    int64_t n_groups;
} PairsJob;
PairsJob pairs_job(int qtype, const uint8_t *w, int64_t expert_bytes, int64_t row_bytes, int64_t n_rows,
                   const int8_t *xq, const float *xd, const int16_t *xbs, const float *xs, const int8_t *xperm,
                   int64_t k, const int64_t *xrow, int64_t n_groups, const int64_t *experts, const int64_t *starts,
                   float *out, int isa);
void pairs_run(const PairsJob *jobs, int n_jobs, int n_threads);
void pairs_group(const PairsJob *j, int64_t g, const PairsJob *then, int64_t then_g);

/* iq_grid.c: the grid-codebook IQ types (ggml type ids) against Q8_K activation rows. rows_times_iq: weight rows
 * [r0, r1) (stored blocks, rows row_bytes apart) times activation rows xrow[0..m) (0..m when NULL) into
 * out[i * ldo + r]; each output's bits independent of m, the row grouping and the threads. */
enum { T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ3_S = 21, T_IQ2_S = 22, T_IQ1_M = 29 };
int iq_grid_type(int qtype);
void rows_times_iq(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                   const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa);

/* A K-quant weight block unpacked for the portable products: unsigned values v[256] in natural order, the integer
 * scale of each group of 4 values (lane), the integer weights of the activations' sums of 16 taken off (corr), and
 * the float factors. Per type (kquant.c K_TYPES), corr is either a min term scaled by dmin (Q4_K, Q5_K, Q2_K) or the
 * offset the values are stored with, taken off inside the integer sum (Q6_K: q + 32, Q3_K: q + 4, IQ4_XS: + 128). */
typedef struct {
    uint8_t v[QK_K];
    int32_t lane[QK_K / 4];
    int32_t corr[16];  /* weight of bsum16[j] in the correction term */
    float d, dmin;
} Block;

/* Sub-block j (of 8) of a Q4_K / Q5_K block's 6-bit scale and min, from the 12 scale bytes s */
static inline void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* kquant_more.c: Q5_K, Q3_K, Q2_K and IQ4_XS blocks unpacked (portable products) */
void unpack_q5_k(const uint8_t *b, Block *o);
void unpack_q3_k(const uint8_t *b, Block *o);
void unpack_q2_k(const uint8_t *b, Block *o);
void unpack_iq4_xs(const uint8_t *b, Block *o);

/* legacy.c: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and MXFP4 rows [r0, r1) times Q8_0 / Q8_1 activation rows xrow[0..m)
 * (0..m when NULL) into out[i * ldo + r]; half.c: F16 and BF16 rows times the rows' rounded values, the same way. */
void rows_times_legacy(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                       const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa, const Ahead *next);
int legacy_row(int qtype, const uint8_t *row, int64_t k, float *out);  /* a row as float32; -1: not a legacy type */
void rows_times_half(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                     const int64_t *xrow, int64_t m, float *out, int64_t ldo, int isa);
void round_half(const float *x, int64_t n, int bf16, uint16_t *out);

/* act_quant.c: activation rows [m_rows, k] quantized for the integer products */
void quantize_q8_k(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, int16_t *bsums, int isa);
void quantize_q8_0(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, int isa);
void quantize_q8_1(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, float *s, int isa);
void q8_k_to_q4_k_order(const int8_t *q, int64_t m, int64_t k, int8_t *out);

/* 8 float lanes summed in hsum8's order (halves, then pairs, then the last two): the portable forms' twin of it */
static inline float lanes_sum(const float *a) {
    const float h0 = a[0] + a[4], h1 = a[1] + a[5], h2 = a[2] + a[6], h3 = a[3] + a[7];
    return (h0 + h2) + (h1 + h3);
}

/* IEEE half to float, portable (no F16C) */
static inline float fp16_to_f32(const uint8_t *p) {
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

#if defined(__x86_64__)
#define AVX512_TARGET "avx512f,avx512bw,f16c"
#define AVX2_TARGET "avx2,fma,f16c"
#define AVXVNNI_TARGET "avx2,fma,f16c,avxvnni"

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
    const float *s;  /* Q8_1: its sums s (Q4_1's minimums multiply them) */
} Row;

/* A Q4_K (or Q5_K) block's 6-bit scales and mins, 8 of each, as bytes sc0..7, mn0..7 */
static inline __m128i q4_k_scales(const uint8_t *blk) {
    uint32_t u[3];
    memcpy(u, blk + 4, 12);
    return _mm_setr_epi32((int)(u[0] & 0x3f3f3f3f), (int)((u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4)),
                          (int)(u[1] & 0x3f3f3f3f), (int)(((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4)));
}

/* Σ_j madd(maddubs(v[j], quants 32j …), s[j]) from p0, in two chains (even and odd j): exact int32 lanes */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i dot8(const __m256i *v, const __m256i *s, const int8_t *x, __m256i p0) {
    __m256i p1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(
            _mm256_maddubs_epi16(v[j], _mm256_loadu_si256((const __m256i *)(x + 32 * j))), s[j]));
        p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(
            _mm256_maddubs_epi16(v[j + 1], _mm256_loadu_si256((const __m256i *)(x + 32 * j + 32))), s[j + 1]));
    }
    return _mm256_add_epi32(p0, p1);
}

/* Σ over a block's four 64-value vectors of scale·value·quant (maddubs, then madd by the 16-bit scales s[j]) with
 * the quants x 64j …: exact int32 lanes (the AVX512 K-quant products) */
__attribute__((target(AVX512_TARGET), always_inline))
static inline __m512i row_sum(const __m512i *v, const __m512i *s, const int8_t *x) {
    const __m512i p0 = _mm512_madd_epi16(_mm512_maddubs_epi16(v[0], _mm512_loadu_si512(x)), s[0]);
    const __m512i p1 = _mm512_madd_epi16(_mm512_maddubs_epi16(v[1], _mm512_loadu_si512(x + 64)), s[1]);
    const __m512i p2 = _mm512_madd_epi16(_mm512_maddubs_epi16(v[2], _mm512_loadu_si512(x + 128)), s[2]);
    const __m512i p3 = _mm512_madd_epi16(_mm512_maddubs_epi16(v[3], _mm512_loadu_si512(x + 192)), s[3]);
    return _mm512_add_epi32(_mm512_add_epi32(p0, p1), _mm512_add_epi32(p2, p3));
}

/* the T rows' sums of a packed group in the 256-bit forms, rows 0-7 and 8-15, to o[i · ldo + l] */
__attribute__((target(AVX2_TARGET), always_inline))
static inline void store_x16_avx2(__m256 acc[][2], float *o, int64_t ldo, const int T) {
    for (int i = 0; i < T; i++) {
        _mm256_storeu_ps(o + i * ldo, acc[i][0]);
        _mm256_storeu_ps(o + i * ldo + 8, acc[i][1]);
    }
}

/* bit `bit` of every byte of a packed fifth-bit vector (packed_nib.c's Q5_0 / Q5_1, packed_x16.c's Q5_K), as 0x10
 * (a value's fifth bit); shifts of 16-bit words move no other
 * byte's bit there for shifts of at most 4 */
__attribute__((target(AVX512_TARGET), always_inline))
static inline __m512i fifth512(__m512i h, const int bit) {
    const __m512i at4 = bit < 4 ? _mm512_slli_epi16(h, 4 - bit) : bit > 4 ? _mm512_srli_epi16(h, bit - 4) : h;
    return _mm512_and_si512(at4, _mm512_set1_epi8(0x10));
}

__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256i fifth256(__m256i h, const int bit) {
    const __m256i at4 = bit < 4 ? _mm256_slli_epi16(h, 4 - bit) : bit > 4 ? _mm256_srli_epi16(h, bit - 4) : h;
    return _mm256_and_si256(at4, _mm256_set1_epi8(0x10));
}

/* kquant_more.c: Q3_K's 16 signed 6-bit scales (stored + 32, returned − 32) from its block b */
void q3_k_scales(const uint8_t *b, int8_t sc[16]);

/* kquant_more.c: a Q5_K / Q3_K / Q2_K / IQ4_XS weight row's nb blocks times the tile's activation rows into their
 * 8-lane (AVX2) or 16-lane (AVX512) float sums */
void rows_k_more_avx2(int qtype, const uint8_t *row, int64_t nb, const Row *rows, int64_t tn, __m256 *acc);
void rows_k_more_avx512(int qtype, const uint8_t *row, int64_t nb, const Row *rows, int64_t tn, __m512 *acc);
#define VNNI_TARGET "avx512f,avx512bw,avx512vl,f16c,avx512vnni"

/* packed_nib.c: the packed 32-value nibble types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4): bytes per row and block
 * (the stored blocks' but MXFP4's 17, 18 packed), one group's
 * repacking, and tn ≤ 4 activation rows times one group in each form (VNNI, AVX-VNNI, AVX2: the same bits) */
int64_t packed_nib_bytes(int qtype);
void repack_nib_group(int qtype, const uint8_t *src, int64_t nb, uint8_t *dst);
void nib_x16_group_vnni(int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, int tn,
                        Ahead *ah);
void nib_x16_group_avxvnni(int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, int tn,
                           Ahead *ah);
void nib_x16_group_avx2(int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, int tn,
                        Ahead *ah);

/* packed_iq4_xs.c: packed IQ4_XS: bytes per row and block, one group's repacking, tn ≤ 4 activation rows times one
 * group in each form (VNNI, AVX-VNNI, AVX2: the same bits) */
int64_t packed_iq4_xs_bytes(void);
void repack_iq4_xs_group(const uint8_t *src, int64_t nb, uint8_t *dst);
void iq4_xs_x16_group_vnni(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, int tn, Ahead *ah);
void iq4_xs_x16_group_avxvnni(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, int tn,
                              Ahead *ah);
void iq4_xs_x16_group_avx2(const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, int tn, Ahead *ah);

/* packed_q23_k.c: packed Q2_K and Q3_K, as packed_iq4_xs.c's (the type an argument) */
int64_t packed_q23_k_bytes(int qtype);
void repack_q23_k_group(int qtype, const uint8_t *src, int64_t nb, uint8_t *dst);
void q23_k_x16_group_vnni(int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, int tn,
                          Ahead *ah);
void q23_k_x16_group_avxvnni(int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, int tn,
                             Ahead *ah);
void q23_k_x16_group_avx2(int qtype, const uint8_t *g, int64_t nb, const Row *rows, float *o, int64_t ldo, int tn,
                          Ahead *ah);

/* packed_x16.c: packed weight rows [r0, r1) (whole groups of 16) times activation rows xrow[0..m) (0..m when NULL),
 * prefetching `ahead` as it goes, in the best form isa allows (VNNI, else AVX-VNNI, else AVX2: the same bits) */
void rows_times_x16(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const Acts *a,
                    const int64_t *xrow, int64_t m, float *out, int64_t ldo, Ahead *ahead, int isa);
#endif

#endif

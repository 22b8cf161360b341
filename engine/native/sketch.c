/* A 2-bit sketch of a wide matrix (the output head) and its product with one float row: the draft pass's estimate of
 * every logit, read at about a third of a Q6_K head's bytes (engine/ops/draft_head.py rescores the best candidates
 * with the real head).
 *
 * A block of SKETCH_BLOCK values keeps 32 bytes of codes c ∈ 0..3 (byte j holds values j, j+32, j+64, j+96 in its
 * bit pairs 0-1, 2-3, 4-5, 6-7) and one float scale s: value ≈ (2c − 3)·s, a uniform 4-level quantizer with step
 * 2s = 0.996 × the block's RMS (the best uniform step for Gaussian values). The product (below) takes a block's
 * codes with one mask (or shift and mask) and one byte multiply-add per 32 values, two blocks an instruction in the
 * VNNI form, the float work per block in one fused multiply-add: a draft's head work reads at 0.79-0.94 of the read
 * bandwidth on two cores in every form, 0.69-0.82 with a block's sums widened and scaled one part at a time
 * (bench/results/head_draft.json, head_draft_before.json). */
#include <stdlib.h>
#include "kernels.h"

#define SKETCH_ROWS 64  /* rows per pool item */
#define PF_AHEAD 4096  /* code bytes asked for ahead of the ones read: the hardware prefetcher alone left the product
                          * short of the read bandwidth */

typedef struct {
    int qtype;
    const uint8_t *w;
    int64_t row_bytes, n, k;
    uint8_t *codes;
    float *scales;
    int rc;
} MakeJob;

static void make_item(void *ctx, int64_t item) {
    MakeJob *j = ctx;
    const int64_t nb = j->k / SKETCH_BLOCK, r0 = item * SKETCH_ROWS;
    const int64_t r1 = r0 + SKETCH_ROWS < j->n ? r0 + SKETCH_ROWS : j->n;
    const float *rows = (const float *)(j->w + r0 * j->row_bytes);
    float *buf = NULL;
    if (j->qtype != T_F32) {  /* stored blocks: this item's rows dequantized first */
        int64_t ids[SKETCH_ROWS];
        for (int64_t r = r0; r < r1; r++) ids[r - r0] = r;
        buf = malloc((size_t)(r1 - r0) * (size_t)j->k * sizeof(float));
        const int rc = buf ? dequant_rows(j->qtype, j->w, j->row_bytes, j->n, ids, r1 - r0, j->k, buf) : RC_NO_MEMORY;
        if (rc) {
            j->rc = rc;  /* every failing item writes the same code */
            free(buf);
            return;
        }
        rows = buf;
    }
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = rows + (r - r0) * j->k + b * SKETCH_BLOCK;
            float ss8[8] = {0}, ss = 0.f;  /* eight partial sums: a loop the compiler vectorizes */
            for (int i = 0; i < SKETCH_BLOCK; i++) ss8[i % 8] += v[i] * v[i];
            for (int i = 0; i < 8; i++) ss += ss8[i];
            const float step = 0.996f * sqrtf(ss / SKETCH_BLOCK), inv = step > 0.f ? 1.f / step : 0.f;
            uint8_t q[SKETCH_BLOCK], *c = j->codes + (r * nb + b) * (SKETCH_BLOCK / 4);
            for (int i = 0; i < SKETCH_BLOCK; i++) {  /* floor(v/step) + 2 by truncation: |v/step| < 12 in a block */
                const int t = (int)(v[i] * inv + 1026.f) - 1024;
                q[i] = (uint8_t)(t < 0 ? 0 : t > 3 ? 3 : t);
            }
            for (int i = 0; i < SKETCH_BLOCK / 4; i++)
                c[i] = (uint8_t)(q[i] | q[32 + i] << 2 | q[64 + i] << 4 | q[96 + i] << 6);
            j->scales[r * nb + b] = 0.5f * step;
        }
    }
    free(buf);
}

/* The sketch of a matrix of n rows of k values (k a multiple of SKETCH_BLOCK; rows row_bytes apart): float32 rows
 * (qtype T_F32) or stored blocks of a type dequant_rows reads, dequantized a pool item's rows at a time. Writes codes
 * [n, k/4] and scales [n, k/SKETCH_BLOCK]; returns 0, RC_ROW_TYPE (a type dequant_rows does not read) or
 * RC_NO_MEMORY. */
int sketch_make(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *codes, float *scales,
                int threads) {
    MakeJob j = {qtype, w, row_bytes, n, k, codes, scales, 0};
    pool_run(threads, (n + SKETCH_ROWS - 1) / SKETCH_ROWS, make_item, &j);
    return j.rc;
}

/* The product: the row quantized to int8 (one scale), each block's Σ c·x exactly in 8 integer lanes (lane l: the
 * values 4l…4l+3 of each 32), then per lane t = 2·Σ c·x − 3·Σ x (exact in float) times the block's scale into a float
 * sum with fmaf: the even blocks' into lanes 0-7, the odd blocks' into lanes 8-15 (the 512-bit form takes two blocks
 * an instruction), the two halves added at the end of the row and the 8 lanes summed in hsum8's order. Every form
 * gives the portable form's bits. */
typedef struct {
    const uint8_t *codes;
    const float *scales;
    int64_t n, k;
    const int8_t *xq;
    const int8_t *xpair;  /* per pair of blocks and code s: the two blocks' values 32s…32s+31 (64 bytes; VNNI) */
    const float *x3;  /* per block and lane: 3 × the lane's sum of quants */
    float xd;
    float *out;
    int isa;
} ScoreJob;

static void score_rows_portable(const ScoreJob *j, int64_t r0, int64_t r1) {
    const int64_t nb = j->k / SKETCH_BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        float acc[16] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *c = j->codes + (r * nb + b) * (SKETCH_BLOCK / 4);
            const int8_t *x = j->xq + b * SKETCH_BLOCK;
            int32_t p[8] = {0};
            for (int s = 0; s < 4; s++)
                for (int i = 0; i < 32; i++) p[i / 4] += ((c[i] >> (2 * s)) & 3) * x[32 * s + i];
            const float sc = j->scales[r * nb + b];
            for (int l = 0; l < 8; l++) {
                float *a = acc + 8 * (b & 1) + l;
                *a = fmaf(2.f * (float)p[l] - j->x3[b * 8 + l], sc, *a);
            }
        }
        float a8[8];
        for (int l = 0; l < 8; l++) a8[l] = acc[l] + acc[8 + l];
        j->out[r] = lanes_sum(a8) * j->xd;
    }
}

#if defined(__x86_64__)
/* AVX2: a block's four 32-value parts, each byte's code pair by shift and mask, the parts' int16 pairs summed (at most
 * 4 · 2 · 3 · 127) before one madd widens them */
__attribute__((target(AVX2_TARGET), always_inline))
static inline __m256 block_avx2(const uint8_t *c, const int8_t *x, const float *x3) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)c), m3 = _mm256_set1_epi8(3);
    __m256i p16 = _mm256_maddubs_epi16(_mm256_and_si256(v, m3), _mm256_loadu_si256((const __m256i *)x));
    for (int s = 1; s < 4; s++)
        p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m3),
                                                         _mm256_loadu_si256((const __m256i *)(x + 32 * s))));
    const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
    return _mm256_fmsub_ps(p, _mm256_set1_ps(2.f), _mm256_loadu_ps(x3));
}

__attribute__((target(AVX2_TARGET))) static void score_rows_avx2(const ScoreJob *j, int64_t r0, int64_t r1) {
    const int64_t nb = j->k / SKETCH_BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *c = j->codes + r * nb * (SKETCH_BLOCK / 4);
        const float *sc = j->scales + r * nb;
        __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            _mm_prefetch((const char *)(c + 32 * b + PF_AHEAD), _MM_HINT_T0);
            even = _mm256_fmadd_ps(block_avx2(c + 32 * b, j->xq + b * SKETCH_BLOCK, j->x3 + 8 * b),
                                   _mm256_broadcast_ss(sc + b), even);
            odd = _mm256_fmadd_ps(block_avx2(c + 32 * (b + 1), j->xq + (b + 1) * SKETCH_BLOCK, j->x3 + 8 * (b + 1)),
                                  _mm256_broadcast_ss(sc + b + 1), odd);
        }
        if (b < nb)
            even = _mm256_fmadd_ps(block_avx2(c + 32 * b, j->xq + b * SKETCH_BLOCK, j->x3 + 8 * b),
                                   _mm256_broadcast_ss(sc + b), even);
        j->out[r] = hsum8(_mm256_add_ps(even, odd)) * j->xd;
    }
}

/* VNNI: two blocks an instruction (64 bytes of codes; their values against xpair), the even block's lanes 0-7, the
 * odd one's 8-15; a last odd block as the AVX2 form takes it */
__attribute__((target(VNNI_TARGET ",fma"))) static void score_rows_vnni(const ScoreJob *j, int64_t r0, int64_t r1) {
    const int64_t nb = j->k / SKETCH_BLOCK;
    const __m512i m3 = _mm512_set1_epi8(3), pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 two = _mm512_set1_ps(2.f);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *c = j->codes + r * nb * (SKETCH_BLOCK / 4);
        const float *sc = j->scales + r * nb;
        __m512 acc = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            _mm_prefetch((const char *)(c + 32 * b + PF_AHEAD), _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512(c + 32 * b);
            const int8_t *x = j->xpair + 2 * SKETCH_BLOCK * (b / 2);
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, m3), _mm512_loadu_si512(x));
            for (int s = 1; s < 4; s++)
                p = _mm512_dpbusd_epi32(p, _mm512_and_si512(_mm512_srli_epi16(v, 2 * s), m3),
                                        _mm512_loadu_si512(x + 64 * s));
            const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(p), two, _mm512_loadu_ps(j->x3 + 8 * b));
            const __m512 s2 = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(
                                                              _mm_castpd_ps(_mm_load_sd((const double *)(sc + b)))));
            acc = _mm512_fmadd_ps(t, s2, acc);
        }
        __m256 even = _mm512_castps512_ps256(acc);
        const __m256 odd = _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(acc), 1));
        if (b < nb)  /* the same integer lanes and float steps as the AVX2 form's block */
            even = _mm256_fmadd_ps(block_avx2(c + 32 * b, j->xq + b * SKETCH_BLOCK, j->x3 + 8 * b),
                                   _mm256_broadcast_ss(sc + b), even);
        j->out[r] = hsum8(_mm256_add_ps(even, odd)) * j->xd;
    }
}
#endif

static void score_item(void *ctx, int64_t item) {
    const ScoreJob *j = ctx;
    const int64_t r0 = item * SKETCH_ROWS, r1 = r0 + SKETCH_ROWS < j->n ? r0 + SKETCH_ROWS : j->n;
#if defined(__x86_64__)
    if (isa_runs(j->isa, ISA_VNNI)) {
        score_rows_vnni(j, r0, r1);
        return;
    }
    if (isa_runs(j->isa, ISA_AVX2)) {
        score_rows_avx2(j, r0, r1);
        return;
    }
#endif
    score_rows_portable(j, r0, r1);
}

/* out[r] = the sketch's row r · x for r in [0, n) (x: k floats). Returns 0, or RC_NO_MEMORY. */
int sketch_scores(const uint8_t *codes, const float *scales, int64_t n, int64_t k, const float *x, float *out,
                  int threads, int isa) {
    const int64_t nb = k / SKETCH_BLOCK, np = (nb + 1) / 2;
    int8_t *xq = malloc((size_t)k), *xpair = calloc((size_t)np * 2 * SKETCH_BLOCK, 1);
    float *x3 = calloc((size_t)nb * 8, sizeof(float));
    if (!xq || !xpair || !x3) {
        free(xq);
        free(xpair);
        free(x3);
        return RC_NO_MEMORY;
    }
    float amax = 0.f;
    for (int64_t i = 0; i < k; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float iscale = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = 0; i < k; i++) {
        const int64_t b = i / SKETCH_BLOCK, v = i % SKETCH_BLOCK;
        xq[i] = (int8_t)lrintf(x[i] * iscale);
        x3[b * 8 + (v % 32) / 4] += (float)(3 * xq[i]);  /* small integers: exact */
        xpair[(b / 2) * 2 * SKETCH_BLOCK + 64 * (v / 32) + 32 * (b % 2) + v % 32] = xq[i];
    }
    ScoreJob j = {codes, scales, n, k, xq, xpair, x3, amax / 127.f, out, isa};
    cpu_features();
    pool_run(threads, (n + SKETCH_ROWS - 1) / SKETCH_ROWS, score_item, &j);
    free(xq);
    free(xpair);
    free(x3);
    return 0;
}

/* ---- a draft's logits: the sketch's scores, the best rows' groups exact ------------------------------------------- */

typedef struct {
    float v;  /* a score, NaN taken as +inf (a NaN logit counts as a maximum, as an argmax takes it) */
    int64_t i;
} Scored;

static inline int ahead_of(Scored a, Scored b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }  /* a total order */

/* a[0 … c) reordered so that its m first are its m best (quickselect, Hoare's partition) */
static void select_best(Scored *a, int64_t c, int64_t m) {
    int64_t lo = 0, hi = c - 1;
    while (lo < hi) {
        const Scored p = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (ahead_of(a[i], p)) i++;
            while (ahead_of(p, a[j])) j--;
            if (i <= j) {
                const Scored t = a[i];
                a[i++] = a[j], a[j--] = t;
            }
        }
        if (m - 1 <= j) hi = j;
        else if (m - 1 >= i) lo = i;
        else return;
    }
}

/* The m best of s[0 … n) (1 ≤ m ≤ n) into best[0 … m), in no order. In blocks of about n/(SEL_SPREAD·m) scores, the
 * m-th highest of the blocks' highest, T, is at most the m-th highest score (the m blocks' highest are m scores at
 * least T), so the m best lie among the scores at least T of the blocks whose highest is: a few blocks' scores are
 * selected from instead of all of them. A row holding a NaN (a maximum, as an argmax takes it) selects from all.
 * 0 or RC_NO_MEMORY. */
#define SEL_SPREAD 8
static int best_of(const float *s, int64_t n, int64_t m, Scored *best) {
    int64_t block = n / (SEL_SPREAD * m);
    block = block > 16 ? block : 16;
    const int64_t nb = (n + block - 1) / block;
    Scored *tops = malloc((size_t)nb * sizeof(Scored)), *keep = NULL;
    if (!tops) return RC_NO_MEMORY;
    int nan = 0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t e = (b + 1) * block < n ? (b + 1) * block : n;
        float t = -INFINITY;
        for (int64_t i = b * block; i < e; i++) {
            t = s[i] > t ? s[i] : t;
            nan |= s[i] != s[i];
        }
        tops[b] = (Scored){t, b};
    }
    int64_t c = 0;
    if (!nan && m < nb) {
        Scored *sorted = malloc((size_t)nb * sizeof(Scored));
        if (!sorted) {
            free(tops);
            return RC_NO_MEMORY;
        }
        memcpy(sorted, tops, (size_t)nb * sizeof(Scored));
        select_best(sorted, nb, m);
        float t = sorted[0].v;  /* the m-th highest block's highest: the lowest of the m first */
        for (int64_t r = 1; r < m; r++) t = sorted[r].v < t ? sorted[r].v : t;
        free(sorted);
        for (int pass = 0; pass < 2; pass++) {  /* count, then keep */
            c = 0;
            for (int64_t b = 0; b < nb; b++) {
                if (tops[b].v < t) continue;
                const int64_t e = (b + 1) * block < n ? (b + 1) * block : n;
                for (int64_t i = b * block; i < e; i++)
                    if (s[i] >= t) {
                        if (keep) keep[c] = (Scored){s[i], i};
                        c++;
                    }
            }
            if (pass == 0 && !(keep = malloc((size_t)c * sizeof(Scored)))) {
                free(tops);
                return RC_NO_MEMORY;
            }
        }
    } else {  /* a NaN, or as few blocks as candidates: every score */
        if (!(keep = malloc((size_t)n * sizeof(Scored)))) {
            free(tops);
            return RC_NO_MEMORY;
        }
        for (int64_t i = 0; i < n; i++) keep[i] = (Scored){isnan(s[i]) ? INFINITY : s[i], i};
        c = n;
    }
    select_best(keep, c, m);
    memcpy(best, keep, (size_t)m * sizeof(Scored));
    free(keep);
    free(tops);
    return 0;
}

/* One row x [k]'s draft logits into out [n_groups · unit]: every row's sketch score (sketch_scores), then the groups of
 * `unit` rows (the head's packed groups; 1: rows) holding the m best scores multiplied by the head (stack: n_groups
 * matrices of unit rows, as quant_matmul_pairs reads them) and their scores replaced by those products; rows past n
 * (a last group's zero rows) score 0 before. threads: the scores'; the products run on head->threads. 0 or
 * RC_NO_MEMORY. */
int sketch_logits(const uint8_t *codes, const float *scales, int64_t n, int64_t k, const float *x, const ExpertStack *head,
                  int64_t m, float *out, int threads, int isa) {
    const int64_t unit = head->n_rows, n_groups = head->n_rows ? (n + unit - 1) / unit : 0;
    int rc = sketch_scores(codes, scales, n, k, x, out, threads, isa);
    if (rc) return rc;
    for (int64_t i = n; i < n_groups * unit; i++) out[i] = 0.f;
    m = m < n ? m : n;
    Scored *best = malloc((size_t)(m > 0 ? m : 1) * sizeof(Scored));
    uint8_t *hit = calloc((size_t)n_groups, 1);
    int64_t *ints = malloc((size_t)(3 * m + 1) * sizeof(int64_t));
    float *exact = malloc((size_t)(m * unit > 0 ? m * unit : 1) * sizeof(float));
    QRows xr = {0};
    if (!best || !hit || !ints || !exact || (m > 0 && (best_of(out, n, m, best) || act_rows(head, x, 1, isa, &xr)))) {
        rc = RC_NO_MEMORY;
        goto done;
    }
    int64_t ng = 0, *groups = ints, *starts = ints + m, *xrow = ints + 2 * m + 1;
    for (int64_t r = 0; r < m; r++) hit[best[r].i / unit] = 1;
    for (int64_t g = 0; g < n_groups; g++)  /* in ascending order: the products read the head front to back */
        if (hit[g]) groups[ng++] = g;
    for (int64_t g = 0; g <= ng; g++) starts[g] = g;
    for (int64_t g = 0; g < ng; g++) xrow[g] = 0;
    if (ng) {
        const PairsJob j = pairs_job(head->code, head->w, head->expert_bytes, head->expert_bytes / unit, unit, xr.q,
                                     xr.d, xr.bs, xr.s, xr.perm, k, xrow, ng, groups, starts, exact, isa);
        pairs_run(&j, 1, head->threads);
        for (int64_t g = 0; g < ng; g++) memcpy(out + groups[g] * unit, exact + g * unit, (size_t)unit * sizeof(float));
    }
done:
    act_rows_free(&xr);
    free(best), free(hit), free(ints), free(exact);
    return rc;
}

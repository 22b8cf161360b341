/* layer.c's structures: a decoder layer's weights (made once per layer), one pass's operands, and what a step does
 * before and after its layers. engine/ops/native.py mirrors each field by field (ctypes) and checks the mirror
 * against border.c's table of their sizes and offsets when it loads the library. */
#ifndef FORETELL_LAYER_H
#define FORETELL_LAYER_H

#include "kernels.h"

/* A projection made of up to MAX_PARTS matrices over the same input, whose outputs sit side by side in that order:
 * the stacked product where the op-by-op path stacks them (one part), else each matrix in its own type (a mix such
 * as llama.cpp's Q4_K_M gives a layer's q, k and v, or its GDN inputs, different types). */
#define MAX_PARTS 4
typedef struct {
    ExpertStack part[MAX_PARTS];  /* each a stack of one */
    int64_t n;
} Parts;

/* The layer's weights, made once per layer (engine/ops/layer.py). */
typedef struct {
    Parts in;  /* [C ; H_v·d_v (z) ; H_v (β) ; H_v (α)] × d */
    ExpertStack out;  /* d × H_v·d_v */
    const float *taps, *A, *dt_bias, *norm;  /* conv taps [K, C], ssm_a and dt bias [H_v], output norm [d_v] */
    int64_t c, kk, hk, hv, dk, dv;
} GdnW;

typedef struct {
    Parts in;  /* [H·2D (per head: query rows, gate rows) ; H_kv·D (k) ; H_kv·D_v (v)] × d */
    ExpertStack out;  /* d × H·D_v */
    const float *q_norm, *k_norm;  /* [D] */
    int64_t h, h_kv, dk, dv, n_rot;
    float scale;
} AttnW;

typedef struct {
    /* MoE (dense == 0): router [E, d] float32, shared expert gate input [d] (NULL: none) and its one-expert stacks
     * sg, su, sd, the routed stacks. Dense FFN (dense == 1): gu is the [gate ; up] projection, sd down. */
    const float *router, *shared_inp;
    ExpertStack sg, su, sd, gate, up, down;
    Parts gu;
    int64_t k_used, n_expert;
    int32_t dense, pad;
} FfnW;

typedef struct {
    const float *attn_norm, *post_norm;  /* [d] */
    int64_t d;
    float eps;
    int32_t attention;  /* 0: Gated DeltaNet, 1: gated attention */
    GdnW gdn;
    AttnW attn;
    FfnW ffn;
    Ahead next;  /* what the pass reads after this layer (the next layer's input projection, the output head), fetched
                  * by the workers over the gap between the layers; empty: nothing (engine/ops/layer.py link_layers) */
} LayerW;

/* One pass's operands (engine/ops/layer.py fills them per call). */
typedef struct {
    float *x;  /* [n, d]: the layer's input, replaced by its output */
    int64_t n, pos;
    int32_t threads, isa;
    /* Gated DeltaNet: the conv state [K−1, C] on entry, the pass's window [K−1+n, C] (that state, then the n new
     * inputs: the caller keeps views of it as the conv states), the recurrent state read from s_in and written to
     * s_out (may be the same), and where the recurrence's inputs go when the caller keeps them (NULL: scratch). */
    const float *conv;
    float *window;
    const float *s_in;
    float *s_out;
    float *q, *k, *v, *beta, *decay;
    /* gated attention: the KV cache rows [n_ctx, H_kv, D] and [n_ctx, H_kv, D_v], the RoPE rows of the pass's
     * positions [n, n_rot/2] */
    float *kc, *vc;
    const float *cos_t, *sin_t;
    /* MoE outputs: router logits [n, E], top-k weights and ids [n, k_used]; counts [E] (or NULL): each routed id
     * counted there (the routing statistics of a step run in one call) */
    float *logits, *wts;
    int64_t *idx, *counts;
} LayerPass;

/* Before a step's layers, where given: its rows' token embeddings, x ← rows ids of the table (dequant_rows, the
 * bits of engine.ops.embedding), so a decode step's Python makes no embedding op (tens of microseconds each, run
 * cold after the step's weights have gone through the caches). */
typedef struct {
    const uint8_t *table;
    int64_t row_bytes, n_rows;
    const int64_t *ids;  /* [n] */
    int32_t qtype, pad;
} StepIn;

/* The MTP head's input rows (engine.models.mtp.MTPHead.project), made after the embedding rows e (StepIn) and before
 * its layer: x ← eh [RMSNorm(e; enorm) ; RMSNorm(hidden; hnorm)]. */
typedef struct {
    const float *enorm, *hnorm;  /* [d] */
    const float *hidden;  /* [n, d]: the trunk's post-norm rows (or the chain's own), set per pass */
    ExpertStack eh;  /* d × 2d */
    float eps;
    int32_t pad;
} MtpIn;

/* After a step's layers: the output norm into h [n, d] and, where head is given, the LM head's product into
 * logits [n, head->n_rows] (the final norm and head of engine.models.qwen35, the same kernels as the op-by-op
 * path's rms_norm and linear). */
typedef struct {
    const float *norm;
    float eps;
    const ExpertStack *head;
    float *h, *logits;
} StepOut;

#endif

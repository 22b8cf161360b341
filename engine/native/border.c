/* The library's side of its border with engine/ops/native.py, in one table: the size of each structure Python
 * passes by pointer and the offset and size of each of its fields (native.py checks its ctypes mirrors against them
 * when it loads the library, and refuses a library that disagrees), the failure codes (kernels.h RC_*: native.py
 * raises one exception per name), and the numbers both sides need (limits, the packed kernel codes, the CPU feature
 * bits, the trace sections), each by its C name. */
#include <stddef.h>
#include "kernels.h"
#include "layer.h"

typedef struct {
    const char *name;  /* "S": structure S; "S.f": its field f, under the mirror's name; else a constant's name */
    int64_t value, size;  /* a field's offset and size; a structure's 0 and size; a constant's value and 0 */
} BorderEntry;

#define STRUCT(S) {#S, 0, sizeof(S)}
#define FIELD_AS(S, f, name) {#S "." name, offsetof(S, f), sizeof(((S *)0)->f)}
#define FIELD(S, f) FIELD_AS(S, f, #f)
#define NUMBER(c) {#c, c, 0}

static const BorderEntry BORDER[] = {
    STRUCT(ExpertStack), FIELD(ExpertStack, w), FIELD(ExpertStack, expert_bytes), FIELD(ExpertStack, n_rows),
    FIELD(ExpertStack, k), FIELD(ExpertStack, code), FIELD(ExpertStack, threads),

    STRUCT(Parts), FIELD(Parts, part), FIELD(Parts, n),

    STRUCT(GdnW), FIELD_AS(GdnW, in, "in_"), FIELD(GdnW, out), FIELD(GdnW, taps), FIELD(GdnW, A), FIELD(GdnW, dt_bias),
    FIELD(GdnW, norm), FIELD(GdnW, c), FIELD(GdnW, kk), FIELD(GdnW, hk), FIELD(GdnW, hv), FIELD(GdnW, dk),
    FIELD(GdnW, dv),

    STRUCT(AttnW), FIELD_AS(AttnW, in, "in_"), FIELD(AttnW, out), FIELD(AttnW, q_norm), FIELD(AttnW, k_norm),
    FIELD(AttnW, h), FIELD(AttnW, h_kv), FIELD(AttnW, dk), FIELD(AttnW, dv), FIELD(AttnW, n_rot), FIELD(AttnW, scale),

    STRUCT(FfnW), FIELD(FfnW, router), FIELD(FfnW, shared_inp), FIELD(FfnW, sg), FIELD(FfnW, su), FIELD(FfnW, sd),
    FIELD(FfnW, gate), FIELD(FfnW, up), FIELD(FfnW, down), FIELD(FfnW, gu), FIELD(FfnW, k_used), FIELD(FfnW, n_expert),
    FIELD(FfnW, dense), FIELD(FfnW, pad),

    /* the mirror flattens LayerW's Ahead into next_p, next_end, next_credit */
    STRUCT(LayerW), FIELD(LayerW, attn_norm), FIELD(LayerW, post_norm), FIELD(LayerW, d), FIELD(LayerW, eps),
    FIELD(LayerW, attention), FIELD(LayerW, gdn), FIELD(LayerW, attn), FIELD(LayerW, ffn),
    FIELD_AS(LayerW, next.p, "next_p"), FIELD_AS(LayerW, next.end, "next_end"),
    FIELD_AS(LayerW, next.credit, "next_credit"),

    STRUCT(LayerPass), FIELD(LayerPass, x), FIELD(LayerPass, n), FIELD(LayerPass, pos), FIELD(LayerPass, threads),
    FIELD(LayerPass, isa), FIELD(LayerPass, conv), FIELD(LayerPass, window), FIELD(LayerPass, s_in),
    FIELD(LayerPass, s_out), FIELD(LayerPass, q), FIELD(LayerPass, k), FIELD(LayerPass, v), FIELD(LayerPass, beta),
    FIELD(LayerPass, decay), FIELD(LayerPass, kc), FIELD(LayerPass, vc), FIELD(LayerPass, cos_t),
    FIELD(LayerPass, sin_t), FIELD(LayerPass, logits), FIELD(LayerPass, wts), FIELD(LayerPass, idx),
    FIELD(LayerPass, counts),

    STRUCT(StepIn), FIELD(StepIn, table), FIELD(StepIn, row_bytes), FIELD(StepIn, n_rows), FIELD(StepIn, ids),
    FIELD(StepIn, qtype), FIELD(StepIn, pad),

    STRUCT(MtpIn), FIELD(MtpIn, enorm), FIELD(MtpIn, hnorm), FIELD(MtpIn, hidden), FIELD(MtpIn, eh), FIELD(MtpIn, eps),
    FIELD(MtpIn, pad),

    STRUCT(StepOut), FIELD(StepOut, norm), FIELD(StepOut, eps), FIELD(StepOut, head), FIELD(StepOut, h),
    FIELD(StepOut, logits),

    NUMBER(RC_NO_MEMORY), NUMBER(RC_EXPERT_ID), NUMBER(RC_MAX_EXPERTS), NUMBER(RC_MAX_DV), NUMBER(RC_ROW_ID),
    NUMBER(RC_ROW_TYPE),
    NUMBER(MAX_EXPERTS), NUMBER(MAX_DV), NUMBER(MAX_PARTS), NUMBER(GROUP), NUMBER(SKETCH_BLOCK),
    NUMBER(T_Q8_0_PACKED), NUMBER(T_Q2_K_PACKED), NUMBER(T_Q3_K_PACKED), NUMBER(T_Q4_K_PACKED),
    NUMBER(T_Q5_K_PACKED), NUMBER(T_Q6_K_PACKED), NUMBER(T_Q4_0_PACKED),
    NUMBER(T_Q4_1_PACKED), NUMBER(T_Q5_0_PACKED), NUMBER(T_Q5_1_PACKED), NUMBER(T_IQ4_NL_PACKED), NUMBER(T_IQ4_XS_PACKED),
    NUMBER(T_MXFP4_PACKED),
    NUMBER(CPU_AVX512), NUMBER(CPU_VNNI), NUMBER(CPU_AVX2), NUMBER(CPU_AVXVNNI),
    NUMBER(ISA_PORTABLE), NUMBER(ISA_AVX2), NUMBER(ISA_AVXVNNI), NUMBER(ISA_AVX512), NUMBER(ISA_VNNI),
    NUMBER(TRACE_NORM), NUMBER(TRACE_ACT_QUANT), NUMBER(TRACE_PROJECTION), NUMBER(TRACE_GDN_INPUTS),
    NUMBER(TRACE_RECURRENCE), NUMBER(TRACE_GATED_NORM), NUMBER(TRACE_ATTENTION), NUMBER(TRACE_ROUTER),
    NUMBER(TRACE_EXPERT_PRODUCTS), NUMBER(TRACE_EXPERT_MISC), NUMBER(TRACE_POOL_WAIT), NUMBER(TRACE_PREFETCH),
};

/* the table (*out) and its length */
int64_t border_table(const BorderEntry **out) {
    *out = BORDER;
    return (int64_t)(sizeof BORDER / sizeof BORDER[0]);
}

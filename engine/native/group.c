/* Grouping a pass's (token, slot) pairs by expert, for the routed-expert products (engine/experts.py).
 *
 * A stable counting sort of the flattened top-k ids: pairs in expert order, and within an expert in token
 * order (the order a stable argsort gives), in one call instead of the half-dozen tensor ops a multi-token
 * pass spent on it. Loaded with ctypes (engine/ops/native.py); no Python API.
 */
#include <stdlib.h>
#include "kernels.h"

/* idx [n, k] expert ids in [0, n_expert). Writes order [n·k] (flat pair indices t·k + s, grouped by expert),
 * tokens [n·k] (order / k), experts [G] and counts [G] (the experts present, ascending, and their pairs) and
 * starts [G + 1] (the groups' first pairs, then n·k). Returns G, or RC_EXPERT_ID for an id out of range
 * (RC_NO_MEMORY when out of memory). */
int64_t group_expert_pairs(const int64_t *idx, int64_t n, int64_t k, int64_t n_expert, int64_t *order, int64_t *tokens,
                       int64_t *experts, int64_t *counts, int64_t *starts) {
    int64_t *start = calloc((size_t)n_expert + 1, sizeof(int64_t));
    if (!start) return RC_NO_MEMORY;
    const int64_t p_n = n * k;
    for (int64_t p = 0; p < p_n; p++) {
        if (idx[p] < 0 || idx[p] >= n_expert) {
            free(start);
            return RC_EXPERT_ID;
        }
        start[idx[p] + 1]++;
    }
    int64_t g = 0;
    for (int64_t e = 0; e < n_expert; e++) {
        if (start[e + 1]) {
            experts[g] = e;
            counts[g] = start[e + 1];
            starts[g++] = start[e];
        }
        start[e + 1] += start[e];
    }
    starts[g] = p_n;
    for (int64_t p = 0; p < p_n; p++) {
        const int64_t at = start[idx[p]]++;
        order[at] = p;
        tokens[at] = p / k;
    }
    free(start);
    return g;
}

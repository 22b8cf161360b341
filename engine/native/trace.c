/* Where a native step's time goes, section by section (bench/step_profile.py reads it): while tracing is on,
 * trace_mark(sec, bytes) adds the time since the previous mark to section sec, with the weight bytes it read; the
 * pool adds the time a caller spent waiting for the other threads' items after running out of its own. Off, a mark
 * is one load and a branch. One caller at a time (the pool's calls are serialised the same way). */
#include <stdatomic.h>
#include <time.h>
#include "kernels.h"

static _Atomic int ON;
static int64_t LAST, NS[TRACE_N], CALLS[TRACE_N], BYTES[TRACE_N];

int64_t clock_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

int trace_on(void) { return atomic_load_explicit(&ON, memory_order_relaxed); }

void trace_mark(int sec, int64_t bytes) {
    if (!trace_on()) return;
    const int64_t t = clock_ns();
    NS[sec] += t - LAST, CALLS[sec]++, BYTES[sec] += bytes;
    LAST = t;
}

void trace_add(int sec, int64_t ns, int64_t bytes) {
    if (!trace_on()) return;
    NS[sec] += ns, CALLS[sec]++, BYTES[sec] += bytes;
}

/* on: zero the sums and start (the first mark counts from here); off: stop */
void trace_enable(int on) {
    if (on) {
        memset(NS, 0, sizeof NS), memset(CALLS, 0, sizeof CALLS), memset(BYTES, 0, sizeof BYTES);
        LAST = clock_ns();
    }
    atomic_store(&ON, on);
}

/* out [3, TRACE_N]: nanoseconds, marks and bytes per section; returns TRACE_N */
int trace_read(int64_t *out) {
    for (int i = 0; i < TRACE_N; i++) out[i] = NS[i], out[TRACE_N + i] = CALLS[i], out[2 * TRACE_N + i] = BYTES[i];
    return TRACE_N;
}

/* the time since the last mark is nobody's: drop it (a layer call's first mark counts from its own start) */
void trace_restart(void) {
    if (trace_on()) LAST = clock_ns();
}

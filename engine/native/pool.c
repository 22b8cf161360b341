/* The kernels' threads: one pool, kept warm across the ops of a step, that never waits for a thread that has not
 * shown up.
 *
 * A call splits its work into items; the caller and the workers claim items one at a time (SEG below), and the
 * call returns once every item is done. The caller works too and claims whatever is left, so when the
 * workers' cores are taken (a browser, a build: a desktop's CPU is shared) it finishes the call alone at one
 * thread's speed instead of waiting a scheduler time slice for each worker at each op, which is what an OpenMP
 * region's barrier does (a decode step of the embedded model went from 8 ms to 25-30 ms with one busy process on
 * a 2-core machine). Between calls the workers spin for half a millisecond (the next call of a step comes within
 * that; measured in time, as a pause instruction's length differs several-fold between CPUs), then sleep on a
 * futex: a worker woken by futex for each call of a small model's step made 2 threads slower than 1 (1.97 vs
 * 1.54 ms per embedded-model step; 1.30 ms spinning through the step).
 *
 * Which thread runs an item never changes what the item computes: the kernels give every output to one item.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif
#include "kernels.h"

#define MAX_WORKERS 63
#define SPIN_IDLE_NS 500000  /* how long a worker spins before sleeping: longer than the gaps between a step's calls */
#define SPIN_DONE 2000  /* pauses the caller spins waiting for claimed items, before yielding its core */

typedef struct {
    pool_fn fn;
    void *ctx;
    int64_t n_items;
    int helpers;  /* workers allowed to join (the call's thread count − 1) */
    int background;  /* pool_prefetch's: nobody waits for it and its items are not counted done */
} Job;

/* A call's items are split into one contiguous segment per thread; each thread claims from its own segment first,
 * in order, then from the others' (what is left of them), so each thread reads one run of weights front to back,
 * which the hardware prefetchers follow, where claiming from one shared counter interleaved the threads' items
 * (from DRAM, 2 threads: 33 vs 30 GB/s on a 4096x4096 Q4_K product, 26 vs 18 on streams of 1024x1024 ones).
 * SEG(i): the job generation (high 32 bits) and segment i's next item (low 32); a claim is a CAS on both, so a
 * worker that read an old job can never claim an item of a new one. Job slots alternate by generation: the caller
 * writes the next job's slot while the current one's is still read. STATE holds the current generation. */
#define MAX_SEGMENTS (MAX_WORKERS + 1)
/* Each word that one thread writes while others read sits on a cache line of its own: the workers spin reading
 * STATE, and a claim or a DONE count that shared its line took the line away from them on every item. */
typedef struct {
    _Alignas(64) _Atomic uint64_t v;
} Line;
static Line STATE_L, SEG_L[MAX_SEGMENTS];
static struct {
    _Alignas(64) _Atomic int64_t v;
} DONE_L;
#define STATE STATE_L.v
#define DONE DONE_L.v
#define SEG(i) SEG_L[i].v
static Job JOBS[2];
static _Atomic uint32_t WAKE;  /* futex word, bumped when a job is published to sleeping workers */
static _Atomic int SLEEPING;
static int N_WORKERS;
static pthread_mutex_t START = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t CALL = PTHREAD_MUTEX_INITIALIZER;  /* one call at a time: Python threads may call in */

static int64_t seg_end(const Job *j, int i) { return j->n_items * (i + 1) / (j->helpers + 1); }

/* Claims and runs items of generation `gen`'s job, its own segment first, until none is left, then counts them
 * done in one add (an add per item fought over DONE's line with the other threads); returns how many it ran. A
 * thread holding uncounted items keeps the job from ending, so no new generation starts while it runs them. */
static int64_t work(uint32_t gen, int worker) {
    const Job *j = &JOBS[gen & 1];
    const pool_fn fn = j->fn;
    const int background = j->background;
    void *ctx = j->ctx;
    const int segs = j->helpers + 1;
    if (worker >= segs) return 0;
    int64_t ran = 0;
    for (int v = 0; v < segs; v++) {
        const int i = (worker + v) % segs;
        const int64_t end = seg_end(j, i);
        uint64_t s = atomic_load_explicit(&SEG(i), memory_order_acquire);
        while ((uint32_t)(s >> 32) == gen && (int64_t)(s & 0xffffffffu) < end)
            if (atomic_compare_exchange_weak_explicit(&SEG(i), &s, s + 1, memory_order_acq_rel,
                                                      memory_order_acquire)) {
                fn(ctx, (int64_t)(s & 0xffffffffu));
                ran++;
                s = atomic_load_explicit(&SEG(i), memory_order_acquire);
            }
        if ((uint32_t)(s >> 32) != gen) break;
    }
    if (ran && !background) atomic_fetch_add_explicit(&DONE, ran, memory_order_release);
    return ran;
}

static int64_t cpu_ns(void) {  /* the calling thread's CPU time */
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

#define SOLO_NS 20000000  /* solo mode's first period and its longest (after_call) */
#define SOLO_MAX_NS 1000000000
static _Atomic int64_t SOLO_UNTIL, SOLO_NEXT = SOLO_NS;

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    uint32_t seen = (uint32_t)(atomic_load(&STATE) >> 32);
    for (;;) {
        uint64_t s = atomic_load_explicit(&STATE, memory_order_acquire);
        const int64_t t0 = clock_ns();
        for (int i = 1; (uint32_t)(s >> 32) == seen; i++) {
            PAUSE();
            s = atomic_load_explicit(&STATE, memory_order_acquire);
            /* solo mode: the cores are wanted elsewhere, and a spinning worker would take the caller's */
            if (i % 64 == 0 && (clock_ns() - t0 > SPIN_IDLE_NS || SOLO_UNTIL)) break;
        }
        if ((uint32_t)(s >> 32) == seen) {  /* idle: sleep until a job is published */
            const uint32_t w = atomic_load(&WAKE);
            atomic_fetch_add(&SLEEPING, 1);
            if ((uint32_t)(atomic_load(&STATE) >> 32) == seen)
                syscall(SYS_futex, &WAKE, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
            atomic_fetch_sub(&SLEEPING, 1);
            continue;
        }
        seen = (uint32_t)(s >> 32);
        work(seen, id);
    }
    return NULL;
}

static void start_workers(int n) {
    pthread_mutex_lock(&START);
    for (; N_WORKERS < n && N_WORKERS < MAX_WORKERS; N_WORKERS++) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &a, worker_main, (void *)(intptr_t)(N_WORKERS + 1)) != 0) {
            pthread_attr_destroy(&a);
            break;
        }
        pthread_attr_destroy(&a);
    }
    pthread_mutex_unlock(&START);
}

/* Solo mode: while SOLO_UNTIL is ahead, calls run on the caller alone. It starts when the caller, its own items
 * done, waited for a worker's item far longer than an item takes (the worker was preempted mid-item: another
 * process has the core), for SOLO_NS, doubled at each stall in a row up to SOLO_MAX_NS; a call without a stall
 * resets it. A busy process then costs a step one core's speed instead of a scheduler slice per call.
 * One stall alone is not contention: a kernel thread (page reclaim, memory monitoring, a kworker) or the hypervisor
 * takes a core for a few milliseconds now and then: in a mid-fixture benchmark on the 2-core VM that runs CI, about
 * once a second a caller waited 1.5-4 ms for a preempted worker or lost its own core for 0.5-6 ms, and each put the
 * next 20 ms on one thread. So a stall starts solo mode only within STALL_WINDOW_NS of the one before it (or of the
 * end of the solo period that one started): a busy process stalls a call every few milliseconds and is caught at its
 * second stall. */
#define STALL_WINDOW_NS 200000000
static int64_t LAST_STALL;  /* the last stall's time, or the end of the solo period it started (under CALL) */

/* Solo mode after a call that started at t0, had the caller's own items done at t1 and ended at t2, the caller off
 * its core for `lost` of it. A stall: a worker sat on a claimed item, or the caller lost its core for a good part of
 * the call. Under CALL. */
static void after_call(int64_t t0, int64_t t1, int64_t t2, int64_t lost) {
    if (t2 - t1 > 2 * (t1 - t0) + 100000 || (lost > 50000 && 4 * lost > t2 - t0)) {
        if (LAST_STALL && t2 - LAST_STALL < STALL_WINDOW_NS) {
            SOLO_UNTIL = t2 + SOLO_NEXT;
            LAST_STALL = SOLO_UNTIL;
            SOLO_NEXT = SOLO_NEXT * 2 < SOLO_MAX_NS ? SOLO_NEXT * 2 : SOLO_MAX_NS;
        } else {
            LAST_STALL = t2;  /* a one-off until another follows */
        }
    } else {
        SOLO_UNTIL = 0;
        SOLO_NEXT = SOLO_NS;
    }
}

/* Makes job generation gen's: its slot, one segment per thread, then STATE (sequentially consistent: after the
 * segments, before the caller reads SLEEPING). Under CALL. */
static void publish(uint32_t gen, Job job) {
    JOBS[gen & 1] = job;
    for (int i = 0; i <= job.helpers; i++)
        atomic_store_explicit(&SEG(i), (uint64_t)gen << 32 | (uint64_t)(job.n_items * i / (job.helpers + 1)),
                              memory_order_relaxed);
    atomic_store(&STATE, (uint64_t)gen << 32);
}

void pool_run(int n_threads, int64_t n_items, pool_fn fn, void *ctx) {
    if (n_threads > 1 && SOLO_UNTIL && clock_ns() < SOLO_UNTIL) n_threads = 1;
    if (n_threads <= 1 || n_items <= 1) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i);
        return;
    }
    if (N_WORKERS < n_threads - 1) start_workers(n_threads - 1);
    pthread_mutex_lock(&CALL);
    const uint64_t old = atomic_load(&STATE);
    const uint32_t gen = (uint32_t)(old >> 32) + 1;
    atomic_store_explicit(&DONE, 0, memory_order_relaxed);
    publish(gen, (Job){fn, ctx, n_items, n_threads - 1, 0});
    if (atomic_load(&SLEEPING) > 0) {
        atomic_fetch_add(&WAKE, 1);
        syscall(SYS_futex, &WAKE, FUTEX_WAKE_PRIVATE, n_threads - 1, NULL, NULL, 0);
    }
    const int64_t t0 = clock_ns(), c0 = cpu_ns();
    work(gen, 0);
    const int64_t t1 = clock_ns();
    /* items other threads claimed may still run; one preempted mid-item may need this core back */
    for (int i = 0; atomic_load_explicit(&DONE, memory_order_acquire) < n_items; i++) {
        if (i < SPIN_DONE) PAUSE();
        else sched_yield();
    }
    const int64_t t2 = clock_ns(), lost = (t2 - t0) - (cpu_ns() - c0);
    trace_add(TRACE_POOL_WAIT, t2 - t1, 0);
    after_call(t0, t1, t2, lost);
    pthread_mutex_unlock(&CALL);
}

/* after_call for the tests: a call's timings (ns, as pool_run's) in, solo mode's end after them out (0: none) */
int64_t pool_after_call(int64_t t0, int64_t t1, int64_t t2, int64_t lost) {
    pthread_mutex_lock(&CALL);
    after_call(t0, t1, t2, lost);
    const int64_t until = SOLO_UNTIL;
    pthread_mutex_unlock(&CALL);
    return until;
}

/* ---- prefetching in the serial gaps --------------------------------------------------------------------------
 * Between a step's products the caller runs serial work (a GDN layer's conv and gates, norms, routing, the experts'
 * silu) while the workers spin and the memory bus idles. pool_prefetch hands the workers byte ranges the caller will
 * read next (the recurrence's state, the next projection's or the chosen experts' weights) and returns at once: the
 * workers prefetch them into their caches, 4 KiB per item, until done or until the next call (which they join as
 * usual: a claim of the old generation fails). The ranges go in the order of the next call's items, so a worker's
 * segment (the later part) comes first. Sleeping workers are left asleep, and nothing runs in solo mode or on one
 * thread. Prefetches never fault, so a range freed meanwhile costs nothing. */
#define PF_ITEM 4096
#define PF_RANGES 16

typedef struct {
    const char *p[PF_RANGES];
    int64_t items[PF_RANGES];  /* PF_ITEM chunks per range */
    int n;
} Prefetch;
static Prefetch PF[2];  /* by job generation, as JOBS */

static void prefetch_item(void *ctx, int64_t item) {
    const Prefetch *f = ctx;
    int r = 0;
    while (r + 1 < f->n && item >= f->items[r]) item -= f->items[r++];
    const char *p = f->p[r] + item * PF_ITEM;
    for (int off = 0; off < PF_ITEM; off += 64) __builtin_prefetch(p + off, 0, 2);
}

void pool_prefetch(int n_threads, const Ahead *ranges, int n) {
    if (n_threads <= 1 || N_WORKERS < 1 || atomic_load(&SLEEPING) > 0 || (SOLO_UNTIL && clock_ns() < SOLO_UNTIL))
        return;
    if (pthread_mutex_trylock(&CALL) != 0) return;  /* another thread's call is running: not a gap */
    const uint32_t gen = (uint32_t)(atomic_load(&STATE) >> 32) + 1;
    Prefetch *f = &PF[gen & 1];
    int64_t items = 0;
    f->n = 0;
    for (int i = 0; i < n && f->n < PF_RANGES; i++) {
        if (!ranges[i].p || ranges[i].end <= ranges[i].p) continue;
        f->p[f->n] = ranges[i].p;
        f->items[f->n] = (ranges[i].end - ranges[i].p + PF_ITEM - 1) / PF_ITEM;
        items += f->items[f->n++];
    }
    if (items > 0) {
        const int helpers = n_threads - 1 < N_WORKERS ? n_threads - 1 : N_WORKERS;
        /* the caller takes no item: segment 0 is left for a worker done with its own */
        publish(gen, (Job){prefetch_item, f, items, helpers, 1});
        trace_add(TRACE_PREFETCH, 0, items * PF_ITEM);
    }
    pthread_mutex_unlock(&CALL);
}

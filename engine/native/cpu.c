/* The one place that asks the processor which instruction sets it runs (cpuid through GCC's builtins), once.
 * The integer sums of every product are the same in every form; the float sums of an output are grouped
 * differently between forms (a few ulps apart), each form batch-invariant. */
#include "kernels.h"

static int FEATURES = -1;

int cpu_features(void) {
    if (FEATURES < 0) {
        FEATURES = 0;
#if defined(__x86_64__)
        __builtin_cpu_init();
        const int bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("f16c");
        if (bw) FEATURES |= CPU_AVX512;
        if (bw && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
            __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
            FEATURES |= CPU_VNNI;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
            FEATURES |= CPU_AVX2;
        if ((FEATURES & CPU_AVX2) && __builtin_cpu_supports("avxvnni")) FEATURES |= CPU_AVXVNNI;
#endif
    }
    return FEATURES;
}

int isa_runs(int isa, int level) {
    static const int need[] = {0, CPU_AVX2, CPU_AVX2 | CPU_AVXVNNI, CPU_AVX512, CPU_AVX512 | CPU_VNNI};
    return isa >= level && (cpu_features() & need[level]) == need[level];
}

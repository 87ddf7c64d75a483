/*
 * blas.c: picking OpenBLAS's kernels before anything runs. OpenBLAS chooses its kernels when the
 * library loads, from the CPU's model number, and on CPUs it does not know (virtual machines often
 * report a generic "Intel Xeon Processor") it falls back to its "Prescott" kernels, several times
 * slower than the AVX2/AVX-512 ones the CPU can run. The only remedy is OPENBLAS_CORETYPE in the
 * environment at load time, so programs call rnnd_cpu_blas_reexec first thing in main.
 */
#include "rnnd_kernels.h"

#include <stdlib.h>
#include <strings.h>
#include <unistd.h>

// OpenBLAS's own query; weak, so that another CBLAS without it links too.
extern char *openblas_get_corename(void) __attribute__((weak));

void rnnd_cpu_blas_reexec(char **argv) {
    if (openblas_get_corename == NULL || getenv("OPENBLAS_CORETYPE") != NULL)
        return;
    const char *now = openblas_get_corename();
    if (now == NULL || strcasecmp(now, "prescott") != 0)
        return; // OpenBLAS knows this CPU
    __builtin_cpu_init();
    const char *core = NULL;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        core = "SkylakeX";
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        core = "Haswell";
    if (core == NULL || setenv("OPENBLAS_CORETYPE", core, 1) != 0)
        return;
    // The program's own path, not /proc/self/exe: the kernel names the process after the file
    // executed, and operators find it as "rnnd" (ps, pgrep, top), not "exe".
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
        self[n] = '\0';
        execv(self, argv);
    }
    execv("/proc/self/exe", argv); // the path is gone (replaced on disk) or too long
    unsetenv("OPENBLAS_CORETYPE"); // the re-exec failed: carry on with what loaded
}

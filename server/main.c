/*
 * main.c: rnnd's entry point: parse the configuration (config.c), then run the daemon
 * (server.c). A bad flag or config value exits with status 2 and a message naming it.
 *
 * One start-up detail lives here because it must happen before anything else: OpenBLAS picks
 * its kernels when the library loads, from the CPU's model number, and on CPUs it does not know
 * (virtual machines often report a generic "Intel Xeon Processor") it falls back to its
 * "Prescott" kernels, several times slower than the AVX2/AVX-512 ones the CPU can run. When that
 * happened and OPENBLAS_CORETYPE is not set, rnnd sets it from the CPU's features and re-executes
 * itself once, so that the library loads again with the right kernels.
 */
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "server.h"

// OpenBLAS's own query; weak, so that another BLAS without it links too.
extern char *openblas_get_corename(void) __attribute__((weak));

static void openblas_pick_kernels(char **argv) {
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
    execv("/proc/self/exe", argv);
    unsetenv("OPENBLAS_CORETYPE"); // the re-exec failed: carry on with what loaded
}

int main(int argc, char **argv) {
    openblas_pick_kernels(argv);
    struct rnnd_config cfg;
    rnnd_config_defaults(&cfg);
    char err[1024];
    switch (rnnd_config_parse(&cfg, argc, argv, stdout, err, sizeof(err))) {
        case RNND_CONFIG_EXIT:
            return 0;
        case RNND_CONFIG_ERROR:
            fprintf(stderr, "rnnd: %s\n", err);
            return 2;
        case RNND_CONFIG_RUN:
            break;
    }
    return rnnd_server_run(&cfg);
}

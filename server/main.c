/*
 * main.c: rnnd's entry point: parse the configuration (config.c), then run the daemon
 * (server.c). A bad flag or config value exits with status 2 and a message naming it.
 */
#include <malloc.h>
#include <stdio.h>

#include "rnnd_kernels.h"

#include "config.h"
#include "log.h"
#include "server.h"

int main(int argc, char **argv) {
    rnnd_cpu_blas_reexec(argv); // before anything else runs: it may re-execute rnnd
    // Every call allocates its request, reply and staging buffers anew (hundreds of KB for a
    // Step of 1024 rows, MBs for a learner's call). glibc would map each above 128 KB afresh
    // and give freed heap back at once, so each call paid a page fault per 4 KB it touched
    // (a third of a 1024-row Step's time on the CPU backend): keep freed memory for reuse.
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
    struct rnnd_config cfg;
    rnnd_config_defaults(&cfg);
    char err[1024];
    switch (rnnd_config_parse(&cfg, argc, argv, stdout, err, sizeof(err))) {
        case RNND_CONFIG_EXIT:
            return 0;
        case RNND_CONFIG_ERROR:
            // A log collector reading JSON gets this line as JSON too, once the flag was read.
            if (cfg.log_format == RNND_LOG_FORMAT_JSON) {
                rnnd_log_set_format(RNND_LOG_FORMAT_JSON);
                rnnd_log(RNND_LOG_ERROR, "%s", err);
            } else {
                fprintf(stderr, "rnnd: %s\n", err);
            }
            return 2;
        case RNND_CONFIG_RUN:
            break;
    }
    return rnnd_server_run(&cfg);
}

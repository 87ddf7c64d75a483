/*
 * job.c: what every job shares (see job.h): failing one with a message, and casting a Step
 * part's vote.
 */
#include "job.h"

#include <stdarg.h>
#include <stdio.h>

int rnnd_job_fail(struct rnnd_job *job, int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(job->msg, sizeof(job->msg), fmt, ap);
    va_end(ap);
    job->err = err;
    return err;
}

void rnnd_step_vote_cast(struct rnnd_step_vote *v, bool admitted) {
    if (!admitted)
        atomic_store(&v->refused, true);
    if (atomic_fetch_sub(&v->left, 1) == 1)
        v->decided(v);
}

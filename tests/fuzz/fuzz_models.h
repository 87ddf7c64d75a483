/*
 * fuzz_models.h: the daemon models the file-reading fuzzers read against (the same shapes as
 * fuzz_request.c's), and the seed writer writes for. Small, so that a seed is a few KB.
 */
#ifndef RNND_FUZZ_MODELS_H
#define RNND_FUZZ_MODELS_H

#include "rnnd_kernels.h"

#define FUZZ_MODELS 2

static const struct rnnd_model fuzz_models[FUZZ_MODELS] = {
    {.cell = RNND_CELL_GRU, .compute = RNND_COMPUTE_FP32, .I = 4, .H = 3, .L = 1},
    {.cell = RNND_CELL_LSTM, .compute = RNND_COMPUTE_FP32, .I = 3, .H = 2, .L = 2},
};

#endif // RNND_FUZZ_MODELS_H

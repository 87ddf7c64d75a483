/*
 * traj.cuh: the trajectory store's row moves on the device (traj.cu; contract in rnnd_kernels.h,
 * struct rnnd_traj_store): traj_write scatters packed rows into the store (the step path records
 * its rows), traj_read gathers store rows into packed arrays (Forward over recorded steps,
 * checkpoints). One launch each, on the context's stream.
 */
#ifndef RNND_CUDA_TRAJ_CUH
#define RNND_CUDA_TRAJ_CUH

#include "common.cuh"

int rnnd__cuda_traj_write(struct cuda_ctx *c, const struct rnnd_traj_store *st,
                          const struct rnnd_traj_rows *r, const struct rnnd_model *m);
int rnnd__cuda_traj_read(struct cuda_ctx *c, const struct rnnd_traj_rows *r,
                         const struct rnnd_traj_store *st, const struct rnnd_model *m);

#endif // RNND_CUDA_TRAJ_CUH

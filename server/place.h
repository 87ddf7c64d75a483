/*
 * place.h: the placement policy, shared by the group (which splits requests by it) and the engine
 * (which keeps, from a checkpoint, only the envs placed on its device). Pure function: any thread.
 */
#ifndef RNND_PLACE_H
#define RNND_PLACE_H

#include <stdint.h>

// The device index (0 <= result < n) that holds env id among n devices (--place-block):
// - block 1: jump consistent hashing (Lamping and Veach) of a mix of the id, so envs spread
//   evenly and going from n to n + 1 devices moves only a 1/(n + 1) share of them;
// - block N > 1: the ids id - id % N .. + N - 1 share a device, the blocks taken in turn
//   (block b on device b % n), so that an actor numbering its N envs from a multiple of N has
//   every Step on one device, and consecutive actors share the devices evenly.
int rnnd_place(uint64_t env_id, int n, int block);

#endif // RNND_PLACE_H

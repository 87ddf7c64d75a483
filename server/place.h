/*
 * place.h: the placement policy, shared by the group (which splits requests by it) and the engine
 * (which keeps, from a checkpoint, only the envs placed on its device). Pure function: any thread.
 */
#ifndef RNND_PLACE_H
#define RNND_PLACE_H

#include <stdint.h>

// The device index (0 <= result < n) that holds env id among n devices: jump consistent hashing
// (Lamping and Veach) of a mix of the id, so envs spread evenly and going from n to n + 1 devices
// moves only a 1/(n+1) share of them.
int rnnd_place(uint64_t env_id, int n);

#endif // RNND_PLACE_H

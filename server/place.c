/*
 * place.c: which device holds an env (place.h).
 */
#include "place.h"

int rnnd_place(uint64_t env_id, int n, int block) {
    if (block > 1)
        return (int)(env_id / (uint64_t)block % (uint64_t)n);
    // splitmix64's finaliser first: env ids are often small consecutive integers.
    uint64_t key = env_id + 0x9e3779b97f4a7c15ull;
    key = (key ^ (key >> 30)) * 0xbf58476d1ce4e5b9ull;
    key = (key ^ (key >> 27)) * 0x94d049bb133111ebull;
    key ^= key >> 31;
    // Jump consistent hash (Lamping and Veach, 2014).
    int64_t b = -1, j = 0;
    while (j < n) {
        b = j;
        key = key * 2862933555777941757ull + 1;
        j = (int64_t)((double)(b + 1) * ((double)(1ll << 31) / (double)((key >> 33) + 1)));
    }
    return (int)b;
}

/*
 * shm.h: shared-memory regions (docs/design.md "Shared memory"). A client on the daemon's host
 * hands it a memfd once (RegisterRegion); its requests then carry RegionSpans into that memory
 * instead of tensor bytes, and a request's reply_region receives the reply's tensors. Only the
 * small descriptors travel over gRPC.
 *
 * A socket region is the daemon's own memory, for a client on any host: the client writes and
 * reads it through plain TCP data connections (rnnd_shm_listen, the protocol above data_serve in
 * shm.c), up to RNND_SHM_SOCKET_CONNS of them side by side, each beginning with the region's
 * key, and the region goes when any of them closes. Only descriptors travel over gRPC; the
 * tensors cross as raw bytes.
 *
 * Who may use a region: the peer must be on this host (a unix: socket or loopback), the memfd
 * must belong to rnnd's uid and start with the key the request carries (proof that the peer can
 * read it), be sealed against shrinking (so no access of the daemon can fault) and be
 * flock(LOCK_SH)ed by its client, which lets the daemon see when every process of the client
 * has gone (rnnd_shm_housekeeping). Region ids are random 64-bit numbers known only to the
 * client that registered them.
 *
 * rpc.c resolves a request's spans before its handler runs (rnnd_shm_resolve): each Tensor with
 * a region gets its data pointed into the mapping, so the checks and the engine read shared
 * memory in place; the regions stay mapped (pinned) until the call frees the request
 * (rnnd_shm_use_free). rnnd_call_reply moves the reply's tensors into the reply_region
 * (rnnd_shm_place) before packing and puts them back after (rnnd_shm_unplace). Thread-safe.
 *
 * A CUDA region (docs/design.md "CUDA regions") is GPU memory a client exported with CUDA IPC,
 * opened through the backend (ipc_open) on a one-device CUDA daemon and checked like a memfd's
 * (local peer, key at its start); it is closed when its client's process exits (a pidfd). Its
 * tensors are device pointers: the server never reads them on the host. Only Backward's
 * gradients may be sent in one, and only Forward's and Backward's replies placed in one; the
 * engine writes its outputs there itself (rnnd_shm_use_device_reply), so rnnd_shm_place takes a
 * tensor already inside the reply_region as placed and sends any other as bytes.
 */
#ifndef RNND_SHM_H
#define RNND_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "rnnd/v1/rnnd.pb-c.h"

#define RNND_SHM_KEY_BYTES 32
#define RNND_SHM_ALIGN     64 // reply tensors start at multiples of this

// Socket regions (docs/design.md "Socket regions"): the data connection's hello, its frames'
// ops, the largest region, how long a new connection may take to send its hello and a new
// region to be bound by one, connections beyond those of --max-shm-regions regions that may be
// saying hello, the TCP keepalive idle time after which a silent peer is probed, and the data
// connections one region takes (a client splits large transfers over them: one TCP stream
// moves ~4 GB/s on a loopback, a few move several times that).
#define RNND_SHM_HELLO         "RNNDSOCK"
#define RNND_SHM_OP_WRITE      1
#define RNND_SHM_OP_READ       2
#define RNND_SHM_OP_SYNC       3
#define RNND_SHM_SOCKET_MAX    ((uint64_t)16 << 30)
#define RNND_SHM_HELLO_S       10
#define RNND_SHM_SOCKET_BIND_S 30
#define RNND_SHM_PENDING       16
#define RNND_SHM_KEEPALIVE_S   60
#define RNND_SHM_SOCKET_CONNS  4

struct rnnd_shm;
struct rnnd_shm_use; // what one request holds: pinned regions, tensors pointed into them
struct rnnd_backend;

// What a request may keep in CUDA regions (rnnd_shm_resolve's dev_ok).
enum {
    RNND_SHM_DEV_TENSORS = 1u << 0, // its tensors
    RNND_SHM_DEV_REPLY = 1u << 1,   // its reply_region
};

// A registry of at most max_regions regions (0: shared memory off). 0, or RNND_ENOMEM.
int rnnd_shm_init(int max_regions, struct rnnd_shm **out);
// Unmaps every region. Call after every use was freed.
void rnnd_shm_free(struct rnnd_shm *s);

// True when a gRPC peer address ("unix:...", "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000") is on
// this host: a Unix socket or a loopback address. Pure.
bool rnnd_shm_peer_local(const char *peer);

// Socket regions: listens for data connections on addr ("HOST:PORT", port 0: any free one) on
// a thread of its own; every connection gets a thread. 0, or RNND_EINVAL / RNND_EIO /
// RNND_ENOMEM with err written. rnnd_shm_free closes them. Without it socket regions are off.
// max_bytes: what all socket regions together may hold.
int rnnd_shm_listen(struct rnnd_shm *s, const char *addr, uint64_t max_bytes, char *err,
                    size_t errlen);
// The data connections' port, or 0 when socket regions are off.
int rnnd_shm_data_port(const struct rnnd_shm *s);

// What RegisterRegion answers: the new region's id and size; for a CUDA region that asked for
// async replies (CudaRegion.async_replies) on a backend that can share an event, async and the
// event's handle (RegisterRegionReply.cuda_event).
#define RNND_SHM_EVENT_BYTES 64
struct rnnd_shm_registered {
    uint64_t id, size;
    bool async;
    uint8_t event[RNND_SHM_EVENT_BYTES];
};

// RegisterRegion for a peer (local: rnnd_shm_peer_local of its address): *out, or
// RNND_EPRECOND (off, remote and not a socket region, not the daemon's, wrong key, not sealed,
// not locked; a CUDA region on a daemon without one CUDA device; socket regions off),
// RNND_EINVAL (malformed), RNND_EFULL (--max-shm-regions, --max-socket-region-mb) with the
// reason in err. be: the
// daemon's only backend, which opens CUDA regions when it can (NULL when the daemon has
// several); host_be: the backend that allocates socket regions with host_alloc and page-locks
// memfd regions with host_register (on CUDA, so the engine copies straight between them and the
// device), or NULL for plain memory.
int rnnd_shm_register(struct rnnd_shm *s, const Rnnd__V1__RegisterRegionRequest *req, bool local,
                      const struct rnnd_backend *be, const struct rnnd_backend *host_be,
                      struct rnnd_shm_registered *out, char *err, size_t errlen);
// ReleaseRegion: 0, or RNND_EPRECOND for an id not registered (or a remote peer's other than a
// socket region). The mapping stays until the calls using it end.
int rnnd_shm_release(struct rnnd_shm *s, uint64_t id, bool local, char *err, size_t errlen);
// Releases the regions whose clients have all exited (no process holds the memfd's lock), and
// socket regions no data connection bound within RNND_SHM_SOCKET_BIND_S.
// Returns how many regions remain.
int rnnd_shm_housekeeping(struct rnnd_shm *s);

// True when msg (a request) has a Tensor with a region or a reply_region. Pure.
bool rnnd_shm_wanted(const ProtobufCMessage *msg);
// Points every Tensor of msg that has a region at the region's memory and takes the
// reply_region. 0 and *out (free with rnnd_shm_use_free before msg), or RNND_EPRECOND (a region
// other than a socket region from a remote peer, region not registered), RNND_EINVAL (data and
// region both set, span outside the region, misaligned, or not the shape's byte count; a CUDA region where dev_ok, RNND_SHM_DEV_* bits,
// does not allow it; tensors in both kinds of region) with the field named in err; msg is then
// as it was.
int rnnd_shm_resolve(struct rnnd_shm *s, ProtobufCMessage *msg, bool local, unsigned dev_ok,
                     struct rnnd_shm_use **out, char *err, size_t errlen);
// Restores msg's tensors (before msg is freed) and unpins the regions. NULL does nothing.
void rnnd_shm_use_free(struct rnnd_shm_use *u);
// True when u's request tensors are in a CUDA region (their data are device pointers). NULL: false.
bool rnnd_shm_use_device_in(const struct rnnd_shm_use *u);
// True when u's request tensors all lie in region memory the backend page-locked (a socket
// region's host_alloc, a memfd's host_register), so the engine may copy them to the device one
// by one, without staging. NULL: false.
bool rnnd_shm_use_host_in(const struct rnnd_shm_use *u);
// The memory of u's reply_region when it is host memory (a memfd or socket region: *len its
// bytes, from a multiple of RNND_SHM_ALIGN), where a Forward split over devices scatters its
// outputs; *pinned true when the backend page-locked it (as for rnnd_shm_use_host_in), where
// the engine may copy its outputs straight from the device. Else NULL (NULL u too).
char *rnnd_shm_use_host_reply(const struct rnnd_shm_use *u, size_t *len, bool *pinned);
// The device memory of u's reply_region when it is in a CUDA region (*len its bytes, from a
// multiple of RNND_SHM_ALIGN), or NULL. NULL u: NULL.
char *rnnd_shm_use_device_reply(const struct rnnd_shm_use *u, size_t *len);
// True when u's reply_region is in a CUDA region registered with async replies: the engine may
// answer once the call's work is queued, after it records the backend's ipc_record. NULL: false.
bool rnnd_shm_use_async(const struct rnnd_shm_use *u);

// Writes reply's tensors into u's reply_region (those that fit, in order), and makes them carry
// region spans instead of data. A tensor already inside the reply_region is placed where it is;
// with a CUDA reply_region, every other one stays bytes. Returns true when rnnd_shm_unplace
// must put them back (after the reply was packed); false when there is no reply_region.
bool rnnd_shm_place(struct rnnd_shm_use *u, ProtobufCMessage *reply);
void rnnd_shm_unplace(struct rnnd_shm_use *u);

#endif // RNND_SHM_H

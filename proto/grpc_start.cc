// grpc_start.cc: gRPC's start-up for the daemon and the C client alike (rnnd_grpc_init). Debian
// builds absl without NDEBUG, so its mutex deadlock detector, a debugging aid, runs inside every
// lock gRPC takes; in a daemon under 16 actors that was about a quarter of gRPC's own CPU, and
// turning it off raised their steps by 7-18% on the H200 host (journal service-02 s35, s38). It
// is turned off before gRPC starts, where gRPC's locks are absl's.
#ifdef RNND_ABSL_MUTEX
#include <absl/synchronization/mutex.h>
#endif
#include <grpc/grpc.h>

#include "grpc_start.h"

extern "C" void rnnd_grpc_init(void) {
#ifdef RNND_ABSL_MUTEX
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
    grpc_init();
}

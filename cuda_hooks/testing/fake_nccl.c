/* A fake NCCL: each call records its arguments, keeps its stream busy for FAKE_NCCL_DURATION_NS (through the
 * fake runtime, when it is loaded globally) and returns a configurable code. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../flare_ring.h"
#include "fakes.h"

#define EXPORT __attribute__((visibility("default")))

static _Atomic int result_code;
static _Atomic int ranks = 1;
static _Atomic uint64_t calls;
static __thread struct fake_nccl_call last_call;

EXPORT void fake_nccl_set_result(int result) { atomic_store(&result_code, result); }
EXPORT void fake_nccl_set_ranks(int count) { atomic_store(&ranks, count); }
EXPORT const struct fake_nccl_call *fake_nccl_last_call(void) { return &last_call; }
EXPORT uint64_t fake_nccl_calls(void) { return atomic_load(&calls); }

static int64_t duration_ns(void) {
    const char *text = getenv("FAKE_NCCL_DURATION_NS");
    return text ? strtoll(text, NULL, 10) : 0;
}

static int collective(struct fake_nccl_call call) {
    static _Atomic(fake_occupy_stream_fn) occupy;
    fake_occupy_stream_fn occupy_stream = atomic_load(&occupy);
    if (occupy_stream == NULL) {
        void *address = dlsym(RTLD_DEFAULT, "fake_cudart_occupy_stream");
        memcpy(&occupy_stream, &address, sizeof address);
        atomic_store(&occupy, occupy_stream);
    }
    if (occupy_stream != NULL)
        occupy_stream(call.stream, duration_ns());
    last_call = call;
    atomic_fetch_add_explicit(&calls, 1, memory_order_relaxed);
    return atomic_load(&result_code);
}

EXPORT int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, void *comm,
                         void *stream) {
    return collective((struct fake_nccl_call){FLARE_API_NCCL_ALL_REDUCE, sendbuff, recvbuff, count, datatype, op, 0,
                                              comm, stream});
}

EXPORT int ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, int datatype, void *comm,
                         void *stream) {
    return collective((struct fake_nccl_call){FLARE_API_NCCL_ALL_GATHER, sendbuff, recvbuff, sendcount, datatype, 0,
                                              0, comm, stream});
}

EXPORT int ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, int datatype, int op,
                             void *comm, void *stream) {
    return collective((struct fake_nccl_call){FLARE_API_NCCL_REDUCE_SCATTER, sendbuff, recvbuff, recvcount, datatype,
                                              op, 0, comm, stream});
}

EXPORT int ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, int datatype, int root, void *comm,
                         void *stream) {
    return collective((struct fake_nccl_call){FLARE_API_NCCL_BROADCAST, sendbuff, recvbuff, count, datatype, 0, root,
                                              comm, stream});
}

EXPORT int ncclReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, int root,
                      void *comm, void *stream) {
    return collective((struct fake_nccl_call){FLARE_API_NCCL_REDUCE, sendbuff, recvbuff, count, datatype, op, root,
                                              comm, stream});
}

EXPORT int ncclSend(const void *sendbuff, size_t count, int datatype, int peer, void *comm, void *stream) {
    return collective(
        (struct fake_nccl_call){FLARE_API_NCCL_SEND, sendbuff, NULL, count, datatype, 0, peer, comm, stream});
}

EXPORT int ncclRecv(void *recvbuff, size_t count, int datatype, int peer, void *comm, void *stream) {
    return collective(
        (struct fake_nccl_call){FLARE_API_NCCL_RECV, NULL, recvbuff, count, datatype, 0, peer, comm, stream});
}

EXPORT int ncclGroupStart(void) { return 0; }
EXPORT int ncclGroupEnd(void) { return atomic_load(&result_code); }

EXPORT int ncclCommCount(void *comm, int *count) {
    (void)comm;
    *count = atomic_load(&ranks);
    return 0;
}

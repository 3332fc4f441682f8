/* The shared-memory ring buffer that libflare_hooks.so writes and flare_exporter/rank/shim.py reads.
 *
 * One file per process: $FLARE_SHIM_RING_DIR/flare-hooks-<pid> (default directory /dev/shm), created at
 * the first sampled call, mapped MAP_SHARED, removed at exit unless FLARE_SHIM_KEEP_RING=1.
 *
 * Layout (little-endian, naturally aligned): a 128-byte header, then `capacity` records of 64 bytes
 * (capacity is a power of two). Record number i (0, 1, 2, ...) lives in slot i % capacity; the newest
 * record overwrites the oldest.
 *
 * One writer (the shim's resolver thread) publishes record i like a seqlock:
 *   slot.seq = 0; release fence; write the payload; slot.seq = i + 1 (release); write_index = i + 1 (release).
 * A reader that wants record i (write_index - capacity <= i < write_index) reads slot.seq, copies the
 * slot, reads slot.seq again: the copy is record i only if both reads equal i + 1. Anything else means
 * the slot was being rewritten or already holds a newer record: the reader counts record i as lost.
 *
 * Counters (sampled, dropped, overwritten, errors) are updated with relaxed atomic adds from any thread.
 * Once the shim is idle, write_index + dropped == sampled.
 */
#ifndef FLARE_RING_H
#define FLARE_RING_H

#include <stddef.h>
#include <stdint.h>

#define FLARE_RING_MAGIC "FLRHOOKS" /* 8 bytes, no terminator in the file */
#define FLARE_RING_VERSION 1u
#define FLARE_RING_HEADER_SIZE 128u
#define FLARE_RING_RECORD_SIZE 64u

/* header.events_state: whether the shim could set up CUDA events in this process */
enum flare_events_state {
    FLARE_EVENTS_NOT_YET = 0,     /* no sampled call has needed them yet */
    FLARE_EVENTS_READY = 1,       /* event pool and resolver thread running */
    FLARE_EVENTS_UNAVAILABLE = 2, /* CUDA runtime event functions missing or failing: nothing is recorded */
};

/* record.api: which intercepted function the record comes from; kernels below 16, NCCL from 16 */
enum flare_api {
    FLARE_API_CUDA_LAUNCH_KERNEL = 1,
    FLARE_API_CUDA_LAUNCH_KERNEL_EXC = 2,
    FLARE_API_CU_LAUNCH_KERNEL = 3,
    FLARE_API_CU_LAUNCH_KERNEL_EX = 4,
    FLARE_API_NCCL_ALL_REDUCE = 16,
    FLARE_API_NCCL_ALL_GATHER = 17,
    FLARE_API_NCCL_REDUCE_SCATTER = 18,
    FLARE_API_NCCL_BROADCAST = 19,
    FLARE_API_NCCL_REDUCE = 20,
    FLARE_API_NCCL_SEND = 21,
    FLARE_API_NCCL_RECV = 22,
};

/* record.flags */
#define FLARE_RECORD_GROUPED 1u /* NCCL call inside ncclGroupStart/End: timed as the whole group */

struct flare_ring_header {
    char magic[8];                 /*   0: FLARE_RING_MAGIC, written last when the file is created */
    uint32_t version;              /*   8: FLARE_RING_VERSION */
    uint32_t header_size;          /*  12: FLARE_RING_HEADER_SIZE */
    uint32_t record_size;          /*  16: FLARE_RING_RECORD_SIZE */
    uint32_t capacity;             /*  20: records in the ring, a power of two */
    _Atomic uint64_t write_index;  /*  24: records published so far */
    _Atomic uint64_t sampled;      /*  32: calls chosen for sampling */
    _Atomic uint64_t dropped;      /*  40: sampled calls that produced no record (pool/queue full, errors) */
    _Atomic uint64_t overwritten;  /*  48: records written over an older, published one */
    _Atomic uint64_t errors;       /*  56: failed CUDA/NCCL calls made by the shim or missing functions */
    int32_t pid;                   /*  64: the process that owns the ring */
    _Atomic uint32_t events_state; /*  68: enum flare_events_state */
    uint32_t kernel_sample_every;  /*  72: one kernel launch in this many per thread is sampled (0: none) */
    uint32_t nccl_sample_every;    /*  76: one NCCL call in this many per thread is sampled (0: none) */
    int64_t created_ns;            /*  80: CLOCK_MONOTONIC time the ring was created */
    int32_t device;                /*  88: CUDA device the events live on (-1: not yet known) */
    uint32_t reserved0;            /*  92 */
    uint8_t reserved[32];          /*  96 .. 128 */
};

struct flare_ring_record {
    _Atomic uint64_t seq;     /*  0: record number + 1 once complete, 0 while being written */
    uint16_t api;             /*  8: enum flare_api */
    uint16_t flags;           /* 10: FLARE_RECORD_* */
    int32_t result;           /* 12: what the intercepted call returned (cudaError_t/CUresult/ncclResult_t) */
    int64_t host_ns;          /* 16: CLOCK_MONOTONIC time of the call, read just before it was forwarded */
    int64_t device_start_ns;  /* 24: host-clock time the device reached the event recorded before the call */
    int64_t device_end_ns;    /* 32: NCCL: ... the event recorded after the call; kernels: = device_start_ns */
    uint64_t bytes;           /* 40: NCCL: element count x element size (reduce-scatter: x ranks); kernels 0 */
    uint64_t stream;          /* 48: the stream handle the call was issued on */
    uint32_t thread_id;       /* 56: Linux thread id of the caller */
    uint32_t reserved;        /* 60 */
};

_Static_assert(sizeof(struct flare_ring_header) == FLARE_RING_HEADER_SIZE, "ring header is 128 bytes");
_Static_assert(sizeof(struct flare_ring_record) == FLARE_RING_RECORD_SIZE, "ring record is 64 bytes");
_Static_assert(offsetof(struct flare_ring_header, write_index) == 24, "write_index at 24");
_Static_assert(offsetof(struct flare_ring_header, created_ns) == 80, "created_ns at 80");
_Static_assert(offsetof(struct flare_ring_record, host_ns) == 16, "host_ns at 16");
_Static_assert(offsetof(struct flare_ring_record, thread_id) == 56, "thread_id at 56");

#endif

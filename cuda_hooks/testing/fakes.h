/* Test doubles for the CUDA runtime, the CUDA driver and NCCL: what they record of each call and how
 * tests steer them. Shared by the fakes and by launch_driver.c. */
#ifndef FLARE_FAKES_H
#define FLARE_FAKES_H

#include <stddef.h>
#include <stdint.h>

/* The launch types as the public APIs declare them: the runtime's (dim3, cudaLaunchConfig_t). */
typedef struct {
    unsigned int x, y, z;
} dim3;

typedef struct {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    void *stream;
    void *attrs;
    unsigned int numAttrs;
} cuda_launch_config;

/* The driver's (CUlaunchConfig). */
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void *hStream;
    void *attrs;
    unsigned int numAttrs;
} cu_launch_config;

/* One launch as a fake library received it (thread-local: the calling thread's last launch). */
struct fake_launch {
    const void *function;
    unsigned int grid[3];
    unsigned int block[3];
    size_t shared_mem;
    void *stream;
    void **args;
    void **extra;
    const void *config;
};

/* One NCCL call as the fake received it (thread-local). Unused fields stay 0. */
struct fake_nccl_call {
    int api; /* FLARE_API_NCCL_* from flare_ring.h */
    const void *sendbuff;
    void *recvbuff;
    size_t count;
    int datatype;
    int op;
    int root_or_peer;
    void *comm;
    void *stream;
};

/* fake libcudart.so. Environment: FAKE_CUDA_EVENT_DELAY_NS, how long after being recorded an event on a
 * stream the fake did not create completes (events on streams it created complete at once, like an idle
 * private stream). */
typedef void (*fake_set_result_fn)(int result);
typedef const struct fake_launch *(*fake_last_launch_fn)(void);
typedef uint64_t (*fake_count_fn)(void);
typedef void (*fake_occupy_stream_fn)(void *stream, int64_t nanoseconds);
/* exported: fake_cudart_set_launch_result, fake_cudart_set_event_record_result, fake_cudart_set_capturing,
 * fake_cudart_last_launch, fake_cudart_launches, fake_cudart_occupy_stream */

/* fake libcuda.so: fake_cuda_set_launch_result, fake_cuda_last_launch, fake_cuda_launches */

/* fake libnccl.so. Environment: FAKE_NCCL_DURATION_NS, the device time of each collective (it occupies the
 * stream that long through fake_cudart_occupy_stream). Exported: fake_nccl_set_result, fake_nccl_set_ranks,
 * fake_nccl_last_call, fake_nccl_calls. */
typedef const struct fake_nccl_call *(*fake_last_nccl_call_fn)(void);

#endif

/* A fake CUDA runtime: launches are recorded and return a configurable code; "device" time is simulated
 * on CLOCK_MONOTONIC (an event on a caller's stream completes FAKE_CUDA_EVENT_DELAY_NS after it is recorded,
 * or when the work that fake NCCL put on the stream ends; on a stream this fake created, at once). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "fakes.h"

#define EXPORT __attribute__((visibility("default")))
#define NOT_READY 600
#define INVALID_VALUE 1


struct fake_event {
    _Atomic int64_t ready_ns; /* 0: never recorded */
};

#define PRIVATE_STREAMS 16
#define BUSY_SLOTS 64

static char private_streams[PRIVATE_STREAMS];
static _Atomic int private_streams_used;
static _Atomic int launch_result, event_record_result, capturing;
static _Atomic uint64_t launches;
static int64_t event_delay_ns = -1;
static __thread struct fake_launch last_launch;
static __thread int last_error;
static pthread_mutex_t busy_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    void *stream;
    int64_t until_ns;
} busy[BUSY_SLOTS];

static int64_t now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static int fail(int error) {
    if (error)
        last_error = error;
    return error;
}

static int is_private(void *stream) {
    return (char *)stream >= private_streams && (char *)stream < private_streams + PRIVATE_STREAMS;
}

static int64_t delay_ns(void) {
    if (event_delay_ns < 0) {
        const char *text = getenv("FAKE_CUDA_EVENT_DELAY_NS");
        event_delay_ns = text ? strtoll(text, NULL, 10) : 0;
    }
    return event_delay_ns;
}

static size_t busy_slot(void *stream) {
    return ((uintptr_t)stream >> 4) % BUSY_SLOTS;
}

EXPORT void fake_cudart_set_launch_result(int result) { atomic_store(&launch_result, result); }
EXPORT void fake_cudart_set_event_record_result(int result) { atomic_store(&event_record_result, result); }
EXPORT void fake_cudart_set_capturing(int status) { atomic_store(&capturing, status); }
EXPORT const struct fake_launch *fake_cudart_last_launch(void) { return &last_launch; }
EXPORT uint64_t fake_cudart_launches(void) { return atomic_load(&launches); }

/* Fake NCCL's collectives keep the stream busy for their duration. */
EXPORT void fake_cudart_occupy_stream(void *stream, int64_t nanoseconds) {
    pthread_mutex_lock(&busy_lock);
    size_t slot = busy_slot(stream);
    int64_t start = now_ns() + delay_ns();
    if (busy[slot].stream == stream && busy[slot].until_ns > start)
        start = busy[slot].until_ns;
    busy[slot].stream = stream;
    busy[slot].until_ns = start + nanoseconds;
    pthread_mutex_unlock(&busy_lock);
}

EXPORT int cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t shared_mem, void *stream) {
    struct fake_launch launch = {func, {grid.x, grid.y, grid.z}, {block.x, block.y, block.z}, shared_mem, stream,
                                 args, NULL, NULL};
    last_launch = launch;
    atomic_fetch_add_explicit(&launches, 1, memory_order_relaxed);
    return fail(atomic_load_explicit(&launch_result, memory_order_relaxed));
}

EXPORT int cudaLaunchKernelExC(const cuda_launch_config *config, const void *func, void **args) {
    struct fake_launch launch = {func,
                                 {config->gridDim.x, config->gridDim.y, config->gridDim.z},
                                 {config->blockDim.x, config->blockDim.y, config->blockDim.z},
                                 config->dynamicSmemBytes,
                                 config->stream,
                                 args,
                                 NULL,
                                 config};
    last_launch = launch;
    atomic_fetch_add_explicit(&launches, 1, memory_order_relaxed);
    return fail(atomic_load_explicit(&launch_result, memory_order_relaxed));
}

EXPORT int cudaEventCreateWithFlags(void **event, unsigned int flags) {
    (void)flags;
    struct fake_event *created = calloc(1, sizeof *created);
    if (created == NULL)
        return fail(2); /* cudaErrorMemoryAllocation */
    *event = created;
    return 0;
}

EXPORT int cudaEventRecord(void *event, void *stream) {
    int result = atomic_load(&event_record_result);
    if (result)
        return fail(result);
    int64_t ready = now_ns() + (is_private(stream) ? 0 : delay_ns());
    pthread_mutex_lock(&busy_lock);
    size_t slot = busy_slot(stream);
    if (busy[slot].stream == stream && busy[slot].until_ns > ready)
        ready = busy[slot].until_ns;
    pthread_mutex_unlock(&busy_lock);
    atomic_store(&((struct fake_event *)event)->ready_ns, ready);
    return 0;
}

EXPORT int cudaEventQuery(void *event) {
    int64_t ready = atomic_load(&((struct fake_event *)event)->ready_ns);
    return now_ns() >= ready ? 0 : NOT_READY;
}

EXPORT int cudaEventSynchronize(void *event) {
    int64_t ready = atomic_load(&((struct fake_event *)event)->ready_ns);
    for (int64_t now = now_ns(); now < ready; now = now_ns()) {
        struct timespec pause = {0, (long)(ready - now)};
        nanosleep(&pause, NULL);
    }
    return 0;
}

EXPORT int cudaEventElapsedTime(float *milliseconds, void *start, void *end) {
    int64_t start_ns = atomic_load(&((struct fake_event *)start)->ready_ns);
    int64_t end_ns = atomic_load(&((struct fake_event *)end)->ready_ns);
    int64_t now = now_ns();
    if (!start_ns || !end_ns)
        return fail(INVALID_VALUE);
    if (now < start_ns || now < end_ns)
        return fail(NOT_READY);
    *milliseconds = (float)((double)(end_ns - start_ns) / 1e6);
    return 0;
}

EXPORT int cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
    (void)flags;
    int index = atomic_fetch_add(&private_streams_used, 1);
    if (index >= PRIVATE_STREAMS)
        return fail(2);
    *stream = &private_streams[index];
    return 0;
}

EXPORT int cudaStreamIsCapturing(void *stream, int *status) {
    (void)stream;
    *status = atomic_load(&capturing);
    return 0;
}

EXPORT int cudaGetDevice(int *device) {
    *device = 0;
    return 0;
}

EXPORT int cudaSetDevice(int device) { return device == 0 ? 0 : fail(101); /* cudaErrorInvalidDevice */ }

EXPORT int cudaThreadExchangeStreamCaptureMode(int *mode) {
    *mode = 0;
    return 0;
}

EXPORT int cudaPeekAtLastError(void) { return last_error; }

EXPORT int cudaGetLastError(void) {
    int error = last_error;
    last_error = 0;
    return error;
}

/* libflare_hooks.so: an LD_PRELOAD shim that samples kernel launches and NCCL calls into a ring buffer.
 *
 * Every intercepted call is forwarded unchanged to the next definition of its symbol (dlsym(RTLD_NEXT),
 * or the loaded CUDA/NCCL library when it is not in the global scope). One call in N per thread and
 * family (kernels, NCCL) is sampled: the host time is read and a CUDA event is recorded on the call's
 * stream (NCCL: one before and one after the call). The sample goes to a bounded lock-free queue; a
 * resolver thread polls its events, places them on the host clock through an anchor event, and
 * publishes fixed-size records into the shared-memory ring described in flare_ring.h.
 *
 * The hot path never blocks, never allocates after the first sampled call, and never leaves a trace
 * in the caller's CUDA state: when the caller has a pending CUDA error the call is not sampled, and a
 * failing call of the shim is followed by cudaGetLastError() so that the caller does not see it.
 * No CUDA or NCCL header is needed: the few public declarations used are written out below.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "flare_ring.h"

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
/* The shim is preloaded, so its thread-locals fit in static TLS: no __tls_get_addr on the hot path. */
#define THREAD_LOCAL __thread __attribute__((tls_model("initial-exec")))

/* ---- public CUDA 12 runtime/driver and NCCL 2.x declarations (handles are opaque pointers) ---- */

typedef int cudaError_t;
typedef int CUresult;
typedef int ncclResult_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef void *CUstream;
typedef void *CUfunction;
typedef void *ncclComm_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;

typedef struct {
    unsigned int x, y, z;
} flare_dim3; /* dim3 */

typedef struct {
    flare_dim3 gridDim;
    flare_dim3 blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    void *attrs;
    unsigned int numAttrs;
} flare_cuda_launch_config; /* cudaLaunchConfig_t */

typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} flare_cu_launch_config; /* CUlaunchConfig */

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INITIALIZATION = 3, /* cudaErrorInitializationError: returned when the runtime is missing */
    CU_ERROR_NOT_INITIALIZED = 3,  /* CUDA_ERROR_NOT_INITIALIZED: ... when the driver is missing */
    NCCL_SYSTEM_ERROR = 2,         /* ncclSystemError: ... when NCCL is missing */
    CUDA_ERROR_NOT_READY = 600,    /* cudaErrorNotReady */
    CUDA_EVENT_DEFAULT = 0,        /* cudaEventDefault: timing enabled */
    CUDA_STREAM_NON_BLOCKING = 1,  /* cudaStreamNonBlocking */
    CUDA_CAPTURE_MODE_RELAXED = 2, /* cudaStreamCaptureModeRelaxed */
    CUDA_CAPTURE_STATUS_NONE = 0,  /* cudaStreamCaptureStatusNone */
};

typedef cudaError_t (*cuda_launch_kernel_fn)(const void *, flare_dim3, flare_dim3, void **, size_t, cudaStream_t);
typedef cudaError_t (*cuda_launch_kernel_exc_fn)(const flare_cuda_launch_config *, const void *, void **);
typedef CUresult (*cu_launch_kernel_fn)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                                        unsigned int, unsigned int, unsigned int, CUstream, void **, void **);
typedef CUresult (*cu_launch_kernel_ex_fn)(const flare_cu_launch_config *, CUfunction, void **, void **);
typedef ncclResult_t (*nccl_reduce_like_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                            cudaStream_t);
typedef ncclResult_t (*nccl_all_gather_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*nccl_broadcast_fn)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                                          cudaStream_t);
typedef ncclResult_t (*nccl_reduce_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                                       cudaStream_t);
typedef ncclResult_t (*nccl_send_fn)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*nccl_recv_fn)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*nccl_group_fn)(void);
typedef ncclResult_t (*nccl_comm_count_fn)(ncclComm_t, int *);

/* ---- resolving the real functions ---- */

struct real_symbol {
    const char *name;
    const char *library; /* file name prefix of the library that defines it, for the fallback lookup */
    _Atomic(void *) address;
};

#define REAL_SYMBOL(variable, symbol, library) static struct real_symbol variable = {symbol, library, NULL}

REAL_SYMBOL(real_cuda_launch_kernel, "cudaLaunchKernel", "libcudart");
REAL_SYMBOL(real_cuda_launch_kernel_exc, "cudaLaunchKernelExC", "libcudart");
REAL_SYMBOL(real_cu_launch_kernel, "cuLaunchKernel", "libcuda.so");
REAL_SYMBOL(real_cu_launch_kernel_ex, "cuLaunchKernelEx", "libcuda.so");
REAL_SYMBOL(real_nccl_all_reduce, "ncclAllReduce", "libnccl");
REAL_SYMBOL(real_nccl_all_gather, "ncclAllGather", "libnccl");
REAL_SYMBOL(real_nccl_reduce_scatter, "ncclReduceScatter", "libnccl");
REAL_SYMBOL(real_nccl_broadcast, "ncclBroadcast", "libnccl");
REAL_SYMBOL(real_nccl_reduce, "ncclReduce", "libnccl");
REAL_SYMBOL(real_nccl_send, "ncclSend", "libnccl");
REAL_SYMBOL(real_nccl_recv, "ncclRecv", "libnccl");
REAL_SYMBOL(real_nccl_group_start, "ncclGroupStart", "libnccl");
REAL_SYMBOL(real_nccl_group_end, "ncclGroupEnd", "libnccl");
REAL_SYMBOL(real_nccl_comm_count, "ncclCommCount", "libnccl");

struct library_search {
    const char *prefix;
    char path[4096];
};

static int find_library_path(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct library_search *search = data;
    const char *name = info->dlpi_name;
    if (name == NULL || name[0] == '\0')
        return 0;
    const char *slash = strrchr(name, '/');
    const char *base = slash ? slash + 1 : name;
    if (strncmp(base, search->prefix, strlen(search->prefix)) != 0)
        return 0;
    snprintf(search->path, sizeof search->path, "%s", name);
    return 1;
}

/* A library loaded with RTLD_LOCAL (a dependency of a dlopen'ed extension) is not in RTLD_NEXT's scope,
 * but calls into it still bind to this shim: look it up among the loaded objects, never loading one. */
static void *lookup_in_loaded_library(const struct real_symbol *symbol) {
    struct library_search search = {symbol->library, {0}};
    if (!dl_iterate_phdr(find_library_path, &search))
        return NULL; /* dlopen is not called inside the callback: it holds the loader's lock */
    void *handle = dlopen(search.path, RTLD_LAZY | RTLD_NOLOAD);
    return handle ? dlsym(handle, symbol->name) : NULL;
}

static void *resolve_slow(struct real_symbol *symbol) {
    void *address = dlsym(RTLD_NEXT, symbol->name);
    if (address == NULL)
        address = lookup_in_loaded_library(symbol);
    if (address != NULL) /* racing threads store the same value; a miss is retried at the next call */
        atomic_store_explicit(&symbol->address, address, memory_order_release);
    return address;
}

static inline void *resolve(struct real_symbol *symbol) {
    void *address = atomic_load_explicit(&symbol->address, memory_order_acquire);
    return LIKELY(address != NULL) ? address : resolve_slow(symbol);
}

/* ---- configuration (environment, read once) ---- */

static struct {
    uint32_t kernel_every;
    uint32_t nccl_every;
    uint32_t ring_records;
    uint32_t pool_size;
    uint32_t queue_size;
    uint32_t poll_us;
    int keep_ring;
    char ring_dir[3072];
} config;

static pthread_once_t config_once = PTHREAD_ONCE_INIT;

static uint32_t env_number(const char *name, uint32_t fallback, uint32_t lowest, uint32_t highest) {
    const char *text = getenv(name);
    if (text == NULL || *text == '\0')
        return fallback;
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    if (end == text || *end != '\0')
        return fallback;
    if (value < lowest)
        return lowest;
    return value > highest ? highest : (uint32_t)value;
}

static uint32_t power_of_two_at_least(uint32_t value) {
    uint32_t power = 1;
    while (power < value)
        power <<= 1;
    return power;
}

static void load_config(void) {
    config.kernel_every = env_number("FLARE_SHIM_SAMPLE_EVERY", 64, 0, UINT32_MAX);
    config.nccl_every = env_number("FLARE_SHIM_NCCL_SAMPLE_EVERY", 1, 0, UINT32_MAX);
    config.ring_records = power_of_two_at_least(env_number("FLARE_SHIM_RING_RECORDS", 16384, 16, 1u << 24));
    config.pool_size = env_number("FLARE_SHIM_EVENTS", 512, 2, 1u << 20);
    config.queue_size = power_of_two_at_least(env_number("FLARE_SHIM_QUEUE", 1024, 2, 1u << 20));
    config.poll_us = env_number("FLARE_SHIM_POLL_US", 500, 10, 1000000);
    config.keep_ring = env_number("FLARE_SHIM_KEEP_RING", 0, 0, 1) != 0;
    const char *dir = getenv("FLARE_SHIM_RING_DIR");
    snprintf(config.ring_dir, sizeof config.ring_dir, "%s", dir && *dir ? dir : "/dev/shm");
}

static int64_t now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); /* time.perf_counter() reads the same clock on Linux */
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static void sleep_us(uint32_t microseconds) {
    struct timespec pause = {microseconds / 1000000, (long)(microseconds % 1000000) * 1000};
    nanosleep(&pause, NULL);
}

/* ---- the ring ---- */

static _Atomic int shim_active = 1; /* 0 in a forked child, or when the ring cannot be created */
static struct flare_ring_header *ring;
static struct flare_ring_record *ring_records;
static char ring_path[4096];
static pthread_once_t ring_once = PTHREAD_ONCE_INIT;

static void remove_ring_at_exit(void);
static void stop_resolver_at_exit(void);

static void create_ring(void) {
    pthread_once(&config_once, load_config);
    snprintf(ring_path, sizeof ring_path, "%s/flare-hooks-%d", config.ring_dir, (int)getpid());
    size_t bytes = FLARE_RING_HEADER_SIZE + (size_t)config.ring_records * FLARE_RING_RECORD_SIZE;
    int fd = open(ring_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        atomic_store(&shim_active, 0);
        return;
    }
    void *mapping = MAP_FAILED;
    if (ftruncate(fd, (off_t)bytes) == 0)
        mapping = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (mapping == MAP_FAILED) {
        unlink(ring_path);
        atomic_store(&shim_active, 0);
        return;
    }
    struct flare_ring_header *header = mapping; /* the file is new and zero-filled */
    header->version = FLARE_RING_VERSION;
    header->header_size = FLARE_RING_HEADER_SIZE;
    header->record_size = FLARE_RING_RECORD_SIZE;
    header->capacity = config.ring_records;
    header->pid = (int32_t)getpid();
    header->kernel_sample_every = config.kernel_every;
    header->nccl_sample_every = config.nccl_every;
    header->created_ns = now_ns();
    header->device = -1;
    atomic_thread_fence(memory_order_release);
    memcpy(header->magic, FLARE_RING_MAGIC, sizeof header->magic); /* last: a reader sees a whole header */
    ring_records = (struct flare_ring_record *)((char *)mapping + FLARE_RING_HEADER_SIZE);
    ring = header;
    atexit(remove_ring_at_exit);
}

static struct flare_ring_header *ensure_ring(void) {
    pthread_once(&ring_once, create_ring);
    return ring;
}

static void count(_Atomic uint64_t *counter) {
    atomic_fetch_add_explicit(counter, 1, memory_order_relaxed);
}

static void count_error(void) {
    struct flare_ring_header *header = ensure_ring();
    if (header != NULL)
        count(&header->errors);
}

static void count_drop(void) {
    if (ring != NULL)
        count(&ring->dropped);
}

/* Resolver thread only: publish one record, overwriting the oldest once the ring is full. */
static void publish(uint16_t api, uint16_t flags, int32_t result, int64_t host_ns, int64_t start_ns, int64_t end_ns,
                    uint64_t bytes, uint64_t stream, uint32_t caller_thread) {
    uint64_t index = atomic_load_explicit(&ring->write_index, memory_order_relaxed);
    struct flare_ring_record *record = &ring_records[index & (ring->capacity - 1)];
    atomic_store_explicit(&record->seq, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release); /* readers see seq = 0 before any changed payload byte */
    record->api = api;
    record->flags = flags;
    record->result = result;
    record->host_ns = host_ns;
    record->device_start_ns = start_ns;
    record->device_end_ns = end_ns;
    record->bytes = bytes;
    record->stream = stream;
    record->thread_id = caller_thread;
    record->reserved = 0;
    atomic_store_explicit(&record->seq, index + 1, memory_order_release);
    if (index >= ring->capacity)
        count(&ring->overwritten);
    atomic_store_explicit(&ring->write_index, index + 1, memory_order_release);
}

/* ---- bounded lock-free queue (Vyukov's MPMC array queue) of fixed-size elements ---- */

struct queue {
    size_t mask;
    size_t element_size;
    size_t cell_size;
    unsigned char *cells; /* each: an _Atomic size_t sequence, then the element */
    _Alignas(64) _Atomic size_t enqueue_position;
    _Alignas(64) _Atomic size_t dequeue_position;
};

static _Atomic size_t *cell_sequence(struct queue *queue, size_t position) {
    return (_Atomic size_t *)(queue->cells + (position & queue->mask) * queue->cell_size);
}

static int queue_init(struct queue *queue, uint32_t capacity, size_t element_size) {
    queue->mask = capacity - 1;
    queue->element_size = element_size;
    queue->cell_size = (sizeof(size_t) + element_size + 7) & ~(size_t)7;
    queue->cells = calloc(capacity, queue->cell_size);
    if (queue->cells == NULL)
        return 0;
    for (size_t position = 0; position < capacity; position++)
        atomic_init(cell_sequence(queue, position), position);
    atomic_init(&queue->enqueue_position, 0);
    atomic_init(&queue->dequeue_position, 0);
    return 1;
}

static int queue_push(struct queue *queue, const void *element) {
    size_t position = atomic_load_explicit(&queue->enqueue_position, memory_order_relaxed);
    for (;;) {
        _Atomic size_t *sequence = cell_sequence(queue, position);
        intptr_t lag = (intptr_t)atomic_load_explicit(sequence, memory_order_acquire) - (intptr_t)position;
        if (lag == 0) {
            if (atomic_compare_exchange_weak_explicit(&queue->enqueue_position, &position, position + 1,
                                                      memory_order_relaxed, memory_order_relaxed)) {
                memcpy((unsigned char *)sequence + sizeof(size_t), element, queue->element_size);
                atomic_store_explicit(sequence, position + 1, memory_order_release);
                return 1;
            }
        } else if (lag < 0) {
            return 0; /* full */
        } else {
            position = atomic_load_explicit(&queue->enqueue_position, memory_order_relaxed);
        }
    }
}

static int queue_pop(struct queue *queue, void *element) {
    size_t position = atomic_load_explicit(&queue->dequeue_position, memory_order_relaxed);
    for (;;) {
        _Atomic size_t *sequence = cell_sequence(queue, position);
        intptr_t lag = (intptr_t)atomic_load_explicit(sequence, memory_order_acquire) - (intptr_t)(position + 1);
        if (lag == 0) {
            if (atomic_compare_exchange_weak_explicit(&queue->dequeue_position, &position, position + 1,
                                                      memory_order_relaxed, memory_order_relaxed)) {
                memcpy(element, (unsigned char *)sequence + sizeof(size_t), queue->element_size);
                atomic_store_explicit(sequence, position + queue->mask + 1, memory_order_release);
                return 1;
            }
        } else if (lag < 0) {
            return 0; /* empty */
        } else {
            position = atomic_load_explicit(&queue->dequeue_position, memory_order_relaxed);
        }
    }
}

/* ---- CUDA events: the runtime functions, the pool, the pending samples ---- */

static struct {
    cudaError_t (*event_create)(cudaEvent_t *, unsigned int);
    cudaError_t (*event_record)(cudaEvent_t, cudaStream_t);
    cudaError_t (*event_query)(cudaEvent_t);
    cudaError_t (*event_synchronize)(cudaEvent_t);
    cudaError_t (*event_elapsed)(float *, cudaEvent_t, cudaEvent_t);
    cudaError_t (*stream_create)(cudaStream_t *, unsigned int);
    cudaError_t (*peek_last_error)(void);
    cudaError_t (*get_last_error)(void);
    cudaError_t (*stream_is_capturing)(cudaStream_t, int *); /* optional from here on */
    cudaError_t (*get_device)(int *);
    cudaError_t (*set_device)(int);
    cudaError_t (*exchange_capture_mode)(int *);
} runtime;

struct sample {
    int64_t host_ns;
    cudaEvent_t start;
    cudaEvent_t end; /* NCCL only */
    uint64_t stream;
    uint64_t bytes;
    uint32_t thread_id;
    uint16_t api;
    uint16_t flags;
    int32_t result;
};

enum { EVENTS_IDLE, EVENTS_STARTING, EVENTS_READY, EVENTS_UNAVAILABLE };

static _Atomic int events_state = EVENTS_IDLE;
static struct queue event_pool;      /* free cudaEvent_t handles */
static struct queue pending_samples; /* struct sample, from launching threads to the resolver */
static struct sample *in_flight;     /* the resolver's samples awaiting the device, oldest first */
static int device = -1;
static _Atomic uint64_t queued_samples;  /* pushed to pending_samples */
static _Atomic uint64_t settled_samples; /* published or dropped by the resolver */
static _Atomic int resolver_stop;
static _Atomic int resolver_running;

static void *resolver_main(void *unused);

/* dlsym returns a data pointer: copy it into the function pointer rather than converting it */
#define RESOLVE_RUNTIME(field, name)                    \
    do {                                                \
        void *address = dlsym_runtime(name);            \
        memcpy(&runtime.field, &address, sizeof address); \
    } while (0)

static void *dlsym_runtime(const char *name) {
    struct real_symbol symbol = {name, "libcudart", NULL};
    return resolve_slow(&symbol);
}

static int clear_error_if(cudaError_t status) {
    if (status != CUDA_SUCCESS) {
        runtime.get_last_error(); /* the caller had no pending error (checked), so this restores its state */
        count_error();
    }
    return status != CUDA_SUCCESS;
}

/* On the first sampled call: resolve the runtime, fill the event pool, start the resolver. */
static int start_events(void) {
    RESOLVE_RUNTIME(event_create, "cudaEventCreateWithFlags");
    RESOLVE_RUNTIME(event_record, "cudaEventRecord");
    RESOLVE_RUNTIME(event_query, "cudaEventQuery");
    RESOLVE_RUNTIME(event_synchronize, "cudaEventSynchronize");
    RESOLVE_RUNTIME(event_elapsed, "cudaEventElapsedTime");
    RESOLVE_RUNTIME(stream_create, "cudaStreamCreateWithFlags");
    RESOLVE_RUNTIME(peek_last_error, "cudaPeekAtLastError");
    RESOLVE_RUNTIME(get_last_error, "cudaGetLastError");
    RESOLVE_RUNTIME(stream_is_capturing, "cudaStreamIsCapturing");
    RESOLVE_RUNTIME(get_device, "cudaGetDevice");
    RESOLVE_RUNTIME(set_device, "cudaSetDevice");
    RESOLVE_RUNTIME(exchange_capture_mode, "cudaThreadExchangeStreamCaptureMode");
    if (!runtime.event_create || !runtime.event_record || !runtime.event_query || !runtime.event_synchronize ||
        !runtime.event_elapsed || !runtime.stream_create || !runtime.peek_last_error || !runtime.get_last_error) {
        count_error();
        return EVENTS_UNAVAILABLE;
    }
    if (runtime.peek_last_error() != CUDA_SUCCESS)
        return EVENTS_IDLE; /* the caller's pending error must stay its own: try again at a later sample */
    if (runtime.get_device != NULL && clear_error_if(runtime.get_device(&device)))
        device = -1;
    uint32_t pool_capacity = power_of_two_at_least(config.pool_size);
    in_flight = calloc(config.pool_size, sizeof *in_flight);
    if (in_flight == NULL || !queue_init(&event_pool, pool_capacity, sizeof(cudaEvent_t)) ||
        !queue_init(&pending_samples, config.queue_size, sizeof(struct sample)))
        return EVENTS_UNAVAILABLE;
    uint32_t created = 0;
    for (; created < config.pool_size; created++) {
        cudaEvent_t event = NULL;
        if (clear_error_if(runtime.event_create(&event, CUDA_EVENT_DEFAULT)))
            break;
        queue_push(&event_pool, &event);
    }
    if (created < 2)
        return EVENTS_UNAVAILABLE;
    /* the resolver takes no signal meant for the application's threads */
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    pthread_t thread;
    int failed = pthread_create(&thread, NULL, resolver_main, NULL);
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    if (failed)
        return EVENTS_UNAVAILABLE;
    pthread_detach(thread);
    atomic_store(&resolver_running, 1);
    /* registered once the runtime has made events, so after its own exit handlers: it runs before them */
    atexit(stop_resolver_at_exit);
    return EVENTS_READY;
}

static int events_ready(void) {
    int state = atomic_load_explicit(&events_state, memory_order_acquire);
    if (LIKELY(state == EVENTS_READY))
        return 1;
    int idle = EVENTS_IDLE;
    if (state != EVENTS_IDLE || !atomic_compare_exchange_strong(&events_state, &idle, EVENTS_STARTING))
        return 0; /* another thread is starting them, or they are unavailable: never wait */
    int next = start_events();
    ring->device = device;
    atomic_store(&ring->events_state, next == EVENTS_READY         ? FLARE_EVENTS_READY
                                      : next == EVENTS_UNAVAILABLE ? FLARE_EVENTS_UNAVAILABLE
                                                                   : FLARE_EVENTS_NOT_YET);
    atomic_store_explicit(&events_state, next, memory_order_release);
    return next == EVENTS_READY;
}

/* ---- sampling decisions (per thread, per family) ---- */

static THREAD_LOCAL uint32_t kernel_calls_left; /* calls until this thread's next kernel sample; 0: new thread */
static THREAD_LOCAL uint32_t nccl_calls_left;
static THREAD_LOCAL uint32_t cached_thread_id;
static THREAD_LOCAL int nccl_group_depth;

static int take_sample_slow(uint32_t *calls_left, int nccl) {
    pthread_once(&config_once, load_config);
    uint32_t every = nccl ? config.nccl_every : config.kernel_every;
    if (every == 0) {
        *calls_left = UINT32_MAX;
        return 0;
    }
    if (*calls_left == 0 && every > 1) { /* a thread's first call: its every-th call is sampled */
        *calls_left = every - 1;
        return 0;
    }
    *calls_left = every;
    return atomic_load_explicit(&shim_active, memory_order_relaxed);
}

static inline int take_sample(uint32_t *calls_left, int nccl) {
    uint32_t left = *calls_left;
    if (LIKELY(left > 1)) {
        *calls_left = left - 1;
        return 0;
    }
    return take_sample_slow(calls_left, nccl);
}

static uint32_t thread_id(void) {
    if (cached_thread_id == 0)
        cached_thread_id = (uint32_t)syscall(SYS_gettid);
    return cached_thread_id;
}

static void release_events(const struct sample *sample) {
    if (sample->start != NULL)
        queue_push(&event_pool, &sample->start); /* the pool holds every event: it cannot be full */
    if (sample->end != NULL)
        queue_push(&event_pool, &sample->end);
}

static int stream_capturing(cudaStream_t stream) {
    if (runtime.stream_is_capturing == NULL)
        return 0;
    int status = CUDA_CAPTURE_STATUS_NONE;
    if (clear_error_if(runtime.stream_is_capturing(stream, &status)))
        return 1;
    return status != CUDA_CAPTURE_STATUS_NONE; /* an event recorded into a graph would time nothing */
}

/* Before a sampled call: read the host time and record the start event. 1: timed (finish with
 * sample_end), 0: not timed, the drop already counted. */
static int sample_begin(struct sample *sample, uint16_t api, void *stream, int with_end_event) {
    struct flare_ring_header *header = ensure_ring();
    if (header == NULL)
        return 0;
    count(&header->sampled);
    memset(sample, 0, sizeof *sample);
    if (!events_ready() || runtime.peek_last_error() != CUDA_SUCCESS || stream_capturing(stream) ||
        !queue_pop(&event_pool, &sample->start)) {
        count_drop();
        return 0;
    }
    if (with_end_event && !queue_pop(&event_pool, &sample->end)) {
        release_events(sample);
        count_drop();
        return 0;
    }
    sample->api = api;
    sample->stream = (uint64_t)(uintptr_t)stream;
    sample->thread_id = thread_id();
    sample->host_ns = now_ns();
    if (clear_error_if(runtime.event_record(sample->start, stream))) {
        release_events(sample);
        count_drop();
        return 0;
    }
    return 1;
}

/* After the forwarded call: record the end event (NCCL) and hand the sample to the resolver. */
static void sample_end(struct sample *sample, int32_t result) {
    sample->result = result;
    if (sample->end != NULL) {
        cudaStream_t stream = (cudaStream_t)(uintptr_t)sample->stream;
        if (runtime.peek_last_error() != CUDA_SUCCESS || clear_error_if(runtime.event_record(sample->end, stream))) {
            release_events(sample);
            count_drop();
            return;
        }
    }
    if (!queue_push(&pending_samples, sample)) {
        release_events(sample);
        count_drop();
        return;
    }
    atomic_fetch_add_explicit(&queued_samples, 1, memory_order_release);
}

static int missing_symbol(int code) {
    count_error();
    return code;
}

/* ---- the resolver thread ---- */

#define ANCHOR_NS 5000000000LL /* renew the anchor so that float milliseconds from it stay sub-microsecond */
#define BLOCKED_STREAMS 16

static struct {
    cudaStream_t stream;
    cudaEvent_t event;
    int64_t host_ns; /* host time read just before the anchor was recorded on the idle private stream */
    int ready;
} anchor;

static int renew_anchor(void) {
    if (anchor.event == NULL && (runtime.stream_create(&anchor.stream, CUDA_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
                                 runtime.event_create(&anchor.event, CUDA_EVENT_DEFAULT) != CUDA_SUCCESS)) {
        anchor.event = NULL;
        count_error();
        return 0;
    }
    int64_t host_ns = now_ns();
    if (runtime.event_record(anchor.event, anchor.stream) != CUDA_SUCCESS ||
        runtime.event_synchronize(anchor.event) != CUDA_SUCCESS) {
        anchor.ready = 0;
        count_error();
        return 0;
    }
    anchor.host_ns = host_ns;
    anchor.ready = 1;
    return 1;
}

static int64_t milliseconds_to_ns(float milliseconds) {
    return (int64_t)llround((double)milliseconds * 1e6);
}

/* 1: published, -1: dropped (counted), 0: the device has not reached its events yet. */
static int resolve_sample(const struct sample *sample) {
    cudaError_t status = runtime.event_query(sample->start);
    if (status == CUDA_SUCCESS && sample->end != NULL)
        status = runtime.event_query(sample->end);
    if (status == CUDA_ERROR_NOT_READY)
        return 0;
    float from_anchor = 0.0f, duration = 0.0f;
    if (status != CUDA_SUCCESS ||
        ((!anchor.ready || now_ns() - anchor.host_ns > ANCHOR_NS) && !renew_anchor()) ||
        runtime.event_elapsed(&from_anchor, anchor.event, sample->start) != CUDA_SUCCESS ||
        (sample->end != NULL && runtime.event_elapsed(&duration, sample->start, sample->end) != CUDA_SUCCESS)) {
        count_error();
        count_drop();
        return -1;
    }
    int64_t start_ns = anchor.host_ns + milliseconds_to_ns(from_anchor);
    int64_t end_ns = start_ns + milliseconds_to_ns(duration);
    publish(sample->api, sample->flags, sample->result, sample->host_ns, start_ns, end_ns, sample->bytes,
            sample->stream, sample->thread_id);
    return 1;
}

static int stream_listed(cudaStream_t const *streams, int count, uint64_t stream) {
    for (int index = 0; index < count; index++)
        if ((uint64_t)(uintptr_t)streams[index] == stream)
            return 1;
    return 0;
}

static void *resolver_main(void *unused) {
    (void)unused;
    pthread_setname_np(pthread_self(), "flare-hooks");
    if (runtime.set_device != NULL && device >= 0)
        runtime.set_device(device);
    if (runtime.exchange_capture_mode != NULL) { /* its queries must not break another thread's capture */
        int mode = CUDA_CAPTURE_MODE_RELAXED;
        runtime.exchange_capture_mode(&mode);
    }
    size_t waiting = 0;
    while (!atomic_load_explicit(&resolver_stop, memory_order_acquire)) {
        while (waiting < config.pool_size && queue_pop(&pending_samples, &in_flight[waiting]))
            waiting++;
        /* Work on one stream completes in order: once an event of a stream is not reached, later
         * samples of that stream are not queried in this pass. */
        cudaStream_t blocked[BLOCKED_STREAMS];
        int blocked_count = 0;
        size_t kept = 0, settled = 0;
        for (size_t index = 0; index < waiting; index++) {
            struct sample *sample = &in_flight[index];
            int outcome = 0;
            if (!stream_listed(blocked, blocked_count, sample->stream)) {
                outcome = resolve_sample(sample);
                if (outcome == 0 && blocked_count < BLOCKED_STREAMS)
                    blocked[blocked_count++] = (cudaStream_t)(uintptr_t)sample->stream;
            }
            if (outcome == 0) {
                in_flight[kept++] = *sample;
            } else {
                release_events(sample);
                settled++;
            }
        }
        waiting = kept;
        if (settled)
            atomic_fetch_add_explicit(&settled_samples, settled, memory_order_release);
        else
            sleep_us(config.poll_us);
    }
    atomic_store(&resolver_running, 0);
    return NULL;
}

/* At exit, before the CUDA runtime tears down: the resolver must not be inside a runtime call then. */
static void stop_resolver_at_exit(void) {
    atomic_store(&resolver_stop, 1);
    for (int wait = 0; wait < 200 && atomic_load(&resolver_running); wait++)
        sleep_us(1000);
}

static void remove_ring_at_exit(void) {
    if (!config.keep_ring && ring != NULL)
        unlink(ring_path);
}

static void after_fork_in_child(void) {
    /* the resolver thread did not survive the fork and the ring belongs to the parent */
    atomic_store(&shim_active, 0);
    ring = NULL;
}

__attribute__((constructor)) static void install_fork_handler(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

/* Wait until every sample queued so far is published or dropped. 0: done, -1: timed out. For tests
 * and benchmarks; the exporter never calls it. */
EXPORT int flare_hooks_flush(int timeout_ms) {
    uint64_t target = atomic_load_explicit(&queued_samples, memory_order_acquire);
    int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000;
    while (atomic_load_explicit(&settled_samples, memory_order_acquire) < target) {
        if (now_ns() > deadline)
            return -1;
        sleep_us(100);
    }
    return 0;
}

/* ---- kernel launches ---- */

EXPORT cudaError_t cudaLaunchKernel(const void *func, flare_dim3 grid, flare_dim3 block, void **args,
                                    size_t shared_mem, cudaStream_t stream) {
    cuda_launch_kernel_fn real = (cuda_launch_kernel_fn)resolve(&real_cuda_launch_kernel);
    if (UNLIKELY(real == NULL))
        return missing_symbol(CUDA_ERROR_INITIALIZATION);
    struct sample sample;
    if (LIKELY(!take_sample(&kernel_calls_left, 0)) ||
        !sample_begin(&sample, FLARE_API_CUDA_LAUNCH_KERNEL, stream, 0))
        return real(func, grid, block, args, shared_mem, stream);
    cudaError_t result = real(func, grid, block, args, shared_mem, stream);
    sample_end(&sample, result);
    return result;
}

EXPORT cudaError_t cudaLaunchKernelExC(const flare_cuda_launch_config *launch, const void *func, void **args) {
    cuda_launch_kernel_exc_fn real = (cuda_launch_kernel_exc_fn)resolve(&real_cuda_launch_kernel_exc);
    if (UNLIKELY(real == NULL))
        return missing_symbol(CUDA_ERROR_INITIALIZATION);
    struct sample sample;
    if (LIKELY(!take_sample(&kernel_calls_left, 0)) || launch == NULL ||
        !sample_begin(&sample, FLARE_API_CUDA_LAUNCH_KERNEL_EXC, launch->stream, 0))
        return real(launch, func, args);
    cudaError_t result = real(launch, func, args);
    sample_end(&sample, result);
    return result;
}

EXPORT CUresult cuLaunchKernel(CUfunction function, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                               unsigned int block_x, unsigned int block_y, unsigned int block_z,
                               unsigned int shared_mem, CUstream stream, void **params, void **extra) {
    cu_launch_kernel_fn real = (cu_launch_kernel_fn)resolve(&real_cu_launch_kernel);
    if (UNLIKELY(real == NULL))
        return missing_symbol(CU_ERROR_NOT_INITIALIZED);
    struct sample sample;
    if (LIKELY(!take_sample(&kernel_calls_left, 0)) ||
        !sample_begin(&sample, FLARE_API_CU_LAUNCH_KERNEL, stream, 0))
        return real(function, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem, stream, params, extra);
    CUresult result =
        real(function, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem, stream, params, extra);
    sample_end(&sample, result);
    return result;
}

EXPORT CUresult cuLaunchKernelEx(const flare_cu_launch_config *launch, CUfunction function, void **params,
                                 void **extra) {
    cu_launch_kernel_ex_fn real = (cu_launch_kernel_ex_fn)resolve(&real_cu_launch_kernel_ex);
    if (UNLIKELY(real == NULL))
        return missing_symbol(CU_ERROR_NOT_INITIALIZED);
    struct sample sample;
    if (LIKELY(!take_sample(&kernel_calls_left, 0)) || launch == NULL ||
        !sample_begin(&sample, FLARE_API_CU_LAUNCH_KERNEL_EX, launch->hStream, 0))
        return real(launch, function, params, extra);
    CUresult result = real(launch, function, params, extra);
    sample_end(&sample, result);
    return result;
}

/* ---- NCCL ---- */

#define GROUP_DEFERRED 8

/* Inside ncclGroupStart/End a call only enqueues: the work is launched at the outermost ncclGroupEnd,
 * so its end event is recorded there (the record then times the whole group). */
static THREAD_LOCAL struct sample group_deferred[GROUP_DEFERRED];
static THREAD_LOCAL int group_deferred_count;

static uint64_t nccl_bytes(size_t count, ncclDataType_t type) {
    /* ncclInt8, Uint8, Int32, Uint32, Int64, Uint64, Float16, Float32, Float64, Bfloat16, Float8e4m3, e5m2 */
    static const uint8_t element_size[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    if (type < 0 || (size_t)type >= sizeof element_size)
        return 0;
    return (uint64_t)count * element_size[type];
}

static void nccl_finish(struct sample *sample, ncclResult_t result) {
    if (nccl_group_depth == 0) {
        sample_end(sample, result);
        return;
    }
    sample->flags |= FLARE_RECORD_GROUPED;
    sample->result = result;
    if (group_deferred_count < GROUP_DEFERRED) {
        group_deferred[group_deferred_count++] = *sample;
        return;
    }
    release_events(sample);
    count_drop();
}

#define NCCL_HOOK(api, real_symbol_var, fn_type, stream, bytes_expr, call_args)             \
    fn_type real = (fn_type)resolve(&real_symbol_var);                                       \
    if (UNLIKELY(real == NULL))                                                              \
        return missing_symbol(NCCL_SYSTEM_ERROR);                                            \
    struct sample sample;                                                                    \
    if (LIKELY(!take_sample(&nccl_calls_left, 1)) || !sample_begin(&sample, api, stream, 1)) \
        return real call_args;                                                               \
    sample.bytes = (bytes_expr);                                                             \
    ncclResult_t result = real call_args;                                                    \
    nccl_finish(&sample, result);                                                            \
    return result;

EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    NCCL_HOOK(FLARE_API_NCCL_ALL_REDUCE, real_nccl_all_reduce, nccl_reduce_like_fn, stream,
              nccl_bytes(count, datatype), (sendbuff, recvbuff, count, datatype, op, comm, stream))
}

EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                  ncclComm_t comm, cudaStream_t stream) {
    NCCL_HOOK(FLARE_API_NCCL_ALL_GATHER, real_nccl_all_gather, nccl_all_gather_fn, stream,
              nccl_bytes(sendcount, datatype), (sendbuff, recvbuff, sendcount, datatype, comm, stream))
}

/* The input of a reduce-scatter is recvcount elements from every rank. */
static uint64_t reduce_scatter_bytes(size_t recvcount, ncclDataType_t datatype, ncclComm_t comm) {
    nccl_comm_count_fn comm_count = (nccl_comm_count_fn)resolve(&real_nccl_comm_count);
    int ranks = 1;
    if (comm_count == NULL || comm_count(comm, &ranks) != 0 || ranks < 1)
        ranks = 1;
    return nccl_bytes(recvcount, datatype) * (uint64_t)ranks;
}

EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
    NCCL_HOOK(FLARE_API_NCCL_REDUCE_SCATTER, real_nccl_reduce_scatter, nccl_reduce_like_fn, stream,
              reduce_scatter_bytes(recvcount, datatype, comm),
              (sendbuff, recvbuff, recvcount, datatype, op, comm, stream))
}

EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, cudaStream_t stream) {
    NCCL_HOOK(FLARE_API_NCCL_BROADCAST, real_nccl_broadcast, nccl_broadcast_fn, stream,
              nccl_bytes(count, datatype), (sendbuff, recvbuff, count, datatype, root, comm, stream))
}

EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    NCCL_HOOK(FLARE_API_NCCL_REDUCE, real_nccl_reduce, nccl_reduce_fn, stream, nccl_bytes(count, datatype),
              (sendbuff, recvbuff, count, datatype, op, root, comm, stream))
}

EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                             ncclComm_t comm, cudaStream_t stream) {
    NCCL_HOOK(FLARE_API_NCCL_SEND, real_nccl_send, nccl_send_fn, stream, nccl_bytes(count, datatype),
              (sendbuff, count, datatype, peer, comm, stream))
}

EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
    NCCL_HOOK(FLARE_API_NCCL_RECV, real_nccl_recv, nccl_recv_fn, stream, nccl_bytes(count, datatype),
              (recvbuff, count, datatype, peer, comm, stream))
}

EXPORT ncclResult_t ncclGroupStart(void) {
    nccl_group_fn real = (nccl_group_fn)resolve(&real_nccl_group_start);
    if (UNLIKELY(real == NULL))
        return missing_symbol(NCCL_SYSTEM_ERROR);
    ncclResult_t result = real();
    if (result == 0)
        nccl_group_depth++;
    return result;
}

EXPORT ncclResult_t ncclGroupEnd(void) {
    nccl_group_fn real = (nccl_group_fn)resolve(&real_nccl_group_end);
    if (UNLIKELY(real == NULL))
        return missing_symbol(NCCL_SYSTEM_ERROR);
    ncclResult_t result = real();
    if (nccl_group_depth > 0)
        nccl_group_depth--;
    if (nccl_group_depth == 0) {
        for (int index = 0; index < group_deferred_count; index++) {
            struct sample *sample = &group_deferred[index];
            sample_end(sample, sample->result != 0 ? sample->result : result);
        }
        group_deferred_count = 0;
    }
    return result;
}

/* Drives the fakes through whatever defines the CUDA/NCCL symbols first (the shim, when preloaded), and
 * prints what happened as JSON lines for tests/rank/test_native.py and benchmarks/native_launch.py.
 *
 *   launch_driver LIBDIR LIBS forward            every API once succeeding, once failing; arguments checked
 *   launch_driver LIBDIR LIBS threads T N        64 launches, then T threads x N kernel launches (+ one
 *                                                allreduce in 16), all on distinct streams
 *   launch_driver LIBDIR LIBS bench N REPEATS    ns per cudaLaunchKernel, REPEATS times
 *
 * LIBS names the fakes to load from LIBDIR, comma-separated: cudart, cuda, nccl; "cudart-local" loads
 * the runtime with RTLD_LOCAL, out of the global scope (as a dependency of a dlopen'ed extension is).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../flare_ring.h"
#include "fakes.h"


typedef int (*cuda_launch_kernel_fn)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*cuda_launch_kernel_exc_fn)(const cuda_launch_config *, const void *, void **);
typedef int (*cu_launch_kernel_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   void *, void **, void **);
typedef int (*cu_launch_kernel_ex_fn)(const cu_launch_config *, void *, void **, void **);
typedef int (*reduce_like_fn)(const void *, void *, size_t, int, int, void *, void *);
typedef int (*all_gather_fn)(const void *, void *, size_t, int, void *, void *);
typedef int (*broadcast_fn)(const void *, void *, size_t, int, int, void *, void *);
typedef int (*reduce_fn)(const void *, void *, size_t, int, int, int, void *, void *);
typedef int (*send_fn)(const void *, size_t, int, int, void *, void *);
typedef int (*recv_fn)(void *, size_t, int, int, void *, void *);
typedef int (*no_args_fn)(void);
typedef int (*flush_fn)(int);

static void *handles[3]; /* cudart, cuda, nccl: NULL when not loaded */

static struct {
    cuda_launch_kernel_fn cuda_launch_kernel;
    cuda_launch_kernel_exc_fn cuda_launch_kernel_exc;
    cu_launch_kernel_fn cu_launch_kernel;
    cu_launch_kernel_ex_fn cu_launch_kernel_ex;
    reduce_like_fn all_reduce, reduce_scatter;
    all_gather_fn all_gather;
    broadcast_fn broadcast;
    reduce_fn reduce;
    send_fn send;
    recv_fn recv;
    no_args_fn group_start, group_end, get_last_error;
    flush_fn flush;
} api;

/* The symbol as a program linked against the library would bind it: the global scope first (the shim,
 * when preloaded), else the library itself. */
static void *bind(int library, const char *name) {
    void *address = dlsym(RTLD_DEFAULT, name);
    if (address == NULL && handles[library] != NULL)
        address = dlsym(handles[library], name);
    return address;
}

static void *fake(int library, const char *name) {
    return handles[library] ? dlsym(handles[library], name) : NULL;
}

#define BIND(field, library, name) \
    do { \
        void *address = bind(library, name); \
        memcpy(&api.field, &address, sizeof address); \
    } while (0)

static void load(const char *directory, const char *libraries) {
    static const char *names[3] = {"cudart", "cuda", "nccl"};
    for (int library = 0; library < 3; library++) {
        char local[32];
        snprintf(local, sizeof local, "%s-local", names[library]);
        int flags = RTLD_NOW | RTLD_GLOBAL;
        char list[256];
        snprintf(list, sizeof list, ",%s,", libraries);
        char wanted[40];
        snprintf(wanted, sizeof wanted, ",%s,", names[library]);
        char wanted_local[48];
        snprintf(wanted_local, sizeof wanted_local, ",%s,", local);
        if (strstr(list, wanted_local))
            flags = RTLD_NOW | RTLD_LOCAL;
        else if (!strstr(list, wanted))
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/lib%s.so", directory, names[library]);
        handles[library] = dlopen(path, flags);
        if (handles[library] == NULL) {
            fprintf(stderr, "launch_driver: %s\n", dlerror());
            exit(2);
        }
    }
    if (handles[0]) {
        BIND(cuda_launch_kernel, 0, "cudaLaunchKernel");
        BIND(cuda_launch_kernel_exc, 0, "cudaLaunchKernelExC");
        BIND(get_last_error, 0, "cudaGetLastError");
    }
    if (handles[1]) {
        BIND(cu_launch_kernel, 1, "cuLaunchKernel");
        BIND(cu_launch_kernel_ex, 1, "cuLaunchKernelEx");
    }
    if (handles[2]) {
        BIND(all_reduce, 2, "ncclAllReduce");
        BIND(all_gather, 2, "ncclAllGather");
        BIND(reduce_scatter, 2, "ncclReduceScatter");
        BIND(broadcast, 2, "ncclBroadcast");
        BIND(reduce, 2, "ncclReduce");
        BIND(send, 2, "ncclSend");
        BIND(recv, 2, "ncclRecv");
        BIND(group_start, 2, "ncclGroupStart");
        BIND(group_end, 2, "ncclGroupEnd");
    }
    void *flush = dlsym(RTLD_DEFAULT, "flare_hooks_flush");
    memcpy(&api.flush, &flush, sizeof flush);
}

static void set_result(int library, const char *setter, int result) {
    void *address = fake(library, setter);
    fake_set_result_fn set;
    memcpy(&set, &address, sizeof address);
    set(result);
}

static const struct fake_launch *last_launch(int library) {
    void *address = fake(library, library == 0 ? "fake_cudart_last_launch" : "fake_cuda_last_launch");
    fake_last_launch_fn last;
    memcpy(&last, &address, sizeof address);
    return last();
}

static const struct fake_nccl_call *last_nccl_call(void) {
    void *address = fake(2, "fake_nccl_last_call");
    fake_last_nccl_call_fn last;
    memcpy(&last, &address, sizeof address);
    return last();
}

static uint64_t fake_count(int library, const char *name) {
    void *address = fake(library, name);
    if (address == NULL)
        return 0;
    fake_count_fn count;
    memcpy(&count, &address, sizeof address);
    return count();
}

#define FUNC ((const void *)0x1110)
#define ARGS ((void **)0x2220)
#define EXTRA ((void **)0x2330)
#define STREAM ((void *)0x3330)
#define SEND_BUFFER ((const void *)0x4440)
#define RECV_BUFFER ((void *)0x5550)
#define COMM ((void *)0x6660)
#define NCCL_STREAM ((void *)0x7770)
#define COUNT 1000
#define FLOAT32 7
#define SUM 0
#define PEER 3

static int launch_matches(const struct fake_launch *seen, const void *config) {
    return seen->function == FUNC && seen->grid[0] == 2 && seen->grid[1] == 3 && seen->grid[2] == 4 &&
           seen->block[0] == 5 && seen->block[1] == 6 && seen->block[2] == 7 && seen->shared_mem == 99 &&
           seen->stream == STREAM && seen->args == ARGS && seen->config == config;
}

static int kernel_call(int which, int *args_match) {
    dim3 grid = {2, 3, 4}, block = {5, 6, 7};
    cuda_launch_config runtime_config = {grid, block, 99, STREAM, NULL, 0};
    cu_launch_config driver_config = {2, 3, 4, 5, 6, 7, 99, STREAM, NULL, 0};
    int result = 0;
    switch (which) {
    case FLARE_API_CUDA_LAUNCH_KERNEL:
        result = api.cuda_launch_kernel(FUNC, grid, block, ARGS, 99, STREAM);
        *args_match = launch_matches(last_launch(0), NULL);
        break;
    case FLARE_API_CUDA_LAUNCH_KERNEL_EXC:
        result = api.cuda_launch_kernel_exc(&runtime_config, FUNC, ARGS);
        *args_match = launch_matches(last_launch(0), &runtime_config);
        break;
    case FLARE_API_CU_LAUNCH_KERNEL:
        result = api.cu_launch_kernel((void *)FUNC, 2, 3, 4, 5, 6, 7, 99, STREAM, ARGS, EXTRA);
        *args_match = launch_matches(last_launch(1), NULL) && last_launch(1)->extra == EXTRA;
        break;
    default:
        result = api.cu_launch_kernel_ex(&driver_config, (void *)FUNC, ARGS, EXTRA);
        *args_match = launch_matches(last_launch(1), &driver_config) && last_launch(1)->extra == EXTRA;
        break;
    }
    return result;
}

static int nccl_call(int which, int *args_match) {
    int result = 0, op = SUM, root_or_peer = 0;
    const void *send = SEND_BUFFER;
    void *recv = RECV_BUFFER;
    switch (which) {
    case FLARE_API_NCCL_ALL_REDUCE:
        result = api.all_reduce(SEND_BUFFER, RECV_BUFFER, COUNT, FLOAT32, SUM, COMM, NCCL_STREAM);
        break;
    case FLARE_API_NCCL_ALL_GATHER:
        result = api.all_gather(SEND_BUFFER, RECV_BUFFER, COUNT, FLOAT32, COMM, NCCL_STREAM);
        op = 0;
        break;
    case FLARE_API_NCCL_REDUCE_SCATTER:
        result = api.reduce_scatter(SEND_BUFFER, RECV_BUFFER, COUNT, FLOAT32, SUM, COMM, NCCL_STREAM);
        break;
    case FLARE_API_NCCL_BROADCAST:
        result = api.broadcast(SEND_BUFFER, RECV_BUFFER, COUNT, FLOAT32, PEER, COMM, NCCL_STREAM);
        root_or_peer = PEER;
        break;
    case FLARE_API_NCCL_REDUCE:
        result = api.reduce(SEND_BUFFER, RECV_BUFFER, COUNT, FLOAT32, SUM, PEER, COMM, NCCL_STREAM);
        root_or_peer = PEER;
        break;
    case FLARE_API_NCCL_SEND:
        result = api.send(SEND_BUFFER, COUNT, FLOAT32, PEER, COMM, NCCL_STREAM);
        root_or_peer = PEER;
        recv = NULL;
        break;
    default:
        result = api.recv(RECV_BUFFER, COUNT, FLOAT32, PEER, COMM, NCCL_STREAM);
        root_or_peer = PEER;
        send = NULL;
        break;
    }
    const struct fake_nccl_call *seen = last_nccl_call();
    *args_match = seen->api == which && seen->sendbuff == send && seen->recvbuff == recv && seen->count == COUNT &&
                  seen->datatype == FLOAT32 && seen->op == op && seen->root_or_peer == root_or_peer &&
                  seen->comm == COMM && seen->stream == NCCL_STREAM;
    return result;
}

static const char *api_name(int which) {
    switch (which) {
    case FLARE_API_CUDA_LAUNCH_KERNEL: return "cudaLaunchKernel";
    case FLARE_API_CUDA_LAUNCH_KERNEL_EXC: return "cudaLaunchKernelExC";
    case FLARE_API_CU_LAUNCH_KERNEL: return "cuLaunchKernel";
    case FLARE_API_CU_LAUNCH_KERNEL_EX: return "cuLaunchKernelEx";
    case FLARE_API_NCCL_ALL_REDUCE: return "ncclAllReduce";
    case FLARE_API_NCCL_ALL_GATHER: return "ncclAllGather";
    case FLARE_API_NCCL_REDUCE_SCATTER: return "ncclReduceScatter";
    case FLARE_API_NCCL_BROADCAST: return "ncclBroadcast";
    case FLARE_API_NCCL_REDUCE: return "ncclReduce";
    case FLARE_API_NCCL_SEND: return "ncclSend";
    default: return "ncclRecv";
    }
}

/* Success, then a failure the fake returns, for every API whose library is loaded. */
static void forward(void) {
    static const int kernels[] = {FLARE_API_CUDA_LAUNCH_KERNEL, FLARE_API_CUDA_LAUNCH_KERNEL_EXC,
                                  FLARE_API_CU_LAUNCH_KERNEL, FLARE_API_CU_LAUNCH_KERNEL_EX};
    static const int collectives[] = {FLARE_API_NCCL_ALL_REDUCE, FLARE_API_NCCL_ALL_GATHER,
                                      FLARE_API_NCCL_REDUCE_SCATTER, FLARE_API_NCCL_BROADCAST,
                                      FLARE_API_NCCL_REDUCE, FLARE_API_NCCL_SEND, FLARE_API_NCCL_RECV};
    if (handles[2])
        set_result(2, "fake_nccl_set_ranks", 4);
    for (size_t index = 0; index < 11; index++) {
        int which = index < 4 ? kernels[index] : collectives[index - 4];
        int library = which == FLARE_API_CUDA_LAUNCH_KERNEL || which == FLARE_API_CUDA_LAUNCH_KERNEL_EXC ? 0
                      : which < 16                                                                     ? 1
                                                                                                       : 2;
        if (handles[library] == NULL)
            continue;
        const char *setter = library == 0   ? "fake_cudart_set_launch_result"
                             : library == 1 ? "fake_cuda_set_launch_result"
                                            : "fake_nccl_set_result";
        int error = library == 0 ? 98 : library == 1 ? 700 : 5; /* invalid device function, illegal address,
                                                                   ncclInvalidUsage */
        int ok_match = 0, error_match = 0;
        int ok = which < 16 ? kernel_call(which, &ok_match) : nccl_call(which, &ok_match);
        set_result(library, setter, error);
        int failed = which < 16 ? kernel_call(which, &error_match) : nccl_call(which, &error_match);
        set_result(library, setter, 0);
        if (library == 0)
            api.get_last_error(); /* the failed launch set it, as the real runtime does */
        printf("{\"api\": \"%s\", \"args_match\": %s, \"ok\": %d, \"error\": %d, \"expected_error\": %d}\n",
               api_name(which), ok_match && error_match ? "true" : "false", ok, failed, error);
    }
    if (handles[2]) {
        int match = 0;
        int start = api.group_start();
        int first = nccl_call(FLARE_API_NCCL_ALL_REDUCE, &match);
        int second = nccl_call(FLARE_API_NCCL_SEND, &match);
        int end = api.group_end();
        printf("{\"api\": \"group\", \"results\": [%d, %d, %d, %d]}\n", start, first, second, end);
    }
    if (handles[0]) {
        /* a failing event record inside the shim must not show in the caller's cudaGetLastError */
        set_result(0, "fake_cudart_set_event_record_result", 999);
        int match = 0;
        int launched = kernel_call(FLARE_API_CUDA_LAUNCH_KERNEL, &match);
        int last_error = api.get_last_error();
        set_result(0, "fake_cudart_set_event_record_result", 0);
        printf("{\"api\": \"last_error\", \"launch\": %d, \"last_error\": %d}\n", launched, last_error);
    }
}

struct worker {
    pthread_t thread;
    uint64_t index;
    long iterations;
    pthread_barrier_t *start;
};

static void *work(void *argument) {
    struct worker *worker = argument;
    dim3 grid = {1, 1, 1}, block = {32, 1, 1};
    pthread_barrier_wait(worker->start);
    for (long iteration = 0; iteration < worker->iterations; iteration++) {
        /* the stream names the launch: thread in the high half, iteration + 1 in the low bits */
        void *stream = (void *)(uintptr_t)(((worker->index + 1) << 32) | (uint64_t)(iteration + 1));
        cuda_launch_config runtime_config = {grid, block, 0, stream, NULL, 0};
        cu_launch_config driver_config = {1, 1, 1, 32, 1, 1, 0, stream, NULL, 0};
        switch (iteration % 4) {
        case 0: api.cuda_launch_kernel(FUNC, grid, block, ARGS, 0, stream); break;
        case 1: api.cuda_launch_kernel_exc(&runtime_config, FUNC, ARGS); break;
        case 2: api.cu_launch_kernel((void *)FUNC, 1, 1, 1, 32, 1, 1, 0, stream, ARGS, NULL); break;
        default: api.cu_launch_kernel_ex(&driver_config, (void *)FUNC, ARGS, NULL); break;
        }
        if (iteration % 16 == 15) {
            void *nccl_stream = (void *)((uintptr_t)stream | (1u << 31));
            api.all_reduce(SEND_BUFFER, RECV_BUFFER, 256, FLOAT32, SUM, COMM, nccl_stream);
        }
    }
    return NULL;
}

#define WARM_UP_LAUNCHES 64

static void threads(int count, long iterations) {
    /* The first sampled call sets up the shim's events; samples that other threads take meanwhile are
     * dropped, not waited for. Warm up on this thread (thread 0 in the stream numbering) first. */
    dim3 grid = {1, 1, 1}, block = {32, 1, 1};
    for (long launch = 0; launch < WARM_UP_LAUNCHES; launch++)
        api.cuda_launch_kernel(FUNC, grid, block, ARGS, 0, (void *)(uintptr_t)(launch + 1));
    struct worker *workers = calloc((size_t)count, sizeof *workers);
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)count);
    for (int index = 0; index < count; index++) {
        workers[index] = (struct worker){0, (uint64_t)index, iterations, &start};
        pthread_create(&workers[index].thread, NULL, work, &workers[index]);
    }
    for (int index = 0; index < count; index++)
        pthread_join(workers[index].thread, NULL);
    printf("{\"threads\": %d, \"iterations\": %ld, \"runtime_launches\": %llu, \"driver_launches\": %llu, "
           "\"nccl_calls\": %llu}\n",
           count, iterations, (unsigned long long)fake_count(0, "fake_cudart_launches"),
           (unsigned long long)fake_count(1, "fake_cuda_launches"),
           (unsigned long long)fake_count(2, "fake_nccl_calls"));
    free(workers);
}

static double seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec / 1e9;
}

static void bench(long launches, int repeats) {
    dim3 grid = {1, 1, 1}, block = {32, 1, 1};
    printf("{\"ns_per_launch\": [");
    for (int repeat = 0; repeat < repeats; repeat++) {
        double started = seconds();
        for (long launch = 0; launch < launches; launch++)
            api.cuda_launch_kernel(FUNC, grid, block, ARGS, 0, STREAM);
        double elapsed = seconds() - started;
        printf("%s%.2f", repeat ? ", " : "", elapsed * 1e9 / (double)launches);
        if (api.flush != NULL)
            api.flush(10000); /* the next repeat starts with an idle resolver and a full event pool */
    }
    printf("]}\n");
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: launch_driver LIBDIR LIBS forward|threads T N|bench N REPEATS\n");
        return 2;
    }
    load(argv[1], argv[2]);
    const char *mode = argv[3];
    if (strcmp(mode, "forward") == 0)
        forward();
    else if (strcmp(mode, "threads") == 0 && argc == 6)
        threads(atoi(argv[4]), atol(argv[5]));
    else if (strcmp(mode, "bench") == 0 && argc == 6)
        bench(atol(argv[4]), atoi(argv[5]));
    else {
        fprintf(stderr, "launch_driver: unknown mode %s\n", mode);
        return 2;
    }
    int flushed = api.flush != NULL ? api.flush(10000) : 0;
    printf("{\"flush\": %d, \"shim\": %s}\n", flushed, api.flush != NULL ? "true" : "false");
    return flushed == 0 ? 0 : 1;
}

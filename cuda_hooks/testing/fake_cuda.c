/* A fake CUDA driver: cuLaunchKernel and cuLaunchKernelEx record their arguments and return a configurable
 * code. */
#include <stdatomic.h>
#include <stdint.h>

#include "fakes.h"

#define EXPORT __attribute__((visibility("default")))

static _Atomic int launch_result;
static _Atomic uint64_t launches;
static __thread struct fake_launch last_launch;

EXPORT void fake_cuda_set_launch_result(int result) { atomic_store(&launch_result, result); }
EXPORT const struct fake_launch *fake_cuda_last_launch(void) { return &last_launch; }
EXPORT uint64_t fake_cuda_launches(void) { return atomic_load(&launches); }

EXPORT int cuLaunchKernel(void *function, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                          unsigned int block_x, unsigned int block_y, unsigned int block_z, unsigned int shared_mem,
                          void *stream, void **params, void **extra) {
    struct fake_launch launch = {function, {grid_x, grid_y, grid_z}, {block_x, block_y, block_z}, shared_mem,
                                 stream,   params,                    extra,                    NULL};
    last_launch = launch;
    atomic_fetch_add_explicit(&launches, 1, memory_order_relaxed);
    return atomic_load_explicit(&launch_result, memory_order_relaxed);
}

EXPORT int cuLaunchKernelEx(const cu_launch_config *config, void *function, void **params, void **extra) {
    struct fake_launch launch = {function,
                                 {config->gridDimX, config->gridDimY, config->gridDimZ},
                                 {config->blockDimX, config->blockDimY, config->blockDimZ},
                                 config->sharedMemBytes,
                                 config->hStream,
                                 params,
                                 extra,
                                 config};
    last_launch = launch;
    atomic_fetch_add_explicit(&launches, 1, memory_order_relaxed);
    return atomic_load_explicit(&launch_result, memory_order_relaxed);
}

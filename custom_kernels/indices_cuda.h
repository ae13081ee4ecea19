// CUDA thread indices, prepended to the kernel source (the Metal twin must be, see indices_metal.h).
#define LANE (threadIdx.x % 32u)
#define WARP (threadIdx.x / 32u)
#define GROUP_X (blockIdx.x)
#define GROUP_Y (blockIdx.y)
#define THREAD_X (threadIdx.x)
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define NUM_GROUPS_X (gridDim.x)

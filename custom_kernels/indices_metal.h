// Metal thread indices. Prepended to the kernel *source* (not the header): MLX adds a
// Metal thread attribute to the kernel's signature only when its name appears in the source.
#define LANE (thread_index_in_simdgroup)
#define WARP (simdgroup_index_in_threadgroup)
#define GROUP_X (threadgroup_position_in_grid.x)
#define GROUP_Y (threadgroup_position_in_grid.y)
#define THREAD_X (thread_position_in_threadgroup.x)
#define SHARED threadgroup
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define NUM_GROUPS_X (threadgroups_per_grid.x)

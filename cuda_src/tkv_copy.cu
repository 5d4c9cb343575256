// tiered_kv copy kernels: paged GPU KV cache <-> host chunk layout, one family for every format.
//
// A layer group's paged cache is described by byte strides (block, position in block, head) and
// one base pointer per (layer, K/V); head_bytes bytes of each head are contiguous. The host side
// of a chunk is [L, K, T, row_bytes] with row_bytes = num_heads * head_bytes (MemoryLayoutDesc).
// A "job" is one chunk's slab of layers [layer_begin, layer_end) of one group, at `host`
// (mapped pinned host memory, or a GPU staging buffer holding the same bytes), token rows
// [t_begin, num_tokens) of it. Gather reads every such row; scatter writes only those rows, so
// the rows before t_begin (skip_prefix_tokens) are never touched on the GPU.
//
// Each warp copies one row at a time with vectors of V (16/8/4/2/1 bytes: the widest that divides
// head_bytes, every stride and every base address), loading TKV_UNROLL vectors per lane before
// storing them, so enough bytes are in flight to cover PCIe latency on the mapped path.
// Compiled at run time by NVRTC (tiered_kv/gpu/kernels.py); no headers needed.

#define TKV_MAX_JOBS 32
#define TKV_UNROLL 4

struct TkvJob {
    unsigned long long host;  // row (layer_begin, k=0, t=0) of this job's slab
    int token_start;          // request position of the chunk's token 0
    int t_begin;              // first token row copied (>= 0); rows before it are skipped
    int num_tokens;           // T of the chunk: rows per (layer, k) in the host slab
    int layer_begin;
    int layer_end;
    int pad;
};

struct TkvParams {
    const unsigned long long* layer_ptrs;  // [num_layers * kv_count] paged base addresses
    const int* block_ids;                  // request block table: position p lives in
                                           // block_ids[p / block_size]
    long long block_stride;                // bytes
    long long pos_stride;                  // bytes
    long long head_stride;                 // bytes
    int kv_count;
    int num_heads;
    int head_bytes;
    int block_size;
    int num_jobs;
    int pad;
    TkvJob jobs[TKV_MAX_JOBS];
};

template <typename V, bool TO_HOST>
__device__ __forceinline__ void tkv_copy_rows(const TkvParams& p) {
    const TkvJob& job = p.jobs[blockIdx.y];
    const int rows_per_lk = job.num_tokens - job.t_begin;
    if (rows_per_lk <= 0) return;
    const long long rows = (long long)(job.layer_end - job.layer_begin) * p.kv_count * rows_per_lk;
    const int vec_per_head = p.head_bytes / (int)sizeof(V);
    const int vec_per_row = vec_per_head * p.num_heads;
    const long long row_bytes = (long long)p.head_bytes * p.num_heads;
    const int warps = blockDim.x >> 5;
    const int lane = threadIdx.x & 31;
    for (long long row = (long long)blockIdx.x * warps + (threadIdx.x >> 5); row < rows;
         row += (long long)gridDim.x * warps) {
        const int t = job.t_begin + (int)(row % rows_per_lk);
        const long long lk = row / rows_per_lk;  // (layer - layer_begin) * kv_count + k
        const int k = (int)(lk % p.kv_count);
        const int layer = job.layer_begin + (int)(lk / p.kv_count);
        const int pos = job.token_start + t;
        const long long block = p.block_ids[pos / p.block_size];
        char* paged = (char*)p.layer_ptrs[layer * p.kv_count + k] + block * p.block_stride +
                      (long long)(pos % p.block_size) * p.pos_stride;
        V* host = (V*)((char*)job.host + (lk * job.num_tokens + t) * row_bytes);
        for (int base = lane; base < vec_per_row; base += 32 * TKV_UNROLL) {
            V buf[TKV_UNROLL];
#pragma unroll
            for (int u = 0; u < TKV_UNROLL; ++u) {
                const int v = base + u * 32;
                if (v < vec_per_row) {
                    const int h = v / vec_per_head;
                    const V* src_paged =
                        (const V*)(paged + h * p.head_stride) + (v - h * vec_per_head);
                    buf[u] = TO_HOST ? *src_paged : host[v];
                }
            }
#pragma unroll
            for (int u = 0; u < TKV_UNROLL; ++u) {
                const int v = base + u * 32;
                if (v < vec_per_row) {
                    if (TO_HOST) {
                        host[v] = buf[u];
                    } else {
                        const int h = v / vec_per_head;
                        *((V*)(paged + h * p.head_stride) + (v - h * vec_per_head)) = buf[u];
                    }
                }
            }
        }
    }
}

#define TKV_INSTANTIATE(WIDTH, VTYPE)                                                       \
    extern "C" __global__ void __launch_bounds__(512) tkv_gather_w##WIDTH(const TkvParams p) { \
        tkv_copy_rows<VTYPE, true>(p);                                                      \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(512) tkv_scatter_w##WIDTH(const TkvParams p) { \
        tkv_copy_rows<VTYPE, false>(p);                                                     \
    }

TKV_INSTANTIATE(16, uint4)
TKV_INSTANTIATE(8, uint2)
TKV_INSTANTIATE(4, unsigned int)
TKV_INSTANTIATE(2, unsigned short)
TKV_INSTANTIATE(1, unsigned char)

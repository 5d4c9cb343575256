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
// Copies use vectors of V (16/8/4/2/1 bytes: the widest that divides head_bytes, every stride and
// every base address), TKV_UNROLL loads in flight per thread before the stores, so enough bytes
// are in flight to cover PCIe latency on the mapped path.
// Compiled at run time by NVRTC (tiered_kv/gpu/kernels.py); no headers needed.

#define TKV_MAX_JOBS 32
#define TKV_INLINE_IDS 640
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
    const int* block_ids;                  // request block table on the device: position p
                                           // lives in block_ids[p / block_size]; null: in
                                           // inline_ids[p / block_size - ids_base]
    long long block_stride;                // bytes
    long long pos_stride;                  // bytes
    long long head_stride;                 // bytes
    int kv_count;
    int num_heads;
    int head_bytes;
    int block_size;
    int num_jobs;
    int ids_base;  // request block index of inline_ids[0]
    TkvJob jobs[TKV_MAX_JOBS];
    int inline_ids[TKV_INLINE_IDS];  // a call's block ids, when they fit: no upload before it
};

// Address of vector `idx` of a job (idx counts vectors row-major over (layer, k, token, vector)).
// 32-bit index math: the mover splits work so that a job has fewer than 2^31 vectors.
template <typename V>
__device__ __forceinline__ void tkv_address(const TkvParams& p, const TkvJob& job, unsigned idx,
                                            unsigned vec_per_row, unsigned vec_per_head,
                                            unsigned rows_per_lk, V** paged, V** host) {
    const unsigned row = idx / vec_per_row;
    const unsigned v = idx - row * vec_per_row;
    const unsigned lk = row / rows_per_lk;  // (layer - layer_begin) * kv_count + k
    const unsigned t = job.t_begin + (row - lk * rows_per_lk);
    const unsigned layer_off = lk / (unsigned)p.kv_count;
    const unsigned k = lk - layer_off * (unsigned)p.kv_count;
    const unsigned pos = (unsigned)job.token_start + t;
    const unsigned block_index = pos / (unsigned)p.block_size;
    const long long block = p.block_ids != nullptr ? p.block_ids[block_index]
                                                   : p.inline_ids[block_index - (unsigned)p.ids_base];
    const unsigned in_block = pos - block_index * (unsigned)p.block_size;
    const unsigned h = v / vec_per_head;
    const unsigned o = v - h * vec_per_head;
    char* base = (char*)p.layer_ptrs[(job.layer_begin + layer_off) * p.kv_count + k];
    *paged = (V*)(base + block * p.block_stride + (long long)in_block * p.pos_stride +
                  (long long)h * p.head_stride) + o;
    const long long host_row = (long long)lk * job.num_tokens + t;
    *host = (V*)((char*)job.host + host_row * ((long long)vec_per_row * sizeof(V))) + v;
}

// Every thread copies TKV_UNROLL vectors per step (all loads, then all stores), striding over the
// job's vectors, so rows of any length keep all lanes busy (132-byte rows are 33 4-byte vectors).
template <typename V, bool TO_HOST>
__device__ __forceinline__ void tkv_copy(const TkvParams& p) {
    const TkvJob& job = p.jobs[blockIdx.y];
    if (job.num_tokens <= job.t_begin) return;
    const unsigned rows_per_lk = (unsigned)(job.num_tokens - job.t_begin);
    const unsigned vec_per_head = (unsigned)p.head_bytes / (unsigned)sizeof(V);
    const unsigned vec_per_row = vec_per_head * (unsigned)p.num_heads;
    const unsigned total =
        (unsigned)(job.layer_end - job.layer_begin) * p.kv_count * rows_per_lk * vec_per_row;
    const unsigned stride = gridDim.x * blockDim.x;
    for (unsigned first = blockIdx.x * blockDim.x + threadIdx.x; first < total;
         first += stride * TKV_UNROLL) {
        V buf[TKV_UNROLL];
        V* paged[TKV_UNROLL];
        V* host[TKV_UNROLL];
#pragma unroll
        for (int u = 0; u < TKV_UNROLL; ++u) {
            const unsigned idx = first + u * stride;
            if (idx < total) {
                tkv_address<V>(p, job, idx, vec_per_row, vec_per_head, rows_per_lk, &paged[u],
                               &host[u]);
                buf[u] = TO_HOST ? __ldg(paged[u]) : *host[u];
            }
        }
#pragma unroll
        for (int u = 0; u < TKV_UNROLL; ++u) {
            const unsigned idx = first + u * stride;
            if (idx < total) {
                if (TO_HOST) {
                    *host[u] = buf[u];
                } else {
                    *paged[u] = buf[u];
                }
            }
        }
    }
}

#define TKV_INSTANTIATE(WIDTH, VTYPE)                                                       \
    extern "C" __global__ void __launch_bounds__(512) tkv_gather_w##WIDTH(const TkvParams p) { \
        tkv_copy<VTYPE, true>(p);                                                      \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(512) tkv_scatter_w##WIDTH(const TkvParams p) { \
        tkv_copy<VTYPE, false>(p);                                                     \
    }

TKV_INSTANTIATE(16, uint4)
TKV_INSTANTIATE(8, uint2)
TKV_INSTANTIATE(4, unsigned int)
TKV_INSTANTIATE(2, unsigned short)
TKV_INSTANTIATE(1, unsigned char)

// Paged KV gather/scatter: engine pages of every layer <-> contiguous layer-major kvtier blocks.
//
// Plain CUDA, no torch headers, so `nvcc -arch=sm_90 -cubin csrc/paged_copy.cu` checks it
// on a machine without a GPU (tests/test_transfer.py does). csrc/paged_copy_torch.cu wraps
// kvtier_paged_copy() for torch; kvtier/transfer/kernels.py compiles both at run time.
//
// The unit of work is a chunk: one page's K (or V, or MLA latent+rope) of one layer,
// `chunk_bytes` contiguous bytes on both sides:
//
//   chunk c = ((b * layers + l) * parts + h) * pages_per_block + j
//   engine  = layer_ptrs[l] + table[b * pages_per_block + j] * page_stride + h * part_stride
//   block   = blocks + b * block_stride + l * layer_bytes + h * part_bytes + j * chunk_bytes
//
// The grid's unit of work is a piece: 32 x UNROLL words of one chunk, copied by one warp
// (grid-stride over pieces). Each lane loads its UNROLL words before it stores any, so a
// warp keeps UNROLL coalesced 512-byte requests in flight (speed: one dependent load at a
// time left HBM mostly idle); pieces rather than whole chunks keep every SM busy whether a
// page part is 4 KiB or 256 KiB. VEC is the widest of 16/8/4/2/1 bytes that divides every
// pointer, stride and size (the host picks it), so loads are 16-byte vectors whenever
// alignment allows.
#include <cstdint>
#include <cuda_runtime.h>

namespace {

template <int VEC> struct Word;
template <> struct Word<16> { using T = uint4; };
template <> struct Word<8> { using T = uint2; };
template <> struct Word<4> { using T = uint32_t; };
template <> struct Word<2> { using T = uint16_t; };
template <> struct Word<1> { using T = uint8_t; };

struct Geometry {
  int64_t n_chunks;
  int64_t layers, parts, pages_per_block;
  int64_t chunk_bytes;   // bytes of one page's part (page_tokens * heads * head_dim * itemsize)
  int64_t page_stride;   // bytes between consecutive pages in an engine layer tensor
  int64_t part_stride;   // bytes between K and V of one page (0 for MLA)
  int64_t block_stride;  // bytes between consecutive blocks in `blocks`
  int64_t layer_bytes;   // bytes of one layer inside a block
  int64_t part_bytes;    // bytes of K (or V) of one layer inside a block
};

constexpr int UNROLL = 4;
constexpr int WARPS_PER_BLOCK = 8;

template <int VEC>
__global__ void paged_copy_kernel(const uint64_t* __restrict__ layer_ptrs,
                                  const int64_t* __restrict__ table,
                                  uint8_t* __restrict__ blocks, Geometry g, bool to_blocks) {
  using W = typename Word<VEC>::T;
  const int64_t words = g.chunk_bytes / VEC;
  const int64_t piece_words = 32 * UNROLL;
  const int64_t pieces = (words + piece_words - 1) / piece_words;
  const int64_t units = g.n_chunks * pieces;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * WARPS_PER_BLOCK;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * WARPS_PER_BLOCK + (threadIdx.x >> 5); u < units; u += warps) {
    const int64_t c = u / pieces;
    const int64_t p = u - c * pieces;
    int64_t t = c;
    const int64_t j = t % g.pages_per_block; t /= g.pages_per_block;
    const int64_t h = t % g.parts;           t /= g.parts;
    const int64_t l = t % g.layers;
    const int64_t b = t / g.layers;
    const int64_t page = table[b * g.pages_per_block + j];
    uint8_t* engine = reinterpret_cast<uint8_t*>(layer_ptrs[l]) + page * g.page_stride + h * g.part_stride;
    uint8_t* block = blocks + b * g.block_stride + l * g.layer_bytes + h * g.part_bytes + j * g.chunk_bytes;
    const W* src = reinterpret_cast<const W*>(to_blocks ? engine : block);
    W* dst = reinterpret_cast<W*>(to_blocks ? block : engine);
    const int64_t first = p * piece_words + lane;
    W r[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int64_t i = first + k * 32;
      if (i < words) r[k] = src[i];
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const int64_t i = first + k * 32;
      if (i < words) dst[i] = r[k];
    }
  }
}

template <int VEC>
cudaError_t launch(const uint64_t* layer_ptrs, const int64_t* table, uint8_t* blocks,
                   const Geometry& g, bool to_blocks, cudaStream_t stream) {
  const int64_t piece_words = 32 * UNROLL;
  const int64_t units = g.n_chunks * ((g.chunk_bytes / VEC + piece_words - 1) / piece_words);
  // One warp per piece; past 8192 blocks (64K warps, far more than an H100 holds at once)
  // warps loop over pieces instead.
  int64_t grid = (units + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
  grid = grid < 8192 ? grid : 8192;
  paged_copy_kernel<VEC><<<static_cast<unsigned>(grid), WARPS_PER_BLOCK * 32, 0, stream>>>(layer_ptrs, table,
                                                                                        blocks, g, to_blocks);
  return cudaGetLastError();
}

}  // namespace

// Copy n_blocks blocks between engine pages and `blocks` in one launch on `stream`.
// layer_ptrs and table are device arrays; vec is 16, 8, 4, 2 or 1 (see above).
// Returns a cudaError_t (0 on success).
int kvtier_paged_copy(const uint64_t* layer_ptrs, const int64_t* table, uint8_t* blocks,
                      int64_t n_blocks, int64_t layers, int64_t parts, int64_t pages_per_block,
                      int64_t chunk_bytes, int64_t page_stride, int64_t part_stride,
                      int64_t block_stride, int64_t layer_bytes, int64_t part_bytes,
                      bool to_blocks, int vec, cudaStream_t stream) {
  Geometry g{n_blocks * layers * parts * pages_per_block, layers, parts, pages_per_block, chunk_bytes,
             page_stride, part_stride, block_stride, layer_bytes, part_bytes};
  if (g.n_chunks == 0) return 0;
  switch (vec) {
    case 16: return launch<16>(layer_ptrs, table, blocks, g, to_blocks, stream);
    case 8: return launch<8>(layer_ptrs, table, blocks, g, to_blocks, stream);
    case 4: return launch<4>(layer_ptrs, table, blocks, g, to_blocks, stream);
    case 2: return launch<2>(layer_ptrs, table, blocks, g, to_blocks, stream);
    case 1: return launch<1>(layer_ptrs, table, blocks, g, to_blocks, stream);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

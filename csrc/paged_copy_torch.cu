// torch binding of csrc/paged_copy.cu: launches on the current CUDA stream.
// kvtier/transfer/kernels.py concatenates the two files and builds them with
// torch.utils.cpp_extension.load_inline on the first use on a GPU.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

void paged_copy(torch::Tensor layer_ptrs, torch::Tensor table, torch::Tensor blocks,
                int64_t layers, int64_t parts, int64_t pages_per_block, int64_t chunk_bytes,
                int64_t page_stride, int64_t part_stride, int64_t layer_bytes, int64_t part_bytes,
                bool to_blocks, int64_t vec) {
  TORCH_CHECK(blocks.is_cuda() && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
                  blocks.stride(1) == 1, "blocks must be a CUDA uint8 [n, bytes] tensor with contiguous rows");
  TORCH_CHECK(table.is_cuda() && table.scalar_type() == torch::kInt64 && table.is_contiguous(),
              "table must be a contiguous CUDA int64 tensor");
  TORCH_CHECK(layer_ptrs.is_cuda() && layer_ptrs.scalar_type() == torch::kInt64 && layer_ptrs.is_contiguous(),
              "layer_ptrs must be a contiguous CUDA int64 tensor");
  const c10::cuda::CUDAGuard guard(blocks.device());
  int err = kvtier_paged_copy(reinterpret_cast<const uint64_t*>(layer_ptrs.data_ptr<int64_t>()),
                              table.data_ptr<int64_t>(), blocks.data_ptr<uint8_t>(), blocks.size(0), layers,
                              parts, pages_per_block, chunk_bytes, page_stride, part_stride, blocks.stride(0),
                              layer_bytes, part_bytes, to_blocks, static_cast<int>(vec),
                              c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "kvtier paged copy launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// height rows of `width` bytes: dst + dst_offset + r * dpitch <- src + src_offset + r * spitch,
// one cudaMemcpy2DAsync on the current stream (host <-> device or within a device). Moves
// one layer of many layer-major blocks in one DMA, without packing it on the CPU first.
void copy_2d(torch::Tensor dst, int64_t dst_offset, int64_t dpitch, torch::Tensor src, int64_t src_offset,
             int64_t spitch, int64_t width, int64_t height) {
  TORCH_CHECK(dst.scalar_type() == torch::kUInt8 && src.scalar_type() == torch::kUInt8 && dst.is_contiguous() &&
                  src.is_contiguous(), "copy_2d takes contiguous uint8 tensors");
  TORCH_CHECK(dst.is_cuda() || src.is_cuda(), "copy_2d needs a CUDA tensor on one side");
  TORCH_CHECK(width >= 0 && height >= 0 && dst_offset >= 0 && src_offset >= 0 && width <= dpitch &&
                  width <= spitch, "copy_2d: bad geometry");
  if (width == 0 || height == 0) return;
  TORCH_CHECK(dst_offset + (height - 1) * dpitch + width <= dst.numel() &&
                  src_offset + (height - 1) * spitch + width <= src.numel(), "copy_2d: range outside a tensor");
  const c10::cuda::CUDAGuard guard(dst.is_cuda() ? dst.device() : src.device());
  cudaError_t err = cudaMemcpy2DAsync(dst.data_ptr<uint8_t>() + dst_offset, dpitch, src.data_ptr<uint8_t>() + src_offset,
                                      spitch, width, height, cudaMemcpyDefault,
                                      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "kvtier copy_2d failed: ", cudaGetErrorString(err));
}

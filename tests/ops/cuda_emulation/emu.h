// Host emulation of the CUDA features csrc/cuda/syncbn.cu uses, so that its kernels and host
// code run on a CPU (tests/ops/test_cuda_emulated.py). Every CUDA thread of a block is a host
// thread; __syncthreads and the warp shuffles are barriers over a shared buffer. Blocks run
// one after another. Slow (a thread per CUDA thread) and for small inputs only; it checks the
// indexing, the reductions and the launch plans, not the GPU's timing or memory model.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define C10_CUDA_CHECK(x) (void)(x)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)

enum { cudaDevAttrMultiProcessorCount = 16 };
inline int cudaGetDevice(int* d) {
  *d = 0;
  return 0;
}
// Two SMs unless EMU_SMS says otherwise: small grids still get several chunks per channel.
inline int cudaDeviceGetAttribute(int* value, int, int) {
  const char* sms = std::getenv("EMU_SMS");
  *value = sms ? std::atoi(sms) : 2;
  return 0;
}
namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
inline int getCurrentCUDAStream() { return 0; }
}  // namespace c10::cuda

inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __fsqrt_rn(float v) { return std::sqrt(v); }
inline double __dsqrt_rn(double v) { return std::sqrt(v); }

namespace emu {
struct Block {
  std::unique_ptr<std::barrier<>> barrier;               // all threads of the block
  std::vector<std::unique_ptr<std::barrier<>>> warps;    // the 32 threads of each warp
  std::vector<unsigned char> lanes;                      // [warp][lane][8 bytes]
  std::atomic<int> any{0};                               // __syncthreads_or
};
inline Block* block = nullptr;
inline thread_local int linear = 0;  // threadIdx as one number
}  // namespace emu

inline void __syncthreads() { emu::block->barrier->arrive_and_wait(); }

inline int __syncthreads_or(int predicate) {
  __syncthreads();  // the previous call's reads are done
  if (predicate) emu::block->any = 1;
  __syncthreads();
  const int result = emu::block->any.load();
  __syncthreads();
  if (emu::linear == 0) emu::block->any = 0;  // before any thread's next first barrier
  return result;
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int offset) {
  static_assert(sizeof(T) <= 8);
  if (mask != 0xffffffffu) std::abort();  // the kernels only shuffle whole warps
  const int warp = emu::linear / 32, lane = emu::linear % 32;
  unsigned char* base = emu::block->lanes.data() + warp * 32 * 8;
  std::memcpy(base + lane * 8, &v, sizeof(T));
  emu::block->warps[warp]->arrive_and_wait();
  T r;
  std::memcpy(&r, base + (lane ^ offset) * 8, sizeof(T));
  emu::block->warps[warp]->arrive_and_wait();
  return r;
}

// kernel<<<grid, block, shared, stream>>>(args...) becomes emu_launch(kernel, grid, block,
// shared, stream, args...).
template <typename K, typename... Args>
void emu_launch(K kernel, dim3 grid, dim3 block, size_t, int, Args... args) {
  const unsigned threads = block.x * block.y * block.z;
  if (threads % 32 != 0 || threads > 1024) throw std::runtime_error("emu: invalid block");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    throw std::runtime_error("emu: invalid grid");
  }
  emu::Block b;
  b.barrier = std::make_unique<std::barrier<>>(threads);
  for (unsigned w = 0; w < threads / 32; ++w) {
    b.warps.push_back(std::make_unique<std::barrier<>>(32));
  }
  b.lanes.resize(threads * 8);
  emu::block = &b;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
    for (unsigned by = 0; by < grid.y; ++by) {
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::vector<std::thread> pool;
        pool.reserve(threads);
        for (unsigned t = 0; t < threads; ++t) {
          pool.emplace_back([=] {
            blockIdx = dim3(bx, by, bz);
            gridDim = grid;
            blockDim = block;
            threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            emu::linear = t;
            kernel(args...);
          });
        }
        for (auto& th : pool) th.join();
      }
    }
  }
}

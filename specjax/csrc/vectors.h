// 16-lane float32 vectors for specjax's CPU FFI kernels (rows_matmul.cc,
// paged_attention.cc): GCC/Clang lower the type to whatever the target has
// (-march=native).
//
// Loads and stores go through a `may_alias` pointer of the vector type, not memcpy:
// GCC 12 on a cascadelake (whose tuning prefers 256-bit vectors) compiled a 64-byte
// memcpy into two 256-bit moves into a stack slot and one 512-bit read back, a
// store-forwarding stall per vector that halved both kernels' speed
// (docs/benchmarks.md, "Few-row matmuls by hand").
#ifndef SPECJAX_CSRC_VECTORS_H_
#define SPECJAX_CSRC_VECTORS_H_

#include <cstdint>

namespace specjax {

typedef float vf __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int64_t kLanes = 16;

inline vf load(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }

}  // namespace specjax

#endif  // SPECJAX_CSRC_VECTORS_H_

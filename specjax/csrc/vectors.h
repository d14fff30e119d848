// float32 vectors of the target's native width for specjax's CPU FFI kernels
// (rows_matmul.cc, paged_attention.cc), and how many vector registers it has, so each
// kernel sizes its register blocks to fit (-march=native picks the branch).
//
// Native width, not one fixed 64-byte type: GCC lowers a vector type wider than the
// target's registers piecewise through the stack (on an AVX2-only AMD EPYC, znver3, a
// 64-byte type ran the few-row matmul at a quarter of XLA's rate: docs/benchmarks.md,
// "Few-row matmuls by hand").
//
// Loads and stores go through a `may_alias` pointer of the vector type, not memcpy:
// GCC 12 on a cascadelake (whose tuning prefers 256-bit vectors) compiled a 64-byte
// memcpy into two 256-bit moves into a stack slot and one 512-bit read back, a
// store-forwarding stall per vector that halved both kernels' speed.
#ifndef SPECJAX_CSRC_VECTORS_H_
#define SPECJAX_CSRC_VECTORS_H_

#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#if defined(__AVX512F__)
#define SPECJAX_VECTOR_BYTES 64
#define SPECJAX_VECTOR_REGISTERS 32
#elif defined(__AVX__)
#define SPECJAX_VECTOR_BYTES 32
#define SPECJAX_VECTOR_REGISTERS 16
#elif defined(__aarch64__)
#define SPECJAX_VECTOR_BYTES 16
#define SPECJAX_VECTOR_REGISTERS 32
#else  // SSE2 (every x86-64) and other 128-bit targets
#define SPECJAX_VECTOR_BYTES 16
#define SPECJAX_VECTOR_REGISTERS 16
#endif

namespace specjax {

typedef float vf __attribute__((vector_size(SPECJAX_VECTOR_BYTES), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(SPECJAX_VECTOR_BYTES), aligned(4)));
constexpr int64_t kLanes = SPECJAX_VECTOR_BYTES / sizeof(float);
constexpr int kRegisters = SPECJAX_VECTOR_REGISTERS;  // vector registers the target has

inline vf load(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }

// a * b + c rounded once, by the fused multiply-add instruction itself: left to the
// compiler's contraction of `c += a * b`, GCC fused it in some of a kernel's block
// shapes and not in others, so a row's result depended on the block it fell in.
inline vf fma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && SPECJAX_VECTOR_BYTES == 32
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
  return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else  // no fused multiply-add instruction: nothing to contract into
  return a * b + c;
#endif
}

// kLanes int8 values as float32 (exact). By intrinsics: GCC 12 lowers a
// __builtin_convertvector from int8 lanes to float32 ones one lane at a time.
inline vf widen_int8(const int8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__) && SPECJAX_VECTOR_BYTES == 32
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vf x;
  for (int64_t i = 0; i < kLanes; ++i) x[i] = p[i];
  return x;
#endif
}

// kLanes bfloat16 values (their bits) as float32: exact, the 16 bits above 16 zero bits.
typedef uint16_t vh __attribute__((vector_size(2 * kLanes), aligned(2), may_alias));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
inline vf widen_bf16(const uint16_t* p) {
  const vu bits = __builtin_convertvector(*reinterpret_cast<const vh*>(p), vu) << 16;
  vf x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// One bfloat16 value (its bits) as float32.
inline float widen_bf16(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// v kept in a register for the uses that follow: with no register free to spare,
// GCC folds a vector loaded once into every multiply-add that reads it as a memory
// operand, one load per use (a row of x read G times per step by the few-row
// products, where the loads, not the multiply-adds, then bound the step).
inline void in_register(vf& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__SSE__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

// Lane k of the result: lane `lo + k % (Seg / 2)` of segment k / (Seg / 2) of the pair
// (a's kLanes / Seg segments of Seg lanes, then b's), one halving step's lower halves.
constexpr int64_t halves_index(int64_t seg, int64_t k, int64_t lo) {
  const int64_t w = seg / 2, per = kLanes / seg, part = k / w;
  return (part < per ? 0 : kLanes) + part % per * seg + lo + k % w;
}

#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector
// One halving step over two vectors of segments of Seg lanes: each segment's lane l
// plus its lane l + Seg / 2, a's segments first, then b's.
template <int64_t Seg, size_t... K>
inline vf halve(vf a, vf b, std::index_sequence<K...>) {
  return __builtin_shufflevector(a, b, halves_index(Seg, K, 0)...) +
         __builtin_shufflevector(a, b, halves_index(Seg, K, Seg / 2)...);
}

// t[0, n) (n <= kLanes, segments of Seg lanes) halved down to t[0]: pairs of vectors,
// a zero one standing in past n.
template <int64_t Seg>
inline void halvings(vf* t, int64_t n) {
  if constexpr (Seg >= 2) {
    for (int64_t j = 0; 2 * j < n; ++j)
      t[j] = halve<Seg>(t[2 * j], 2 * j + 1 < n ? t[2 * j + 1] : vf{},
                        std::make_index_sequence<kLanes>());
    halvings<Seg / 2>(t, (n + 1) / 2);
  }
}

// sums[k] = the lanes of v[k] summed by halves (lane l plus lane l + kLanes / 2, then
// l + kLanes / 4, ..., l + 1: every vector the same order, that of one vector's scalar
// loop), for k < n: kLanes vectors at a time, halved together by shuffles and adds (one
// vector's lanes one at a time cost as much as a few rows' products).
inline void lanes_sums(const vf* v, int64_t n, float* sums) {
  for (int64_t k0 = 0; k0 < n; k0 += kLanes) {
    const int64_t m = n - k0 < kLanes ? n - k0 : kLanes;
    vf t[kLanes];
    for (int64_t k = 0; k < m; ++k) t[k] = v[k0 + k];
    halvings<kLanes>(t, m);
    for (int64_t k = 0; k < m; ++k) sums[k0 + k] = t[0][k];
  }
}
#else
inline void lanes_sums(const vf* v, int64_t n, float* sums) {
  for (int64_t k = 0; k < n; ++k) {
    float s[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) s[l] = v[k][l];
    for (int64_t w = kLanes / 2; w >= 1; w /= 2)
      for (int64_t l = 0; l < w; ++l) s[l] += s[l + w];
    sums[k] = s[0];
  }
}
#endif

}  // namespace specjax

#endif  // SPECJAX_CSRC_VECTORS_H_

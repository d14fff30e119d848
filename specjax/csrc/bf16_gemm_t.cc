// y[R, O] = x[R, I] @ wt[O, I]^T for bfloat16 rows and weights, summed in float32, for
// the many rows of a prompt's prefill, as an XLA FFI handler for the CPU backend
// (`specjax.bf16_gemm` builds and registers it; the CPU decode layout's bfloat16 weights
// are stored this way, `specjax.model.decode_params`).
//
// Why by hand: XLA:CPU has no bfloat16 matmul. Its float normalization converts both
// operands to float32 first, and for weights in a scan over layers it hoists that
// conversion out of the loop, so every prefill call converts the whole model's weights
// to float32 before it multiplies. Here the products read the bfloat16 bits as they lie:
// with AVX512-BF16 by its dot-product instruction (VDPBF16PS: pairs of bfloat16
// products added into float32 lanes), elsewhere by the same arithmetic on widened
// values (`dot_generic`), which XLA's own product beats (`specjax.bf16_gemm.applies`).
//
// The sum, the same on both paths and for every block shape: 16 float32 lanes, lane l
// adding, for each 32 values of I in order, x[2l+1] * w[2l+1] and then x[2l] * w[2l]
// (each product exact in float32, each addition rounded, as the instruction does);
// the lanes summed by halves; then the tail of I past the last 32 in order. Inputs and
// results below float32's normal range are flushed to zero by the instruction and not
// by the generic path: the two paths agree bit for bit on normal values only.
#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "layered.h"
#include "parallel_items.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPairs = 16;           // float32 lanes of a sum
constexpr int64_t kChunk = 2 * kPairs;   // values of I per step (one 64-byte vector)
constexpr int64_t kTile = 4;             // rows and outputs per register tile
constexpr int64_t kRowBytes = 256 << 10;  // rows' bytes per pass over a thread's weights

using specjax::widen_bf16;  // vectors.h: one value's bits as float32, exactly

// The lanes summed by halves, then I's tail [whole, in) in order: one output element.
inline float finish(float* s, const uint16_t* x, const uint16_t* w, int64_t whole,
                    int64_t in) {
  for (int64_t h = kPairs / 2; h >= 1; h /= 2)
    for (int64_t l = 0; l < h; ++l) s[l] += s[l + h];
  float sum = s[0];
  for (int64_t i = whole; i < in; ++i)
    sum = __builtin_fmaf(widen_bf16(x[i]), widen_bf16(w[i]), sum);
  return sum;
}

// One output element on widened values, in the instruction's order (exact products, so
// a fused multiply-add rounds as the instruction's addition does).
float dot_generic(const uint16_t* x, const uint16_t* w, int64_t in) {
  const int64_t whole = in / kChunk * kChunk;
  float acc[kPairs] = {};
  for (int64_t i = 0; i < whole; i += kChunk)
    for (int64_t l = 0; l < kPairs; ++l) {
      acc[l] = __builtin_fmaf(widen_bf16(x[i + 2 * l + 1]), widen_bf16(w[i + 2 * l + 1]), acc[l]);
      acc[l] = __builtin_fmaf(widen_bf16(x[i + 2 * l]), widen_bf16(w[i + 2 * l]), acc[l]);
    }
  return finish(acc, x, w, whole, in);
}

#if defined(__AVX512BF16__)
inline __m512bh load_bh(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

float dot_native(const uint16_t* x, const uint16_t* w, int64_t in) {
  const int64_t whole = in / kChunk * kChunk;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < whole; i += kChunk)
    acc = _mm512_dpbf16_ps(acc, load_bh(x + i), load_bh(w + i));
  float s[kPairs];
  _mm512_storeu_ps(s, acc);
  return finish(s, x, w, whole, in);
}

// y[r, g] for 4 rows of x and 4 outputs: 16 sums in registers, each weight vector
// loaded once for the 4 rows; the 16 sums' lanes then halved together (`vectors.h`'s
// `lanes_sums`: lane l with lane l + 8, + 4, + 2, + 1 of each sum, the order `finish`
// sums one in).
void tile(const uint16_t* x, const uint16_t* w, float* y, int64_t in, int64_t out) {
  const int64_t whole = in / kChunk * kChunk;
  __m512 c[kTile * kTile];
  for (auto& v : c) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < whole; i += kChunk) {
    __m512bh wv[kTile];
    for (int64_t g = 0; g < kTile; ++g) wv[g] = load_bh(w + g * in + i);
    for (int64_t r = 0; r < kTile; ++r) {
      const __m512bh xv = load_bh(x + r * in + i);
      for (int64_t g = 0; g < kTile; ++g)
        c[r * kTile + g] = _mm512_dpbf16_ps(c[r * kTile + g], xv, wv[g]);
    }
  }
  float s[kTile * kTile];  // c[r * kTile + g]'s lanes summed, at r * kTile + g
  specjax::lanes_sums(reinterpret_cast<const specjax::vf*>(c), kTile * kTile, s);
  for (int64_t r = 0; r < kTile; ++r)
    for (int64_t g = 0; g < kTile; ++g) {
      float sum = s[r * kTile + g];
      for (int64_t i = whole; i < in; ++i)
        sum = __builtin_fmaf(widen_bf16(x[r * in + i]), widen_bf16(w[g * in + i]), sum);
      y[r * out + g] = sum;
    }
}
constexpr bool kNative = true;
#else
float dot_native(const uint16_t* x, const uint16_t* w, int64_t in) {
  return dot_generic(x, w, in);
}
void tile(const uint16_t*, const uint16_t*, float*, int64_t, int64_t) {}
constexpr bool kNative = false;
#endif

inline float dot(const uint16_t* x, const uint16_t* w, int64_t in, bool native) {
  return native ? dot_native(x, w, in) : dot_generic(x, w, in);
}

// Outputs [c0, c1) for all rows: rows kRowBytes at a time (so they stay in L2 while the
// range's weights pass, each 4 outputs' from L1 for all of them), 4 x 4 tiles where
// whole (`native`: the instruction's path), the rest one by one.
void outputs(const uint16_t* x, const uint16_t* wt, float* y, int64_t rows, int64_t in,
             int64_t out, int64_t c0, int64_t c1, bool native) {
  const int64_t tiled = native ? c0 + (c1 - c0) / kTile * kTile : c0;
  const int64_t chunk = std::max<int64_t>(kTile, kRowBytes / (2 * in) / kTile * kTile);
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t r1 = std::min(rows, r0 + chunk);
    const int64_t r_tiled = native ? r0 + (r1 - r0) / kTile * kTile : r0;
    for (int64_t j = c0; j < tiled; j += kTile) {
      for (int64_t r = r0; r < r_tiled; r += kTile)
        tile(x + r * in, wt + j * in, y + r * out + j, in, out);
      for (int64_t r = r_tiled; r < r1; ++r)
        for (int64_t g = j; g < j + kTile; ++g)
          y[r * out + g] = dot(x + r * in, wt + g * in, in, native);
    }
    for (int64_t j = tiled; j < c1; ++j)
      for (int64_t r = r0; r < r1; ++r) y[r * out + j] = dot(x + r * in, wt + j * in, in, native);
  }
}

// native: 1 for the instruction where the build has it (`kNative`), 0 for the generic
// path (the tests compare the two).
ffi::Error Bf16GemmT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer wt,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                     int64_t native) {
  if (x.element_type() != ffi::DataType::BF16 || wt.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("x and wt must be bfloat16");
  specjax::MatrixOf<uint16_t> m;  // wt [out, in], or layer `layer` of [L, out, in]
  int64_t rows;
  if (ffi::Error e = specjax::transposed_operands(wt, layer, x.element_count(),
                                                  y->element_count(), &m, &rows);
      e.failure())
    return e;
  const int64_t out = m.a, in = m.b;
  const uint16_t* xs = static_cast<const uint16_t*>(x.untyped_data());
  const uint16_t* ws = m.data;
  float* ys = y->typed_data();
  const bool use_native = kNative && native != 0;
  // One contiguous range of whole tiles of outputs per thread.
  specjax::parallel_ranges(pool, out, 64, kTile, [=](int64_t c0, int64_t c1) {
    outputs(xs, ws, ys, rows, in, out, c0, c1, use_native);
  });
  return ffi::Error::Success();
}

}  // namespace

// Whether this build multiplies by the AVX512-BF16 instruction (`specjax.bf16_gemm`).
extern "C" int specjax_bf16_gemm_native() { return kNative ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_bf16_gemm_t, Bf16GemmT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x (bfloat16)
                                  .Arg<ffi::AnyBuffer>()          // wt (bfloat16)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("native"));

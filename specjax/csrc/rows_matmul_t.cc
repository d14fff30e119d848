// y[T, O] = x[T, I] @ wt[O, I]^T in float32 for few rows T (a decode step's 1, a
// verify's 2-32), with the weight stored transposed (each output's I weights
// contiguous), as an XLA FFI handler for the CPU backend (`specjax.rows_matmul` builds
// and registers it; the CPU decode layout stores the weights it wins this way). The
// weight is float32 or bfloat16; bfloat16 weights are widened to float32 (exactly) as
// they are loaded, so they stream half the bytes for the same float32 arithmetic.
//
// Why by hand, and why transposed: on [I, O] weights (rows_matmul.cc) each thread
// reads short pieces of many weight rows, which the hardware prefetcher follows poorly
// on the small matrices of a decode step (576x576 to 1536x576 on SmolLM2: 14-19 GB/s on
// an AVX2-only AMD EPYC that streams 26-30 GB/s). Here each thread reads one contiguous
// range of outputs' weights, as llama.cpp's dot products do, in G sequential streams
// (G outputs spaced a quarter or half of the range apart), and each weight vector is
// multiplied by up to 6 rows while in registers; rows past 6 re-read the block's few KB
// from L1, so the weights come from memory once for any row count
// (docs/benchmarks.md, "Few-row matmuls, weights transposed").
// Each output element is the dot product of x's row and wt's row summed the same way in
// every block shape and for any T: lane-wise fused multiply-adds over the vectors of I
// in order, the lanes summed by halves (the block's sums halved together, `vectors.h`'s
// `lanes_sums`), then the tail of I past the last whole vector in order, every
// multiply-add fused explicitly (`vectors.h`); so a row's result does not depend on
// how many rows share the call. The
// outputs are split across XLA's intra-op threads.
#include <algorithm>
#include <cstdint>

#include "layered.h"
#include "parallel_items.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::fma, specjax::kLanes, specjax::kRegisters, specjax::load,
    specjax::vf;  // vectors.h

constexpr int kMaxRows = 6;  // rows per register block (more go in groups)

// A weight vector or value as float32: float32 weights as they are, bfloat16 ones (their
// bits, uint16_t) widened.
inline vf wload(const float* p) { return load(p); }
inline vf wload(const uint16_t* p) { return specjax::widen_bf16(p); }
inline float wvalue(float w) { return w; }
inline float wvalue(uint16_t w) { return specjax::widen_bf16(w); }

// y[r, j + g * stride] for R rows of x and the G outputs j, j + stride, ...: R x G
// accumulators in registers, each weight vector loaded once for the R rows.
template <int G, int R, typename W>
void block(const float* x, const W* wt, float* y, int64_t in, int64_t out, int64_t j,
           int64_t stride) {
  const int64_t iv = in / kLanes * kLanes;  // whole vectors; tail after
  vf acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = vf{};
  for (int64_t i = 0; i < iv; i += kLanes) {
    vf wv[G];
    for (int g = 0; g < G; ++g) wv[g] = wload(wt + (j + g * stride) * in + i);
    for (int r = 0; r < R; ++r) {
      vf xv = load(x + r * in + i);
      specjax::in_register(xv);  // one load for the G products
      for (int g = 0; g < G; ++g) acc[r][g] = fma(xv, wv[g], acc[r][g]);
    }
  }
  float sums[R * G];  // acc[r][g]'s lanes summed, at r * G + g
  specjax::lanes_sums(&acc[0][0], R * G, sums);
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const W* w = wt + (j + g * stride) * in;
      float s = sums[r * G + g];
      for (int64_t i = iv; i < in; ++i) s = __builtin_fmaf(x[r * in + i], wvalue(w[i]), s);
      y[r * out + j + g * stride] = s;
    }
}

// All rows of x for the G outputs j, j + stride, ...: rows kMaxRows at a time, then
// the rest in one smaller block.
template <int G, typename W>
void rows_block(const float* x, const W* wt, float* y, int64_t rows, int64_t in,
                int64_t out, int64_t j, int64_t stride) {
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows)
    block<G, kMaxRows, W>(x + r * in, wt, y + r * out, in, out, j, stride);
  switch (rows - r) {
    case 5: block<G, 5, W>(x + r * in, wt, y + r * out, in, out, j, stride); break;
    case 4: block<G, 4, W>(x + r * in, wt, y + r * out, in, out, j, stride); break;
    case 3: block<G, 3, W>(x + r * in, wt, y + r * out, in, out, j, stride); break;
    case 2: block<G, 2, W>(x + r * in, wt, y + r * out, in, out, j, stride); break;
    case 1: block<G, 1, W>(x + r * in, wt, y + r * out, in, out, j, stride); break;
    default: break;
  }
}

// Outputs [c0, c1) for all rows: G streams over the range (output p of each quarter or
// half together), the outputs left past G whole parts one at a time.
template <int G, typename W>
void outputs(const float* x, const W* wt, float* y, int64_t rows, int64_t in,
             int64_t out, int64_t c0, int64_t c1) {
  const int64_t part = (c1 - c0) / G;
  for (int64_t p = 0; p < part; ++p) rows_block<G, W>(x, wt, y, rows, in, out, c0 + p, part);
  for (int64_t j = c0 + G * part; j < c1; ++j) rows_block<1, W>(x, wt, y, rows, in, out, j, 0);
}

// How many outputs a block reads side by side: R x G accumulators, G weight vectors
// and a row's vector must fit the registers (6 x 2 + 2 + 1 with AVX2's 16; with one or
// two rows, or 32 registers, 4 streams). Blocks of 6 rows rather than 4 take a 17-row
// verify from 9.4 to 11.5 GB/s of weights on the AVX2 EPYC (fewer weight reloads).
template <typename W>
void columns(const float* x, const W* wt, float* y, int64_t rows, int64_t in,
             int64_t out, int64_t c0, int64_t c1) {
  if (rows <= 2 || kRegisters >= 32) return outputs<4, W>(x, wt, y, rows, in, out, c0, c1);
  outputs<2, W>(x, wt, y, rows, in, out, c0, c1);
}

// The product for weights of element W (float32, or bfloat16 bits).
template <typename W>
ffi::Error Product(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wt,
                   ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32>& y) {
  specjax::MatrixOf<W> m;  // wt [out, in], or layer `layer` of [L, out, in] (layered.h)
  int64_t rows;
  if (ffi::Error e = specjax::transposed_operands(wt, layer, x.element_count(),
                                                  y->element_count(), &m, &rows);
      e.failure())
    return e;
  const int64_t out = m.a, in = m.b;
  const float* xs = x.typed_data();
  const W* ws = m.data;
  float* ys = y->typed_data();
  // One contiguous range of outputs per thread; small matrices run on one.
  specjax::parallel_ranges(pool, out, 128, 1, [=](int64_t c0, int64_t c1) {
    columns(xs, ws, ys, rows, in, out, c0, c1);
  });
  return ffi::Error::Success();
}

ffi::Error RowsMatmulT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer wt,
                       ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  switch (wt.element_type()) {
    case ffi::DataType::F32: return Product<float>(pool, x, wt, layer, y);
    case ffi::DataType::BF16: return Product<uint16_t>(pool, x, wt, layer, y);
    default: return ffi::Error::InvalidArgument("wt must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_rows_matmul_t, RowsMatmulT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::AnyBuffer>()          // wt (float32, bfloat16)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());

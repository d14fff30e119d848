// y[T, O] = x[T, I] @ w[I, O] in float32 for few rows T (a decode step's 1, a verify's
// 2-32), as an XLA FFI handler for the CPU backend (`specjax.rows_matmul` builds and
// registers it).
//
// Why by hand: XLA:CPU's GEMM of 2-5 rows costs 1.25-1.5x its one-row GEMV although it
// reads the same weights, and no XLA:CPU backend (Eigen, YNNPACK, oneDNN) streams a
// weight matrix once for a few rows at these shapes (docs/benchmarks.md). Here each
// weight row is read from memory once for all T rows: 32 rows at a time (32 sequential
// streams), and for each block of two vectors of columns the output rows, as many at a
// time as the target's vector registers hold (8 with AVX-512, 6 with AVX2), stay in
// registers across those 32. The first group of rows prefetches the next
// column block of the same weight rows: without it the hardware prefetcher alone does
// not keep 32 streams ahead of 2-8 rows' arithmetic (5 rows cost 1.5x one; with it,
// 1.2x). One row (a decode step, memory-bound) instead sweeps the weight rows 8 at a
// time through its whole chunk of columns, the output in cache: 8 long sequential
// streams, which read faster than 32 short ones on some 2-core Xeons
// (docs/benchmarks.md). Two to eight rows of an LM head (4,096 columns or more), and
// two to four of the MLP's gate and up (1,536 or more), sweep the same way, four weight
// rows at a time over two vectors of columns, each output row in turn: on an AVX2-only
// AMD EPYC the register blocks above read an LM head from memory at 0.6x the sweep's
// speed at those rows, while on narrower weights (attention projections, the MLP's
// down), and on gate and up from 5 rows, they stay the faster form
// (docs/benchmarks.md, "Few-row matmuls by hand"). Each output
// element sums x[t, i] * w[i, c] in the order of i, one fused multiply-add at a time, in
// every form and whatever T is, so a row's result does not depend on how many rows
// share the call. The columns are split across XLA's intra-op threads.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "layered.h"
#include "parallel_items.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::kLanes, specjax::kRegisters, specjax::load, specjax::store,
    specjax::vf;  // vectors.h
constexpr int kVecs = 2;  // vectors of columns per register block
// rows per register block (more go in groups): their kVecs accumulators each, the
// kVecs weight vectors and a broadcast must fit the registers, or they spill
constexpr int kMaxRows = std::min(8, (kRegisters - kVecs - 1) / kVecs);
constexpr int64_t kRowBlock = 32;  // weight rows streamed side by side
constexpr int64_t kColumnBlock = 64;  // columns of them the blocks of rows work through
constexpr int64_t kLineFloats = 16;  // floats in a 64-byte cache line
constexpr int kSweepRows = 8;  // weight rows one row's sweep reads side by side
constexpr int64_t kSweepColumns = 16384;  // one row's output chunk (64 KB, in L2)

// y[T rows, columns [c, c + kVecs * kLanes)] += x[T rows, i0..i1] @ w[i0..i1, those
// columns]: the T output rows held in registers across the weight rows. kPrefetch: also
// fetch the same columns of the next column block of these weight rows.
template <int T, bool kPrefetch>
void block(const float* x, const float* w, float* y, int64_t in, int64_t out, int64_t i0,
           int64_t i1, int64_t c) {
  vf acc[T][kVecs];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < kVecs; ++v) acc[t][v] = load(y + t * out + c + v * kLanes);
  for (int64_t i = i0; i < i1; ++i) {
    const float* wr = w + i * out + c;
    vf wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = load(wr + v * kLanes);
    // past the last column block this names memory beyond the row (or the matrix): a
    // prefetch never faults, so it needs no bound
    if (kPrefetch)
      for (int64_t l = 0; l < kVecs * kLanes; l += kLineFloats)
        __builtin_prefetch(wr + kColumnBlock + l);
    for (int t = 0; t < T; ++t) {
      const float xs = x[t * in + i];
      for (int v = 0; v < kVecs; ++v) acc[t][v] += xs * wv[v];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < kVecs; ++v) store(y + t * out + c + v * kLanes, acc[t][v]);
}

typedef void (*BlockFn)(const float*, const float*, float*, int64_t, int64_t, int64_t,
                        int64_t, int64_t);
template <bool kPrefetch, size_t... R>
constexpr std::array<BlockFn, kMaxRows> blocks(std::index_sequence<R...>) {
  return {block<R + 1, kPrefetch>...};
}
// [prefetching][rows - 1]: the first group of rows prefetches, the others find the
// block in L1.
constexpr std::array<BlockFn, kMaxRows> kBlocks[2] = {
    blocks<false>(std::make_index_sequence<kMaxRows>()),
    blocks<true>(std::make_index_sequence<kMaxRows>())};

// y[0, c0..c1) += x[0, i0..i0 + U) @ w[i0..i0 + U, c0..c1): U weight rows read
// together, vector by vector, each added into the output in turn.
template <int U>
void sweep(const float* x, const float* w, float* y, int64_t out, int64_t i0, int64_t c0,
           int64_t c1) {
  const int64_t cv = c0 + (c1 - c0) / kLanes * kLanes;  // whole vectors; tail after
  for (int64_t c = c0; c < cv; c += kLanes) {
    vf acc = load(y + c);
    for (int u = 0; u < U; ++u) acc += x[i0 + u] * load(w + (i0 + u) * out + c);
    store(y + c, acc);
  }
  for (int64_t c = cv; c < c1; ++c)
    for (int u = 0; u < U; ++u) y[c] += x[i0 + u] * w[(i0 + u) * out + c];
}

// Columns [c0, c1) of y for one row of x: every weight row in turn, kSweepRows at a
// time, through chunks of kSweepColumns columns.
void row_columns(const float* x, const float* w, float* y, int64_t in, int64_t out,
                 int64_t c0, int64_t c1) {
  std::memset(y + c0, 0, (c1 - c0) * sizeof(float));
  for (int64_t cs = c0; cs < c1; cs += kSweepColumns) {
    const int64_t ce = std::min(c1, cs + kSweepColumns);
    int64_t i = 0;
    for (; i + kSweepRows <= in; i += kSweepRows) sweep<kSweepRows>(x, w, y, out, i, cs, ce);
    for (; i < in; ++i) sweep<1>(x, w, y, out, i, cs, ce);
  }
}

constexpr int64_t kFewRows = 8;  // the most rows the sweep (`few_columns`) takes
constexpr int kFewSweep = 4;  // weight rows a few rows' sweep reads side by side
constexpr int kFewVecs = 2;  // vectors of columns per step (one broadcast of x serves both)

// y[T rows, c0..c1) += x[T rows, i0..i0 + U) @ w[i0..i0 + U, c0..c1): U weight rows
// read together, kFewVecs vectors at a time, each output row added in turn.
template <int U>
void sweep_rows(const float* x, const float* w, float* y, int64_t rows, int64_t in,
                int64_t out, int64_t i0, int64_t c0, int64_t c1) {
  constexpr int64_t kStep = kFewVecs * kLanes;
  const int64_t cv = c0 + (c1 - c0) / kStep * kStep;  // whole steps; tail after
  for (int64_t c = c0; c < cv; c += kStep) {
    vf wv[U][kFewVecs];
    for (int u = 0; u < U; ++u)
      for (int v = 0; v < kFewVecs; ++v) wv[u][v] = load(w + (i0 + u) * out + c + v * kLanes);
    for (int64_t t = 0; t < rows; ++t) {
      vf acc[kFewVecs];
      for (int v = 0; v < kFewVecs; ++v) acc[v] = load(y + t * out + c + v * kLanes);
      for (int u = 0; u < U; ++u) {
        const float xs = x[t * in + i0 + u];
        for (int v = 0; v < kFewVecs; ++v) acc[v] += xs * wv[u][v];
      }
      for (int v = 0; v < kFewVecs; ++v) store(y + t * out + c + v * kLanes, acc[v]);
    }
  }
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = cv; c < c1; ++c)
      for (int u = 0; u < U; ++u) y[t * out + c] += x[t * in + i0 + u] * w[(i0 + u) * out + c];
}

// Columns [c0, c1) of y for 2..kFewRows rows of x: as `row_columns`, the chunk of
// columns shrunk with the rows so that their outputs stay in L2.
void few_columns(const float* x, const float* w, float* y, int64_t rows, int64_t in,
                 int64_t out, int64_t c0, int64_t c1) {
  for (int64_t t = 0; t < rows; ++t)
    std::memset(y + t * out + c0, 0, (c1 - c0) * sizeof(float));
  const int64_t span = std::max<int64_t>(kLanes, kSweepColumns / rows / kLanes * kLanes);
  for (int64_t cs = c0; cs < c1; cs += span) {
    const int64_t ce = std::min(c1, cs + span);
    int64_t i = 0;
    for (; i + kFewSweep <= in; i += kFewSweep)
      sweep_rows<kFewSweep>(x, w, y, rows, in, out, i, cs, ce);
    for (; i < in; ++i) sweep_rows<1>(x, w, y, rows, in, out, i, cs, ce);
  }
}

// How 2..kFewRows rows multiply: the call's `form` attribute, chosen by the caller's
// width rule (`specjax.rows_matmul.sweeps`, timed per weight shape by `python -m
// specjax.bench.matmul_race --kernel-forms`). One row and more rows ignore it.
enum Form : int64_t { kRegisterBlocks = 1, kSweep = 2 };

// Columns [c0, c1) of y for all rows of x. Weight rows kRowBlock at a time (that many
// sequential streams); each block of 64 columns of them (8 KB, in L1) serves the rows
// in groups of up to kMaxRows, so w is read from memory once for any row count.
void columns(const float* x, const float* w, float* y, int64_t rows, int64_t in,
             int64_t out, int64_t c0, int64_t c1, int64_t form) {
  if (rows == 1) return row_columns(x, w, y, in, out, c0, c1);
  if (rows <= kFewRows && form == kSweep) return few_columns(x, w, y, rows, in, out, c0, c1);
  for (int64_t t = 0; t < rows; ++t)
    std::memset(y + t * out + c0, 0, (c1 - c0) * sizeof(float));
  const int64_t cv = c0 + (c1 - c0) / kColumnBlock * kColumnBlock;  // blocked; tail after
  for (int64_t i0 = 0; i0 < in; i0 += kRowBlock) {
    const int64_t i1 = std::min(in, i0 + kRowBlock);
    for (int64_t c = c0; c < cv; c += kColumnBlock) {
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int64_t n = std::min<int64_t>(kMaxRows, rows - r);
        for (int64_t cc = c; cc < c + kColumnBlock; cc += kVecs * kLanes)
          kBlocks[r == 0][n - 1](x + r * in, w, y + r * out, in, out, i0, i1, cc);
      }
    }
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t c = cv; c < c1; ++c)
        for (int64_t t = 0; t < rows; ++t) y[t * out + c] += x[t * in + i] * w[i * out + c];
  }
}

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y, int64_t form) {
  if (form != kRegisterBlocks && form != kSweep)
    return ffi::Error::InvalidArgument("form must be 1 (register blocks) or 2 (sweep)");
  specjax::Matrix m;  // w [in, out], or layer `layer` of [L, in, out] (layered.h)
  if (ffi::Error e = specjax::layer_matrix(w, layer, &m); e.failure()) return e;
  const int64_t in = m.a, out = m.b;
  int64_t rows;
  if (ffi::Error e = specjax::product_rows(x.element_count(), in, out, y->element_count(),
                                           "w's first", &rows);
      e.failure())
    return e;
  const float* xs = x.typed_data();
  const float* ws = m.data;
  float* ys = y->typed_data();
  // One chunk of columns per thread, whole column blocks; small matrices run on one.
  specjax::parallel_ranges(pool, out, 128, kColumnBlock, [=](int64_t c0, int64_t c1) {
    columns(xs, ws, ys, rows, in, out, c0, c1, form);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_rows_matmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("form"));

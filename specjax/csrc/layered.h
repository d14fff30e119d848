// One layer's matrix of a weight that is either one matrix [A, B] or a stack of them
// [L, A, B], picked by a layer index operand, for specjax's matmul kernels
// (rows_matmul.cc, rows_matmul_t.cc, bf16_gemm_t.cc). The stacked form lets the CPU
// decode layout run its layers in a scan that hands every layer the whole stack and its
// index: the kernel reads the layer where it lies, where a slice of the stack would be a
// copy per layer and step on XLA:CPU.
#ifndef SPECJAX_CSRC_LAYERED_H_
#define SPECJAX_CSRC_LAYERED_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace specjax {

// The layer's matrix [a, b] of elements T.
template <typename T>
struct MatrixOf {
  const T* data;
  int64_t a, b;
};
using Matrix = MatrixOf<float>;

// The layer's matrix of a weight of dimensions `d` ([A, B], or [L, A, B] with
// 0 <= layer < L) whose elements start at `base`; an error naming what is wrong otherwise.
template <typename T, typename Dims>
xla::ffi::Error layer_matrix(const Dims& d, const T* base,
                             xla::ffi::Buffer<xla::ffi::S32> layer, MatrixOf<T>* m) {
  if (d.size() != 2 && d.size() != 3)
    return xla::ffi::Error::InvalidArgument("the weight must be [A, B] or [L, A, B]");
  if (layer.element_count() != 1)
    return xla::ffi::Error::InvalidArgument("the layer must be one int32");
  const int64_t stack = d.size() == 3 ? d[0] : 1;
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= stack) return xla::ffi::Error::InvalidArgument("layer out of range");
  m->a = d[d.size() - 2];
  m->b = d[d.size() - 1];
  m->data = base + l * m->a * m->b;
  return xla::ffi::Error::Success();
}

// The same for a float32 weight buffer.
inline xla::ffi::Error layer_matrix(xla::ffi::Buffer<xla::ffi::F32> w,
                                    xla::ffi::Buffer<xla::ffi::S32> layer, Matrix* m) {
  return layer_matrix(w.dimensions(), w.typed_data(), layer, m);
}

// The rows of x (x_count elements of `in` inputs each) for a product into y (y_count
// elements of `out` outputs each); an error otherwise, naming the weight's input
// dimension as `in_dim` says (e.g. "wt's second").
inline xla::ffi::Error product_rows(int64_t x_count, int64_t in, int64_t out,
                                    int64_t y_count, const char* in_dim, int64_t* rows) {
  if (in == 0 || x_count % in != 0)
    return xla::ffi::Error::InvalidArgument(
        std::string("x's last dimension must equal ") + in_dim);
  *rows = x_count / in;
  if (y_count != *rows * out) return xla::ffi::Error::InvalidArgument("y must be [rows, out]");
  return xla::ffi::Error::Success();
}

// Layer `layer` of a transposed weight wt [out, in] (or [L, out, in]) of elements T, and
// the rows of x for its product into y (rows_matmul_t.cc, bf16_gemm_t.cc).
template <typename T>
xla::ffi::Error transposed_operands(xla::ffi::AnyBuffer wt,
                                    xla::ffi::Buffer<xla::ffi::S32> layer, int64_t x_count,
                                    int64_t y_count, MatrixOf<T>* m, int64_t* rows) {
  const T* base = static_cast<const T*>(wt.untyped_data());
  if (xla::ffi::Error e = layer_matrix(wt.dimensions(), base, layer, m); e.failure())
    return e;
  return product_rows(x_count, m->b, m->a, y_count, "wt's second", rows);
}

}  // namespace specjax

#endif  // SPECJAX_CSRC_LAYERED_H_

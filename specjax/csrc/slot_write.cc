// Writes rows of a block-paged KV cache [L, K, P, Z, R...] in place, as an XLA FFI
// handler for the CPU backend (`specjax.cpu_slot_write` builds and registers it): a
// step's new keys or values into their slots, or a tree commit's moves of slots to
// other slots of every layer.
//
// Why by hand: XLA:CPU runs a scatter into 2-byte float pages (bfloat16, float16) in
// float32 (its float normalization), converting the whole stacked cache to float32 and
// back on every write; a write of a few rows then costs a pass over every page. This
// copies the rows' bytes, whatever their type, and nothing else. The result aliases the
// pages operand, so XLA hands the kernel the cache's own buffer where it can (else a
// copy of it): the kernel reads and writes the result only.
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// pages [L, K, P, Z, R...]; rows [Lw, K, N, R...] written into layers layer..layer+Lw-1
// at slots (dst_page, dst_offset) [N], or (rows empty) every layer's slots (src_page,
// src_offset) [N] copied to (dst_page, dst_offset). A dst page outside [0, P) drops its
// row; a src page must lie in [0, P) where its dst does.
ffi::Error WriteSlots(ffi::AnyBuffer pages, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::S32> dst_page, ffi::Buffer<ffi::S32> dst_offset,
                      ffi::Buffer<ffi::S32> src_page, ffi::Buffer<ffi::S32> src_offset,
                      ffi::Result<ffi::AnyBuffer> out) {
  const auto d = pages.dimensions();
  if (d.size() < 4) return ffi::Error::InvalidArgument("pages must be [L, K, P, Z, ...]");
  const int64_t L = d[0], K = d[1], P = d[2], Z = d[3];
  const int64_t slots = L * K * P * Z;
  const int64_t n = dst_page.element_count();
  const bool moving = rows.element_count() == 0;
  if (out->size_bytes() != pages.size_bytes() || out->element_type() != pages.element_type())
    return ffi::Error::InvalidArgument("the result must be the pages' shape and type");
  if (slots == 0) return ffi::Error::Success();
  const size_t row_bytes = pages.size_bytes() / slots;  // one slot of one layer and head
  if (dst_offset.element_count() != n || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("dst_page and dst_offset must be [N], layer one int32");
  if (moving ? (src_page.element_count() != n || src_offset.element_count() != n)
             : src_page.element_count() != 0)
    return ffi::Error::InvalidArgument("src slots [N] go with moves (no rows) only");
  int64_t layers = L, first = 0;
  if (!moving) {
    if (rows.element_type() != pages.element_type() || rows.dimensions().size() < 3 ||
        rows.dimensions()[1] != K || rows.dimensions()[2] != n ||
        rows.size_bytes() != rows.dimensions()[0] * K * n * row_bytes)
      return ffi::Error::InvalidArgument("rows must be [Lw, K, N, ...] of the pages' type "
                                         "and row shape");
    layers = rows.dimensions()[0];
    first = layer.typed_data()[0];
    if (first < 0 || first + layers > L)
      return ffi::Error::InvalidArgument("layer out of range");
  }
  const int32_t* dp = dst_page.typed_data();
  const int32_t* dz = dst_offset.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    if (dp[i] >= 0 && dp[i] < P && (dz[i] < 0 || dz[i] >= Z))
      return ffi::Error::InvalidArgument("dst_offset out of range");
    if (moving && dp[i] >= 0 && dp[i] < P &&
        (src_page.typed_data()[i] < 0 || src_page.typed_data()[i] >= P ||
         src_offset.typed_data()[i] < 0 || src_offset.typed_data()[i] >= Z))
      return ffi::Error::InvalidArgument("src slot out of range");
  }
  char* base = static_cast<char*>(out->untyped_data());
  auto at = [&](int64_t l, int64_t k, int64_t page, int64_t offset) {
    return base + (((l * K + k) * P + page) * Z + offset) * row_bytes;
  };
  const char* from = static_cast<const char*>(rows.untyped_data());
  std::vector<char> moved;  // a move reads every source before it writes any slot
  if (moving) {
    moved.resize(layers * K * n * row_bytes);
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t i = 0; i < n; ++i)
          if (dp[i] >= 0 && dp[i] < P)
            std::memcpy(moved.data() + ((l * K + k) * n + i) * row_bytes,
                        at(l, k, src_page.typed_data()[i], src_offset.typed_data()[i]),
                        row_bytes);
    from = moved.data();
  }
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < n; ++i)
        if (dp[i] >= 0 && dp[i] < P)
          std::memcpy(at(first + l, k, dp[i], dz[i]),
                      from + ((l * K + k) * n + i) * row_bytes, row_bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_write_slots, WriteSlots,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pages
                                  .Arg<ffi::AnyBuffer>()          // rows (empty: moves)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer (first written)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst_page
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst_offset
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src_page (moves)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src_offset (moves)
                                  .Ret<ffi::AnyBuffer>());        // pages, aliased

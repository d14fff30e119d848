// Paged attention of a few float32 queries per row (a decode step's 1, a verify's 2-63)
// over a block-paged KV cache of float32, bfloat16 or int8 pages (int8: one float32
// scale per token and KV head, `specjax.kv_quant`), as an XLA FFI handler for the CPU
// backend (`specjax.cpu_attention` builds and registers it).
//
// Why by hand: XLA:CPU runs the plain-jnp form as a gather of every page the table names
// (all of them, used or not) into a fresh [B, S, K, H] copy per layer, a slice of the
// layer's pages out of the stacked cache, transposes, and a softmax over the whole
// table (against this kernel: `python -m specjax.bench.paged_attention`, figures in
// docs/benchmarks.md). Here each row reads only the slots it uses,
// straight from the stacked pages [L, K, P, Z, H] (the layer is an operand, so nothing
// is sliced or copied), and the step's own keys/values may come from beside the pages.
//
// Per (row, KV head, chunk of slots, block of queries), a long row's chunks merged by
// the item that finishes its last (`merge`): slots are taken kLanes at a time (one
// vector: 16 with AVX-512, 8 with AVX2), each key read where it lies; a query's score
// against a slot is a chain of lane-wise multiply-adds over the head dimension, whose
// lanes a fixed tree of folds then sums, kLanes slots' sums at once. Scores go to a
// scratch row; a second pass takes exp(score - max) and the denominator, and a third
// sums probability x value slot by slot. Every sum runs in a fixed order of the slot's
// absolute position (lane = slot mod kLanes; chunks by absolute position, merged in
// order) and of h, so a query's output depends only on the slots it sees: not on how
// many queries share the call, nor on whether its newer slots came from the pages or
// from beside them (a chain verify's token gets the bits a one-token step gives it).
// Narrower pages are widened into a float32 copy of the item's slots first (`stage`),
// the values `kv_quant.dequantize` gives (int8 x scale, one float32 product; bfloat16
// exactly), and attended as float32 pages holding those values would be, bit for bit.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel_items.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specjax::kLanes, specjax::load, specjax::store, specjax::vf,
    specjax::vi;  // vectors.h
constexpr int kMinQueryBlock = 8;  // the fewest queries a work item split off a head takes
constexpr int kFetchAheadQueries = 8;  // the most queries an item fetches keys ahead for
constexpr int64_t kCacheLine = 64;  // bytes a prefetch brings in (x86-64)
constexpr int kValueGroup = 4;  // queries whose sums share each load of values
// head-dim columns a value pass holds: kValueGroup x their vectors of accumulators and
// the vectors of values must fit the registers (4 x 4 + 4 of 32; 4 x 2 + 2 of 16)
constexpr int64_t kValueColumns = (specjax::kRegisters >= 32 ? 4 : 2) * kLanes;
constexpr int64_t kChunk = 64;  // the head dimension's multiple (cpu_attention.takes)
static_assert(kChunk % kValueColumns == 0 && kChunk % kLanes == 0);

inline vf splat(float x) { return vf{} + x; }

// exp(x) for x <= 0, to float32 precision (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2,
// a degree-7 polynomial in r, times 2^n). Below -87 it returns exp(-87) ~ 1.6e-38:
// a probability that small is 0 beside the maximum's 1.
inline vf exp_nonpositive(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const vf fx = x * 1.44269504088896341f;
  const vi n = __builtin_convertvector(fx - 0.5f, vi);  // round to nearest (fx <= 0)
  const vf nf = __builtin_convertvector(n, vf);
  vf r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  vf p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float hsum(vf v) {  // lanes in order
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

struct Shapes {
  int64_t B, T, N, H, L, K, P, Z, M, G;
  bool has_mask, has_new;
};

enum class PageType { kF32, kBF16, kS8 };

struct Args {
  Shapes s;
  const float* q;       // [B, T, N, H]
  PageType type;
  const void* kp;       // [L, K, P, Z, H] of `type`
  const void* vp;
  const float* ks;      // [L, K, P, Z] int8 pages' scales, else none
  const float* vs;
  int64_t layer;
  const int32_t* table;  // [B, M]
  const int32_t* page_lens;  // [B] slots read from the pages
  const int32_t* new_start;  // [B] absolute slot of the first new token
  const int32_t* q_lens;     // [B]
  const bool* mask;          // [B, T, T] or none
  const float* kn;           // [B, T, K, H] or none: new tokens' keys at slots
  const float* vn;           // page_lens + j
  float scale, soft_cap;
  int64_t window;  // 0: none
  float* out;      // [B, T, N, H]
};

// Slot s's entry (of Z x H elements a page, or of one scale a page slot) in the
// stacked pages of row b, KV head kh; s is one of the slots the pages hold.
inline int64_t page_slot(const Args& a, int64_t b, int64_t kh, int64_t s) {
  const Shapes& d = a.s;
  int64_t page = a.table[b * d.M + s / d.Z];
  page = std::min<int64_t>(std::max<int64_t>(page, 0), d.P - 1);  // as jnp's gather clamps
  return ((a.layer * d.K + kh) * d.P + page) * d.Z + s % d.Z;
}

// Where slot s of row b, KV head kh lives in float32 pages, or, past the pages' slots,
// in the new keys/values beside them.
inline const float* slot_row(const Args& a, const void* pages, const float* fresh,
                             int64_t b, int64_t kh, int64_t s, int64_t page_len) {
  const Shapes& d = a.s;
  if (s < page_len) return static_cast<const float*>(pages) + page_slot(a, b, kh, s) * d.H;
  return fresh + ((b * d.T + (s - page_len)) * d.K + kh) * d.H;
}

// kLanes entries of an int8 page row as float32: each code times its slot's scale, the
// one product `kv_quant.dequantize` takes (no fused multiply-add: -std=c++17 keeps
// -ffp-contract off).
inline vf widen(const int8_t* p, float scale) { return specjax::widen_int8(p) * scale; }
// kLanes bfloat16 entries as float32 (exact).
inline vf widen(const uint16_t* p, float) { return specjax::widen_bf16(p); }

// dst[(s - s0) * H ...] = slots [s0, s1) of row b, KV head kh (all in the pages),
// widened from pages of E (int8 with `scales`, or bfloat16) to float32.
template <typename E>
void stage(const Args& a, const void* pages, const float* scales, int64_t b, int64_t kh,
           int64_t s0, int64_t s1, float* dst) {
  const int64_t H = a.s.H;
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t e = page_slot(a, b, kh, s);
    const E* row = static_cast<const E*>(pages) + e * H;
    const float scale = scales != nullptr ? scales[e] : 1.0f;
    float* out = dst + (s - s0) * H;
    for (int64_t c = 0; c < H; c += kLanes) store(out + c, widen(row + c, scale));
  }
}

// rows[s - c0] = where slots [c0, c1) of row b, KV head kh are read as float32: float32
// pages in place; narrower ones (E) from `staged`, filled here; the new tokens' from
// beside the pages.
template <typename E>
void slot_rows(const Args& a, const void* pages, const float* scales, const float* fresh,
               int64_t b, int64_t kh, int64_t c0, int64_t c1, int64_t page_len,
               std::vector<float>& staged, const float** rows) {
  if constexpr (std::is_same_v<E, float>) {
    for (int64_t s = c0; s < c1; ++s) rows[s - c0] = slot_row(a, pages, fresh, b, kh, s, page_len);
  } else {
    const int64_t H = a.s.H, paged = std::max<int64_t>(std::min(c1, page_len) - c0, 0);
    staged.resize(paged * H);
    stage<E>(a, pages, scales, b, kh, c0, c0 + paged, staged.data());
    for (int64_t s = c0; s < c1; ++s)
      rows[s - c0] = s < page_len ? staged.data() + (s - c0) * H
                                  : slot_row(a, pages, fresh, b, kh, s, page_len);
  }
}

// Whether query t of row b sees absolute slot s (the module contract of
// specjax.attention): the prefix before new_start, and among the q_len new tokens
// those the mask (else causality) allows; a sliding window bounds both.
inline bool sees(const Args& a, int64_t b, int64_t t, int64_t s, int64_t start,
                 int64_t q_len) {
  const int64_t rel = s - start;
  if (rel >= q_len) return false;
  if (a.window > 0 && start + t - s >= a.window) return false;
  if (rel < 0) return true;
  if (!a.s.has_mask) return rel <= t;
  return a.mask[(b * a.s.T + t) * a.s.T + rel];
}

// Lane L of the vector `lane_sums` returns holds the sum of the lanes of input vector
// bit_reverse(L): its inputs go in at bit-reversed positions to come out in order.
constexpr int bit_reverse(int i) {
  int r = 0;
  for (int b = 1; b < kLanes; b <<= 1, i >>= 1) r = (r << 1) | (i & 1);
  return r;
}

// One level of `lane_sums`: lanes of a and b in blocks of 2H, each output lane the sum of
// a lane and the lane H past it, from a in the first half of a block and b in the second.
constexpr int pick(int H, int lane, bool upper) {
  const int block = lane / (2 * H) * 2 * H, off = lane % (2 * H) + (upper ? H : 0);
  return off < (upper ? 2 * H : H) ? block + off : kLanes + block + off - H;
}
template <int H, std::size_t... L>
inline vf fold(vf a, vf b, std::index_sequence<L...>) {
  return (vf)__builtin_shufflevector(a, b, pick(H, L, false)...) +
         (vf)__builtin_shufflevector(a, b, pick(H, L, true)...);
}

// kLanes vectors v[0..kLanes) -> one vector of their lane sums (lane L: v[bit_reverse(L)]'s),
// by pairwise folds (lane j + lane j + kLanes/2, then + kLanes/4, ...): every vector's
// lanes are summed in the same order wherever it sits. Overwrites v.
template <int H = kLanes / 2>
inline vf lane_sums(vf* v) {
  for (int i = 0; i < H; ++i)  // 2H vectors at this level into H
    v[i] = fold<H>(v[2 * i], v[2 * i + 1], std::make_index_sequence<kLanes>{});
  if constexpr (H > 1) return lane_sums<H / 2>(v);
  else return v[0];
}

// The scores of query q [H] against the kLanes keys krow[i] [H], lane i for key i: per key
// a chain of lane-wise fused multiply-adds over H in order, then its lanes summed by
// `lane_sums`. The keys are read where they lie (no transposed copy), and a score's
// arithmetic is the same for any query and slot.
inline vf score_block(const float* q, const float* const* krow, int64_t H) {
  vf acc[kLanes];
  for (int i = 0; i < kLanes; ++i) acc[i] = vf{};
  for (int64_t c = 0; c < H; c += kLanes) {
    const vf qv = load(q + c);
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i)
      acc[bit_reverse(i)] = specjax::fma(qv, load(krow[i] + c), acc[bit_reverse(i)]);
  }
  return lane_sums(acc);
}

// out[q] columns [c, c + kValueColumns) = sum_s p[q][s] v_s for R queries, slots in
// order.
template <int R>
void value_chunk(const float* const* ps, const float* const* vrows, int64_t slots,
                 int64_t c, vf (*acc)[kValueColumns / kLanes]) {
  constexpr int V = kValueColumns / kLanes;
  vf o[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) o[r][v] = vf{};
  for (int64_t s = 0; s < slots; ++s) {
    vf x[V];
    for (int v = 0; v < V; ++v) x[v] = load(vrows[s] + c + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float p = ps[r][s];
      for (int v = 0; v < V; ++v) o[r][v] += p * x[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = o[r][v];
}

typedef void (*ValueFn)(const float* const*, const float* const*, int64_t, int64_t,
                        vf (*)[kValueColumns / kLanes]);
constexpr ValueFn kValue[kValueGroup] = {value_chunk<1>, value_chunk<2>, value_chunk<3>,
                                         value_chunk<4>};

// Slots per chunk: a work item attends over one chunk of a row's slots (by absolute
// position), and the chunks' partial results are merged after (`merge`), so one row's
// long context spreads over the threads (3 KV heads on 2 threads left one idle a third
// of the time). Fixed, so a query's arithmetic does not depend on the call's shape.
constexpr int64_t kSlotChunk = 512;
static_assert(kSlotChunk % kLanes == 0);

// A row's slots: those read from its pages, and its new ones when they come from beside
// the pages; and how many of its q_len tokens are queries.
struct RowSlots {
  int64_t slots, page_len, q_len;
  int64_t chunks() const { return (slots + kSlotChunk - 1) / kSlotChunk; }
};
inline RowSlots row_slots(const Args& a, int64_t b) {
  const Shapes& d = a.s;
  const int64_t q_len = std::min<int64_t>(std::max<int32_t>(a.q_lens[b], 0), d.T);
  const int64_t page_len = std::min<int64_t>(std::max<int32_t>(a.page_lens[b], 0), d.M * d.Z);
  return {page_len + (d.has_new ? q_len : 0), page_len, q_len};
}

// Per (row, KV head, chunk, query): the chunk's maximum score (-inf: it sees none of
// the chunk) and its sum of exp(score - maximum); for a row over several chunks, the
// unnormalized sum of p v [H] too.
struct Partials {
  int64_t chunks, queries;
  float *m, *l, *o;  // [rows x KV heads x chunks x queries] (o: x H)
  int64_t at(const Shapes& d, int64_t b, int64_t kh, int64_t c, int64_t q) const {
    return ((b * d.K + kh) * chunks + c) * queries + q;
  }
};

// Where query q (of a row's T * G) of row b, KV head kh writes its output [H].
inline float* output(const Args& a, int64_t b, int64_t kh, int64_t q) {
  const Shapes& d = a.s;
  return a.out + ((b * d.T + q / d.G) * d.N + kh * d.G + q % d.G) * d.H;
}

// One work item: row b, KV head kh, queries [q0, q1) of its T * G (query q is token
// q / G, head kh * G + q % G), over the slots of chunk c. A row of one chunk writes its
// output here, as `merge` would from its one chunk: (0 + sum) / denominator, 0 where a
// query sees no slot; a longer row's chunks leave their partials for `merge`.
// kFetchAhead (an item of few queries, whose time is reading the keys, not the
// arithmetic): the next block's keys are asked for while a block is scored, as the
// hardware prefetchers did not keep up with the score pass's walk across the slots'
// rows. An item of many queries does not (there the fetches crowded its cache).
template <bool kFetchAhead, typename E>
void attend(const Args& a, const Partials& part, int64_t b, int64_t kh, int64_t c,
            int64_t q0, int64_t q1) {
  static_assert(!kFetchAhead || std::is_same_v<E, float>, "narrower pages' keys are staged");
  const Shapes& d = a.s;
  const int64_t H = d.H, G = d.G;
  const RowSlots row = row_slots(a, b);
  const int64_t c0 = c * kSlotChunk;
  if (c > 0 && c0 >= row.slots) return;  // past this row's slots: `merge` reads its own
  const bool whole = row.chunks() <= 1;
  const int64_t c1 = std::min(row.slots, c0 + kSlotChunk);
  const int64_t start = a.new_start[b];
  const int64_t padded = (c1 - c0 + kLanes - 1) / kLanes * kLanes;
  const int64_t nq = q1 - q0;

  thread_local std::vector<float> scratch, zeros, kstaged, vstaged;
  thread_local std::vector<const float*> krows, vrows;
  scratch.resize(nq * padded);
  zeros.assign(H, 0.0f);
  vrows.resize(c1 - c0);
  // Where the item reads slot s's key: float32 pages where it lies (looked up as the
  // blocks are scored: a table of the chunk's rows built up front made a decode step's
  // items slower), narrower pages from their staged copy.
  if constexpr (!std::is_same_v<E, float>) {
    krows.resize(c1 - c0);
    slot_rows<E>(a, a.kp, a.ks, a.kn, b, kh, c0, c1, row.page_len, kstaged, krows.data());
  }
  const auto key_row = [&](int64_t s) {
    if constexpr (std::is_same_v<E, float>)
      return slot_row(a, a.kp, a.kn, b, kh, s, row.page_len);
    else
      return krows[s - c0];
  };
  const auto query = [&](int64_t q) {
    return a.q + ((b * d.T + q / G) * d.N + kh * G + q % G) * H;
  };

  // Pass 1: scores (masked to -inf) and each query's maximum.
  thread_local std::vector<vf> maxima;  // per query, lane-wise until the end
  maxima.assign(nq, splat(-INFINITY));
  for (int64_t s0 = c0; s0 < c0 + padded; s0 += kLanes) {
    const float* krow[kLanes];  // the block's keys (zeros past the slots)
    for (int64_t i = 0; i < kLanes; ++i) krow[i] = s0 + i < c1 ? key_row(s0 + i) : zeros.data();
    if constexpr (kFetchAhead) {
      for (int64_t i = 0; i < kLanes && s0 + kLanes + i < c1; ++i) {
        const char* next = reinterpret_cast<const char*>(key_row(s0 + kLanes + i));
        for (int64_t at = 0; at < H * int64_t{sizeof(float)}; at += kCacheLine)
          __builtin_prefetch(next + at);
      }
    }
    // slots every query sees: the prefix, inside any window
    const bool all_seen = s0 + kLanes <= std::min(start, c1) && a.window == 0;
    for (int64_t r = 0; r < nq; ++r) {
      vf x = score_block(query(q0 + r), krow, H) * a.scale;
      if (a.soft_cap > 0.0f)
        for (int i = 0; i < kLanes; ++i) x[i] = a.soft_cap * std::tanh(x[i] / a.soft_cap);
      if (!all_seen) {
        const int64_t t = (q0 + r) / G;
        for (int i = 0; i < kLanes; ++i) {
          const int64_t s = s0 + i;
          if (s >= c1 || !sees(a, b, t, s, start, row.q_len)) x[i] = -INFINITY;
        }
      }
      store(scratch.data() + r * padded + (s0 - c0), x);
      maxima[r] = maxima[r] > x ? maxima[r] : x;
    }
  }

  // Pass 2: probabilities in place of the scores, and each query's sum of them.
  for (int64_t r = 0; r < nq; ++r) {
    float* p_row = scratch.data() + r * padded;
    const float m = hmax(maxima[r]);
    vf sum = vf{};
    for (int64_t s0 = 0; s0 < padded; s0 += kLanes) {
      const vf x = load(p_row + s0);
      // a query that sees none of the chunk (m = -inf) gets probabilities 0
      const vf p = x > splat(-INFINITY) ? exp_nonpositive(x - m) : vf{};
      store(p_row + s0, p);
      sum += p;
    }
    const int64_t e = part.at(d, b, kh, c, q0 + r);
    part.m[e] = m;
    part.l[e] = hsum(sum);
  }

  // Pass 3: sum p v over the chunk's slots (in order).
  slot_rows<E>(a, a.vp, a.vs, a.vn, b, kh, c0, c1, row.page_len, vstaged, vrows.data());
  const float* prow[kValueGroup];
  vf acc[kValueGroup][kValueColumns / kLanes];
  for (int64_t g0 = 0; g0 < nq; g0 += kValueGroup) {
    const int n = static_cast<int>(std::min<int64_t>(kValueGroup, nq - g0));
    for (int r = 0; r < n; ++r) prow[r] = scratch.data() + (g0 + r) * padded;
    for (int64_t col = 0; col < H; col += kValueColumns) {
      kValue[n - 1](prow, vrows.data(), c1 - c0, col, acc);
      for (int r = 0; r < n; ++r) {
        const int64_t qr = q0 + g0 + r;
        float* o = whole ? output(a, b, kh, qr) : part.o + part.at(d, b, kh, c, qr) * H;
        o += col;
        const int64_t e = part.at(d, b, kh, c, qr);
        const bool seen = part.m[e] > -INFINITY;
        const vf l = splat(part.l[e]);
        for (int v = 0; v < kValueColumns / kLanes; ++v)
          store(o + v * kLanes, !whole ? acc[r][v] : seen ? (vf{} + acc[r][v]) / l : vf{});
      }
    }
  }
}

// out for row b, KV head kh, queries [q0, q1), over the row's `chunks` (> 1): each
// query's chunk sums rescaled to the largest maximum and added in chunk order, over
// their added denominators. A query that sees no slot outputs 0.
void merge(const Args& a, const Partials& part, int64_t b, int64_t kh, int64_t q0,
           int64_t q1, int64_t chunks) {
  const Shapes& d = a.s;
  const int64_t H = d.H;
  for (int64_t q = q0; q < q1; ++q) {
    float m = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part.m[part.at(d, b, kh, c, q)]);
    float* out = output(a, b, kh, q);
    std::fill(out, out + H, 0.0f);
    if (m == -INFINITY) continue;
    float l = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t e = part.at(d, b, kh, c, q);
      if (part.m[e] == -INFINITY) continue;
      const float w = std::exp(part.m[e] - m);  // 1 for the chunk that holds the maximum
      l += part.l[e] * w;
      for (int64_t h = 0; h < H; ++h) out[h] += part.o[e * H + h] * w;
    }
    for (int64_t h = 0; h < H; ++h) out[h] /= l;
  }
}

// `attend` for the pages' type and, over float32 pages, this item's query count
// (kFetchAheadQueries). Narrower pages never fetch ahead: the keys an item scores are
// its own widened copy, written just before and still in cache.
void attend_as(const Args& a, const Partials& part, int64_t b, int64_t kh, int64_t c,
               int64_t q0, int64_t q1) {
  switch (a.type) {
    case PageType::kF32:
      return q1 - q0 <= kFetchAheadQueries ? attend<true, float>(a, part, b, kh, c, q0, q1)
                                           : attend<false, float>(a, part, b, kh, c, q0, q1);
    case PageType::kBF16:
      return attend<false, uint16_t>(a, part, b, kh, c, q0, q1);
    case PageType::kS8:
      return attend<false, int8_t>(a, part, b, kh, c, q0, q1);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                          ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> table,
                          ffi::Buffer<ffi::S32> page_lens, ffi::Buffer<ffi::S32> new_start,
                          ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::PRED> mask,
                          ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                          float scale, float soft_cap, int64_t window,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), pd = k_pages.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || pd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("q must be [B, T, N, H], pages [L, K, P, Z, H], "
                                       "the table [B, M]");
  Shapes s{qd[0], qd[1], qd[2], qd[3], pd[0], pd[1], pd[2], pd[3], td[1], 0, false, false};
  if (pd[4] != s.H || s.H % kChunk != 0 || s.K == 0 || s.N % s.K != 0 || td[0] != s.B ||
      v_pages.element_count() != k_pages.element_count())
    return ffi::Error::InvalidArgument("pages, queries and table disagree in shape");
  PageType type;
  switch (k_pages.element_type()) {
    case ffi::DataType::F32: type = PageType::kF32; break;
    case ffi::DataType::BF16: type = PageType::kBF16; break;
    case ffi::DataType::S8: type = PageType::kS8; break;
    default: return ffi::Error::InvalidArgument("pages must be float32, bfloat16 or int8");
  }
  const bool scaled = type == PageType::kS8;
  const int64_t page_slots = s.L * s.K * s.P * s.Z;
  if (v_pages.element_type() != k_pages.element_type() ||
      k_scales.element_count() != (scaled ? page_slots : 0) ||
      v_scales.element_count() != k_scales.element_count())
    return ffi::Error::InvalidArgument("keys and values must share the pages' type; int8 "
                                       "pages need scales [L, K, P, Z], others none");
  s.G = s.N / s.K;
  s.has_mask = mask.element_count() != 0;
  s.has_new = k_new.element_count() != 0;
  if ((s.has_mask && mask.element_count() != s.B * s.T * s.T) ||
      (s.has_new && (k_new.element_count() != s.B * s.T * s.K * s.H ||
                     v_new.element_count() != k_new.element_count())))
    return ffi::Error::InvalidArgument("mask must be [B, T, T], new keys/values [B, T, K, H]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= s.L) return ffi::Error::InvalidArgument("layer out of range");

  const Args a{s, q.typed_data(), type, k_pages.untyped_data(), v_pages.untyped_data(),
               scaled ? k_scales.typed_data() : nullptr,
               scaled ? v_scales.typed_data() : nullptr, l,
               table.typed_data(), page_lens.typed_data(), new_start.typed_data(),
               q_lens.typed_data(), s.has_mask ? mask.typed_data() : nullptr,
               s.has_new ? k_new.typed_data() : nullptr,
               s.has_new ? v_new.typed_data() : nullptr, scale, soft_cap, window,
               out->typed_data()};
  // Items: rows x KV heads x chunks of slots, each split into blocks of queries when
  // rows x KV heads are fewer than threads (one row's tree verify over a short context):
  // every block reads its chunk's keys once more.
  int64_t most = 0;
  for (int64_t b = 0; b < s.B; ++b) most = std::max(most, row_slots(a, b).slots);
  const int64_t chunks = std::max<int64_t>(1, (most + kSlotChunk - 1) / kSlotChunk);
  const int64_t queries = s.T * s.G, parts = s.B * s.K * chunks;  // (row, head, chunk)s
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t split = 1;  // by rows x KV heads: a short context's one chunk carries the load
  while (s.B * s.K * split < 2 * threads && queries / (split * 2) >= kMinQueryBlock)
    split *= 2;
  const int64_t block = (queries + split - 1) / split;
  const int64_t per_part = (queries + block - 1) / block;
  // Partials (every entry read is written first, so the buffers are reused as they
  // are) and, for rows over several chunks, a count of chunks done per (row, head,
  // query block): the item that finishes the last chunk merges that block while the
  // other threads still attend.
  thread_local std::vector<float> maxima, sums, values;
  std::vector<std::atomic<int32_t>> done(chunks > 1 ? s.B * s.K * per_part : 0);
  maxima.resize(std::max<size_t>(maxima.size(), parts * queries));
  sums.resize(std::max<size_t>(sums.size(), parts * queries));
  if (chunks > 1) {
    values.resize(std::max<size_t>(values.size(), parts * queries * s.H));
    for (auto& n : done) n.store(0, std::memory_order_relaxed);
  }
  const Partials part{chunks, queries, maxima.data(), sums.data(), values.data()};
  specjax::parallel_items(pool, parts * per_part, threads, [&](int64_t k) {
    const int64_t item = k / per_part, qb = k % per_part, q0 = qb * block;
    const int64_t q1 = std::min(queries, q0 + block), bk = item / chunks, c = item % chunks;
    const int64_t b = bk / s.K, kh = bk % s.K;
    attend_as(a, part, b, kh, c, q0, q1);
    const int64_t row_chunks = chunks > 1 ? row_slots(a, b).chunks() : 1;
    if (row_chunks > 1 && c < row_chunks &&
        done[bk * per_part + qb].fetch_add(1, std::memory_order_acq_rel) + 1 == row_chunks)
      merge(a, part, b, kh, q0, q1, row_chunks);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specjax_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k_pages
                                  .Arg<ffi::AnyBuffer>()          // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scales
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // new_start
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_lens
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_new
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>());

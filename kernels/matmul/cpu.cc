// y = x w^T for XLA:CPU, as an XLA FFI custom call (see matmul/__init__.py): x [M, K] and w [N, K]
// (Hugging Face's [out, in] layout) in float32 or bfloat16, accumulated in float32, y [M, N] in
// float32 or bfloat16.
//
// Both operands are read along K, so a tile of MR rows of x and NR rows of w keeps MR x NR
// 8-lane accumulators in registers and sums each one horizontally at the end. 2 x 4: 8
// accumulators and 6 operand vectors in the 16 AVX registers, 6 loads per 8 multiply-adds (at 2
// loads a cycle the multiply-adds set the pace). A bfloat16 weight is widened in registers, so it
// streams from memory at half the bytes (two float32 vectors from each load, see Tile). Work items
// are blocks of rows of x (as many as fit in about 256 KB, so they stay in the L2 cache while a
// block of w passes over them) times blocks of 64 rows of w.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace jaxserve {
namespace {

constexpr int64_t kRowsOfW = 64;             // w rows per work item
constexpr int64_t kBytesOfX = 256 * 1024;    // x rows per work item: about this much
constexpr int kTileRows = 2, kTileCols = 4;  // x rows by w rows of one register tile
// A bfloat16 w is prefetched this far ahead of each row's reads. Widening costs instructions, so
// fewer bytes of w are in flight within the core's reorder window than for float32, whose
// streams the hardware prefetcher keeps up with alone (for them, prefetching gained nothing).
// One-row bfloat16 products are then faster than float32 ones (bench/RESULTS.md, "Products").
// Only the first tile of rows of x over a tile of w prefetches: the ones after it find w cached.
constexpr int64_t kBf16PrefetchBytes = 8192;
static_assert(kTileRows == 2, "Block leaves at most one row of x to a tile of its own");

inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) { return Bf16ToFloat(x); }

typedef uint32_t Words __attribute__((vector_size(32)));

inline Lanes AsLanes(Words w) {
  Lanes v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// y[i, j] = sum_k x[i, k] w[j, k] for i < MR, j < NR (x rows ldx apart, y rows ldy apart).
//
// A bfloat16 w is read 16 values of k at a time: one 32-byte load holds them as 8 words of
// (odd value << 16 | even value), and a shift widens the even ones to float32, a mask the odd
// ones, with no shuffles. x then comes with each whole block of 16 values reordered the same way:
// its 8 even values, then its 8 odd ones (`Deinterleave`); the tail past the last block as is.
template <int MR, int NR, typename W>
inline void Tile(const float* x, int64_t ldx, const W* w, int64_t k_len, float* y, int64_t ldy, bool prefetch) {
  constexpr bool kBf16 = std::is_same_v<W, uint16_t>;
  constexpr int64_t kStep = kBf16 ? 2 * kLanes : kLanes;
  Lanes acc[MR][NR] = {};
  int64_t k = 0;
  for (; k + kStep <= k_len; k += kStep) {
    Lanes xs[MR], odd[MR];
    for (int i = 0; i < MR; ++i) {
      xs[i] = Load(x + i * ldx + k);
      InRegister(xs[i]);
      if constexpr (kBf16) {
        odd[i] = Load(x + i * ldx + k + kLanes);
        InRegister(odd[i]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      if constexpr (kBf16) {
        if (prefetch) __builtin_prefetch(reinterpret_cast<const char*>(w + j * k_len + k) + kBf16PrefetchBytes);
        Words words;
        std::memcpy(&words, w + j * k_len + k, sizeof(words));
        const Lanes w_even = AsLanes(words << 16), w_odd = AsLanes(words & 0xFFFF0000u);
        for (int i = 0; i < MR; ++i) acc[i][j] += xs[i] * w_even + odd[i] * w_odd;
      } else {
        Lanes ws = Load(w + j * k_len + k);
        InRegister(ws);
        for (int i = 0; i < MR; ++i) acc[i][j] += xs[i] * ws;
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = Sum(acc[i][j]);
      for (int64_t t = k; t < k_len; ++t) s += x[i * ldx + t] * Widen(w[j * k_len + t]);
      y[i * ldy + j] = s;
    }
  }
}

// x [rows, k_len] in float32, each whole block of 16 values of a row reordered as Tile reads it
// against a bfloat16 w: the 8 even values, then the 8 odd ones.
template <typename X>
void Deinterleave(const X* x, int64_t rows, int64_t k_len, float* out) {
  const int64_t block = 2 * kLanes;
  for (int64_t r = 0; r < rows; ++r) {
    const X* src = x + r * k_len;
    float* dst = out + r * k_len;
    int64_t k = 0;
    for (; k + block <= k_len; k += block) {
      for (int64_t l = 0; l < kLanes; ++l) {
        dst[k + l] = Widen(src[k + 2 * l]);
        dst[k + kLanes + l] = Widen(src[k + 2 * l + 1]);
      }
    }
    for (; k < k_len; ++k) dst[k] = Widen(src[k]);
  }
}

template <int MR, typename W>
inline void TileRows(const float* x, int64_t ldx, const W* w, int64_t k_len, float* y, int64_t ldy, int64_t cols,
                     bool prefetch) {
  switch (cols) {
    case 4: return Tile<MR, 4>(x, ldx, w, k_len, y, ldy, prefetch);
    case 3: return Tile<MR, 3>(x, ldx, w, k_len, y, ldy, prefetch);
    case 2: return Tile<MR, 2>(x, ldx, w, k_len, y, ldy, prefetch);
    default: return Tile<MR, 1>(x, ldx, w, k_len, y, ldy, prefetch);
  }
}

// y[m0:m1, n0:n1] of y [M, N] = x [M, K] w [N, K]^T.
template <typename W>
void Block(const float* x, const W* w, float* y, int64_t n_len, int64_t k_len, int64_t m0, int64_t m1, int64_t n0,
           int64_t n1) {
  for (int64_t n = n0; n < n1; n += kTileCols) {
    const int64_t cols = std::min<int64_t>(kTileCols, n1 - n);
    const W* wn = w + n * k_len;
    int64_t m = m0;
    for (; m + kTileRows <= m1; m += kTileRows) {
      TileRows<kTileRows>(x + m * k_len, k_len, wn, k_len, y + m * n_len + n, n_len, cols, m == m0);
    }
    if (m < m1) TileRows<1>(x + m * k_len, k_len, wn, k_len, y + m * n_len + n, n_len, cols, m == m0);
  }
}

ffi::Error MatmulT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  for (ffi::DataType t : {x.element_type(), w.element_type(), y->element_type()}) {
    if (t != ffi::DataType::F32 && !IsBf16(t)) {
      return ffi::Error::InvalidArgument("matmul (cpu): operands must be float32 or bfloat16");
    }
  }
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("matmul (cpu): x must be [M, K] and w [N, K]");
  }
  const int64_t m_len = xd[0], n_len = wd[0], k_len = xd[1];
  // float32 views of x and y: the buffers themselves, or copies widened (x; reordered for a
  // bfloat16 w, see Tile) or to be rounded (y)
  const bool w_bf16 = IsBf16(w.element_type());
  std::vector<float> x_wide, y_wide;
  const float* xs = static_cast<const float*>(x.untyped_data());
  const bool x_bf16 = IsBf16(x.element_type());
  const uint16_t* x_bits = static_cast<const uint16_t*>(x.untyped_data());
  if (w_bf16 || x_bf16) {
    x_wide.resize(m_len * k_len);
    if (w_bf16 && x_bf16) {
      Deinterleave(x_bits, m_len, k_len, x_wide.data());
    } else if (w_bf16) {
      Deinterleave(xs, m_len, k_len, x_wide.data());
    } else {
      for (int64_t i = 0; i < m_len * k_len; ++i) x_wide[i] = Bf16ToFloat(x_bits[i]);
    }
    xs = x_wide.data();
  }
  const bool y_bf16 = IsBf16(y->element_type());
  if (y_bf16) y_wide.resize(m_len * n_len);
  float* ys = y_bf16 ? y_wide.data() : static_cast<float*>(y->untyped_data());

  const int64_t rows_of_x =
      std::max<int64_t>(kTileRows, kBytesOfX / (4 * std::max<int64_t>(k_len, 1)) / kTileRows * kTileRows);
  const int64_t m_blocks = (m_len + rows_of_x - 1) / rows_of_x;
  const int64_t n_blocks = (n_len + kRowsOfW - 1) / kRowsOfW;
  const void* ws = w.untyped_data();
  ParallelFor(pool, m_blocks * n_blocks, [&](int64_t item, std::vector<float>&) {
    const int64_t m0 = item % m_blocks * rows_of_x, n0 = item / m_blocks * kRowsOfW;
    const int64_t m1 = std::min(m_len, m0 + rows_of_x), n1 = std::min(n_len, n0 + kRowsOfW);
    if (w_bf16) {
      Block(xs, static_cast<const uint16_t*>(ws), ys, n_len, k_len, m0, m1, n0, n1);
    } else {
      Block(xs, static_cast<const float*>(ws), ys, n_len, k_len, m0, m1, n0, n1);
    }
  });
  if (y_bf16) {
    uint16_t* bits = static_cast<uint16_t*>(y->untyped_data());
    for (int64_t i = 0; i < m_len * n_len; ++i) bits[i] = FloatToBf16(y_wide[i]);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulT, jaxserve::MatmulT,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());

// y = x w^T for XLA:CPU, as an XLA FFI custom call (see matmul/__init__.py): x [M, K] and w [N, K]
// (Hugging Face's [out, in] layout) in float32 or bfloat16, accumulated in float32, y [M, N] in
// float32 or bfloat16. One form per regime; their measurements are in bench/RESULTS.md ("Products",
// "Products of 16 rows and more", "Products on the CPU's bfloat16 instructions").
//
// Dot form (Tile), under kPanelMinRows rows of x: the product is bounded by reading w once.
// - Both operands are read along K; a tile of MR rows of x and NR rows of w keeps MR x NR 8-lane
//   accumulators in registers, summed horizontally at the end. A float32 w takes 3 x 4 tiles: 12
//   accumulators, 3 vectors of x and one of w fill the 16 AVX registers.
// - A bfloat16 w is widened in registers, so it streams from memory at half the bytes; each row of x
//   then takes two vectors, so its tiles are 2 x 4.
// - Work items are blocks of rows of x that fit in L2 (about 256 KB) times blocks of about 64 rows of
//   w (ForEachBlock). Within an item each tile's rows of x stay in L1 while the block of w passes,
//   so no operand comes from L2 more than once.
// - A tile's NR rows of w are a quarter of the block apart (rows t, t + 16, t + 32, t + 48 of 64), not
//   adjacent: each of its NR streams then runs on through consecutive rows, and the hardware
//   prefetcher keeps ahead of it.
//
// Panel form (PanelTile), from kPanelMinRows rows on: the product is bounded by the multiply-adds,
// and the dot form's loads and horizontal sums would hold it to about half the peak.
// - x is packed into panels of 16 rows, transposed ([k][16]: two vectors per k); a tile multiplies the
//   two vectors of one k by 6 values of w, each broadcast: 12 accumulators, 2 + 6 loads per 12
//   multiply-adds, no horizontal sums. Its accumulators hold columns of y, scattered once per tile.
// - A bfloat16 w is widened first, the tile's 6 rows at a time, into a buffer every panel reads; the
//   6 rows are a sixth of the block apart, as above. Under 16 rows a panel would be mostly zeros.
//
// Pair forms, where the CPU multiplies bfloat16 itself (AVX512_BF16), for bfloat16 x and w (even K):
// `vdpbf16ps` multiplies 16 pairs of bfloat16 values and adds both products of each pair to a float32
// lane, 32 multiply-adds per instruction with w never widened (the products are exact in float32;
// only the order of the sums changes).
// - From 16 rows on, PairPanelTile: x in panels of 16 rows whose lane r holds row r's pair (k, k + 1)
//   as one 32-bit word, one pair of a row of w broadcast per k pair, 3 panels x 8 adjacent rows of w
//   per tile (24 accumulators of the 32 AVX-512 registers), at every row count. A tile's sums are
//   transposed in registers and stored a row of y at a time, rounded there for a bfloat16 y: y is
//   written in its own dtype (no float32 copy to zero, then round).
// - Under 16 rows, PairTile: 32 values of k of a row of x and of w per instruction, both as they lie
//   in memory (no shifts, no reordered copy of x).
//
// Several weights of one x in one call (ManyMatmulT: q, k and v; gate and up): x packed once, every
// weight's work items handed to the threads together. Gated (gate and up, one y), each item's blocks
// of both products are rounded to y's dtype and SwiGLU's silu(gate) * up applied to them as they are
// computed (Item), where a pass of its own read both whole products back (GatedSilu).
//
// Tile form, where the CPU has AMX and Linux permits its tiles, for bfloat16 x and w with K a multiple
// of 32, from kAmxMinRows rows on: w's rows read in place as the tile unit's A operand (amx.h), 16 x 16
// sums of 32 products per instruction; the same products as the pair forms, summed in another order.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "common.h"

namespace jaxserve {
namespace {

constexpr int64_t kRowsOfW = 64;             // w rows per work item, about (ForEachBlock)
constexpr int64_t kBytesOfX = 256 * 1024;    // x rows per work item: about this much
constexpr int kTileCols = 4;  // w rows of one register tile
template <typename W>
constexpr int kTileRows = std::is_same_v<W, float> ? 3 : 2;  // x rows of one register tile (see the top)
constexpr int64_t kPanelMinRows = 16;  // from this many rows of x on, the panel form (see the top)
constexpr int64_t kPanelRows = 2 * kLanes;  // x rows of one panel
constexpr int kPanelTileCols = 6;           // w rows of one panel tile
constexpr int64_t kPanelRowsOfW = 96;       // the same in the panel form
// From this many rows of x on, the tile form where permitted (matmul/__init__.py's AMX_MIN_ROWS).
constexpr int64_t kAmxMinRows = 8;

inline Lanes AsLanes(Words w) {
  Lanes v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// y[i, j * stride] = sum_k x[i, k] w[j * stride, k] for i < MR, j < NR (x rows ldx apart, y rows
// ldy apart; the tile's rows of w and columns of y `stride` apart).
//
// A bfloat16 w is read 16 values of k at a time: one 32-byte load holds them as 8 words of
// (odd value << 16 | even value), and a shift widens the even ones to float32, a mask the odd
// ones, with no shuffles. x then comes with each whole block of 16 values reordered the same way:
// its 8 even values, then its 8 odd ones (`Deinterleave`); the tail past the last block as is.
template <int MR, int NR, typename W>
inline void Tile(const float* x, int64_t ldx, const W* w, int64_t k_len, float* y, int64_t ldy, int64_t stride) {
  constexpr bool kBf16 = std::is_same_v<W, uint16_t>;
  constexpr int64_t kStep = kBf16 ? 2 * kLanes : kLanes;
  const int64_t ldw = stride * k_len;
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
        Words words;
        std::memcpy(&words, w + j * ldw + k, sizeof(words));
        const Lanes w_even = AsLanes(words << 16), w_odd = AsLanes(words & 0xFFFF0000u);
        for (int i = 0; i < MR; ++i) acc[i][j] += xs[i] * w_even + odd[i] * w_odd;
      } else {
        Lanes ws = Load(w + j * ldw + k);
        InRegister(ws);
        for (int i = 0; i < MR; ++i) acc[i][j] += xs[i] * ws;
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = Sum(acc[i][j]);
      for (int64_t t = k; t < k_len; ++t) s += x[i * ldx + t] * Widen(w[j * ldw + t]);
      y[i * ldy + j * stride] = s;
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
                     int64_t stride) {
  switch (cols) {
    case 4: return Tile<MR, 4>(x, ldx, w, k_len, y, ldy, stride);
    case 3: return Tile<MR, 3>(x, ldx, w, k_len, y, ldy, stride);
    case 2: return Tile<MR, 2>(x, ldx, w, k_len, y, ldy, stride);
    default: return Tile<MR, 1>(x, ldx, w, k_len, y, ldy, stride);
  }
}

// The block [m0:m1, n0:n1] of x [M, K] w [N, K]^T, at y (rows ldy apart). Tile t takes rows n0 + t +
// c * stride of w, c < kTileCols (see the top of the file).
template <typename W>
void Block(const float* x, const W* w, float* y, int64_t ldy, int64_t k_len, int64_t m0, int64_t m1, int64_t n0,
           int64_t n1) {
  const int64_t stride = (n1 - n0 + kTileCols - 1) / kTileCols;
  for (int64_t m = m0; m < m1; m += kTileRows<W>) {
    const int64_t rows = std::min<int64_t>(kTileRows<W>, m1 - m);
    for (int64_t t = 0; t < stride; ++t) {
      const int64_t n = n0 + t, cols = (n1 - n + stride - 1) / stride;
      const float* xm = x + m * k_len;
      const W* wn = w + n * k_len;
      float* ym = y + (m - m0) * ldy + t;
      if (rows == kTileRows<W>) {
        TileRows<kTileRows<W>>(xm, k_len, wn, k_len, ym, ldy, cols, stride);
      } else if (rows == 2) {
        TileRows<2>(xm, k_len, wn, k_len, ym, ldy, cols, stride);
      } else {
        TileRows<1>(xm, k_len, wn, k_len, ym, ldy, cols, stride);
      }
    }
  }
}

// The 8 x 8 block in r transposed in place: r[j][i] becomes r[i][j].
inline void Transpose8(Lanes r[8]) {
  Lanes t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved: within each half, i0 i1 i0 i1 ...
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {  // then pairs of pairs: columns c and c + 4 of four rows
    for (int j = 0; j < 2; ++j) {
      u[i + 2 * j] = __builtin_shufflevector(t[i + j], t[i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[i + 2 * j + 1] = __builtin_shufflevector(t[i + j], t[i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  }
  for (int j = 0; j < 4; ++j) {  // then the halves of rows 0-3 and 4-7 joined
    r[j] = __builtin_shufflevector(u[j], u[j + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[j + 4] = __builtin_shufflevector(u[j], u[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// Panels of x [rows, k_len], widened to float32: panel p holds rows 16p to 16p + 15 as
// out[p][k][0:16] (rows past the last one are zeros), 8 rows x 8 values of k at a time.
template <typename X>
void PackPanels(const X* x, int64_t rows, int64_t k_len, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    float* half = out + r0 / kPanelRows * kPanelRows * k_len + r0 % kPanelRows;
    const int64_t n = std::min(kLanes, rows - r0);
    int64_t k = 0;
    for (; k + kLanes <= k_len; k += kLanes) {
      Lanes r[kLanes] = {};
      for (int64_t i = 0; i < n; ++i) r[i] = Load(x + (r0 + i) * k_len + k);
      Transpose8(r);
      for (int64_t j = 0; j < kLanes; ++j) Store(half + (k + j) * kPanelRows, r[j]);
    }
    for (; k < k_len; ++k) {
      for (int64_t i = 0; i < kLanes; ++i) half[k * kPanelRows + i] = i < n ? Widen(x[(r0 + i) * k_len + k]) : 0.f;
    }
  }
  if (rows % kPanelRows > 0 && rows % kPanelRows <= kLanes) {  // the last panel's second half: zeros
    float* half = out + rows / kPanelRows * kPanelRows * k_len + kLanes;
    for (int64_t k = 0; k < k_len; ++k) std::memset(half + k * kPanelRows, 0, kLanes * sizeof(float));
  }
}

// c[j][0:16] = sum_k panel[k][0:16] w[j * ldw + k] for j < NR: one panel of x against NR rows of w.
template <int NR>
inline void PanelTile(const float* panel, const float* w, int64_t ldw, int64_t k_len, float* c) {
  Lanes acc[2][NR] = {};
  for (int64_t k = 0; k < k_len; ++k) {
    Lanes low = Load(panel + k * kPanelRows), high = Load(panel + k * kPanelRows + kLanes);
    InRegister(low);
    InRegister(high);
    for (int j = 0; j < NR; ++j) {
      const float s = w[j * ldw + k];
      const Lanes b = {s, s, s, s, s, s, s, s};  // (a broadcast load; `s + Lanes{}` costs an add first)
      acc[0][j] += low * b;
      acc[1][j] += high * b;
    }
  }
  for (int j = 0; j < NR; ++j) {
    Store(c + j * kPanelRows, acc[0][j]);
    Store(c + j * kPanelRows + kLanes, acc[1][j]);
  }
}

inline void PanelTileCols(const float* panel, const float* w, int64_t ldw, int64_t k_len, float* c, int64_t cols) {
  switch (cols) {
    case 6: return PanelTile<6>(panel, w, ldw, k_len, c);
    case 5: return PanelTile<5>(panel, w, ldw, k_len, c);
    case 4: return PanelTile<4>(panel, w, ldw, k_len, c);
    case 3: return PanelTile<3>(panel, w, ldw, k_len, c);
    case 2: return PanelTile<2>(panel, w, ldw, k_len, c);
    default: return PanelTile<1>(panel, w, ldw, k_len, c);
  }
}

// The block [m0:m1, n0:n1] of x w [N, K]^T, x as panels (m0 a multiple of 16), at y (rows ldy apart).
// Tile t takes rows n0 + t + c * stride of w, c < kPanelTileCols; `wide` holds them widened when w is
// bfloat16.
template <typename W>
void PanelBlock(const float* panels, const W* w, float* y, int64_t ldy, int64_t k_len, int64_t m0, int64_t m1,
                int64_t n0, int64_t n1, std::vector<float>& wide) {
  constexpr bool kBf16 = std::is_same_v<W, uint16_t>;
  const int64_t stride = (n1 - n0 + kPanelTileCols - 1) / kPanelTileCols;
  if constexpr (kBf16) wide.resize(kPanelTileCols * k_len);
  float c[kPanelTileCols * kPanelRows];
  for (int64_t t = 0; t < stride; ++t) {
    const int64_t n = n0 + t, cols = (n1 - n + stride - 1) / stride;
    const float* wt;
    int64_t ldw;
    if constexpr (kBf16) {
      int64_t k = 0;  // (the rows side by side, as PanelTile streams a float32 w: faster than row by row)
      for (; k + kLanes <= k_len; k += kLanes) {
        for (int64_t j = 0; j < cols; ++j) Store(wide.data() + j * k_len + k, Load(w + (n + j * stride) * k_len + k));
      }
      for (; k < k_len; ++k) {
        for (int64_t j = 0; j < cols; ++j) wide[j * k_len + k] = Widen(w[(n + j * stride) * k_len + k]);
      }
      wt = wide.data();
      ldw = k_len;
    } else {
      wt = w + n * k_len;
      ldw = stride * k_len;
    }
    for (int64_t m = m0; m < m1; m += kPanelRows) {
      PanelTileCols(panels + m * k_len, wt, ldw, k_len, c, cols);
      for (int64_t j = 0; j < cols; ++j) {
        for (int64_t i = 0; i < std::min(kPanelRows, m1 - m); ++i) {
          y[(m - m0 + i) * ldy + t + j * stride] = c[j * kPanelRows + i];
        }
      }
    }
  }
}

#if defined(__AVX512BF16__)
constexpr int kPairPanels = 3;     // panels of one bfloat16 panel tile
constexpr int kPairTileCols = 8;  // w rows of one bfloat16 panel tile
constexpr int64_t kPairRowsOfW = 96;  // w rows per work item, about (ForEachBlock)

// Panels of a bfloat16 x [rows, k_len] (k_len even) for vdpbf16ps: panel p holds rows 16p to
// 16p + 15 as out[p][k / 2][0:16], each the row's values k and k + 1 as one 32-bit word (the first
// in the low half, as in memory); rows past the last one are zeros. 16 rows x 16 words at a time,
// transposed in registers (word by word, the packing took a few percent of a prefill's products,
// on one thread while the others waited).
void PackPairPanels(const uint16_t* x, int64_t rows, int64_t k_len, uint32_t* out) {
  const int64_t pairs = k_len / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += kPanelRows) {
    uint32_t* panel = out + r0 * pairs;
    const int64_t n = std::min(kPanelRows, rows - r0);
    int64_t p = 0;
    for (; p + kPanelRows <= pairs; p += kPanelRows) {
      __m512 r[kPanelRows];
      for (int64_t i = 0; i < kPanelRows; ++i) {  // (a masked load of rows past the last: no access, zeros)
        const __mmask16 row = i < n ? 0xFFFF : 0;
        r[i] = _mm512_maskz_loadu_ps(row, reinterpret_cast<const float*>(x + (r0 + i) * k_len + 2 * p));
      }
      Transpose16(r);
      for (int64_t j = 0; j < kPanelRows; ++j) {
        _mm512_storeu_ps(reinterpret_cast<float*>(panel + (p + j) * kPanelRows), r[j]);
      }
    }
    for (; p < pairs; ++p) {
      for (int64_t i = 0; i < kPanelRows; ++i) {
        uint32_t word = 0;
        if (i < n) std::memcpy(&word, x + (r0 + i) * k_len + 2 * p, sizeof(word));
        panel[p * kPanelRows + i] = word;
      }
    }
  }
}

// c[i][j][0:16] = sum_k panels[i][k][0:16] w[j * k_len + k] for i < MP, j < NR: MP panels of x
// (panel_words apart) against NR adjacent rows of a bfloat16 w, one pair of k per step; c in
// float32, each panel's 16 slots of columns apart (StoreTransposed's 16 x 16 sums).
template <int MP, int NR>
void PairPanelTile(const uint32_t* panels, int64_t panel_words, const uint16_t* w, int64_t k_len, int64_t pairs,
                   float* c) {
  __m512 acc[MP][NR];
  for (int i = 0; i < MP; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  const char* next = reinterpret_cast<const char*>(w + kPairTileCols * k_len);  // the next tile's rows
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(next + 32 * p, _MM_HINT_T0);  // (32 bytes a step: all of them by the last step)
    __m512bh xs[MP];
    for (int i = 0; i < MP; ++i) xs[i] = (__m512bh)_mm512_loadu_si512(panels + i * panel_words + p * kPanelRows);
    for (int j = 0; j < NR; ++j) {
      uint32_t word;
      std::memcpy(&word, w + j * k_len + 2 * p, sizeof(word));
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      for (int i = 0; i < MP; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xs[i], b);
    }
  }
  for (int i = 0; i < MP; ++i) {
    for (int j = 0; j < NR; ++j) _mm512_store_ps(c + (i * kPanelRows + j) * kPanelRows, acc[i][j]);
  }
}

template <int MP, int... NR>
constexpr auto PairPanelTiles(std::integer_sequence<int, NR...>) {
  return std::array{&PairPanelTile<MP, NR + 1>...};
}

// The block [m0:m1, n0:n1] of x w [N, K]^T, x as pair panels (m0 a multiple of 16), w bfloat16, at y
// (rows ldy apart) in float32 or bfloat16 (rounded to nearest even, values under float32's normal
// range flushed to zero). A tile takes kPairTileCols adjacent rows of w, so that its sums land in adjacent columns of
// y, stored a row at a time once transposed (StoreTransposed); one value at a time, scattered, they
// cost a twentieth of a prefill's products. Every tile of a group of panels runs before the next
// group's: the group's rows of y then stay in the cache while its tiles' sums are stored.
template <typename Y>
void PairPanelBlock(const uint32_t* panels, const uint16_t* w, Y* y, int64_t ldy, int64_t k_len, int64_t m0,
                    int64_t m1, int64_t n0, int64_t n1) {
  static_assert(kPairPanels == 3, "one row of kTiles per panel count");
  static constexpr auto kCols = std::make_integer_sequence<int, kPairTileCols>();
  constexpr std::array kTiles{PairPanelTiles<1>(kCols), PairPanelTiles<2>(kCols), PairPanelTiles<3>(kCols)};
  const int64_t pairs = k_len / 2, panel_words = kPanelRows * pairs;
  alignas(64) float c[kPairPanels * kPanelRows * kPanelRows] = {};  // (slots past a tile's columns: never stored)
  for (int64_t m = m0; m < m1; m += kPairPanels * kPanelRows) {
    const int64_t panels_here = std::min<int64_t>(kPairPanels, CeilDiv(m1 - m, kPanelRows));
    for (int64_t n = n0; n < n1; n += kPairTileCols) {
      const int64_t cols = std::min<int64_t>(kPairTileCols, n1 - n);
      kTiles[panels_here - 1][cols - 1](panels + m / kPanelRows * panel_words, panel_words, w + n * k_len, k_len,
                                        pairs, c);
      for (int64_t i = 0; i < panels_here; ++i) {
        StoreTransposed(c + i * kPanelRows * kPanelRows, std::min(kPanelRows, m1 - m - i * kPanelRows), cols,
                        y + (m - m0 + i * kPanelRows) * ldy + (n - n0), ldy);
      }
    }
  }
}

// The dot form on bfloat16 x and w (under 16 rows): y[i, j * stride] = sum_k x[i, k] w[j * stride, k]
// for i < MR, j < NR, 32 values of k per instruction (both operands as they lie in memory: lane l
// of a vdpbf16ps multiplies the pairs 2l, 2l + 1 of each), the tail past the last 32 one by one.
template <int MR, int NR>
void PairTile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k_len, float* y, int64_t ldy,
              int64_t stride) {
  const int64_t ldw = stride * k_len;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 32 <= k_len; k += 32) {
    __m512bh xs[MR];
    for (int i = 0; i < MR; ++i) xs[i] = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
    for (int j = 0; j < NR; ++j) {
      const __m512bh ws = (__m512bh)_mm512_loadu_si512(w + j * ldw + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xs[i], ws);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t t = k; t < k_len; ++t) s += Bf16ToFloat(x[i * ldx + t]) * Bf16ToFloat(w[j * ldw + t]);
      y[i * ldy + j * stride] = s;
    }
  }
}

template <int MR, int... NR>
constexpr auto PairTiles(std::integer_sequence<int, NR...>) {
  return std::array{&PairTile<MR, NR + 1>...};
}

// Block on bfloat16 x and w: the same work items and tiles of w (kTileCols rows a quarter of the
// block apart), kPairTileRows rows of x per tile.
constexpr int kPairTileRows = 3;
void PairBlock(const uint16_t* x, const uint16_t* w, float* y, int64_t ldy, int64_t k_len, int64_t m0, int64_t m1,
               int64_t n0, int64_t n1) {
  static_assert(kPairTileRows == 3, "one row of kTiles per row count");
  static constexpr auto kCols = std::make_integer_sequence<int, kTileCols>();
  static constexpr std::array kTiles{PairTiles<1>(kCols), PairTiles<2>(kCols), PairTiles<3>(kCols)};
  const int64_t stride = (n1 - n0 + kTileCols - 1) / kTileCols;
  for (int64_t m = m0; m < m1; m += kPairTileRows) {
    const int64_t rows = std::min<int64_t>(kPairTileRows, m1 - m);
    for (int64_t t = 0; t < stride; ++t) {
      const int64_t n = n0 + t, cols = (n1 - n + stride - 1) / stride;
      kTiles[rows - 1][cols - 1](x + m * k_len, k_len, w + n * k_len, k_len, y + (m - m0) * ldy + t, ldy, stride);
    }
  }
}
#endif  // __AVX512BF16__

// One product of a call (Products): y [M, n_len] = x w^T, or, gated (`up` set), y = silu(x w^T) *
// (x up^T) with both products rounded to y's dtype first: GatedSilu's values from two products' ys.
struct Target {
  const void* w;
  const void* up;  // nullptr: not gated
  int64_t n_len;
  void* y;
};

// Target t's block [m0:m1, n0:n1] of y from `sums(w, dst, ld)`, a form's float32 sums of that block
// of x w^T at dst (rows ld apart): straight into a float32 y, else into a buffer, then rounded (and,
// gated, silu(gate) * up) into y.
template <typename Sums>
void Item(const Target& t, bool y_bf16, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Sums& sums) {
  const int64_t rows = m1 - m0, cols = n1 - n0, ld = t.n_len;
  if (!y_bf16 && !t.up) return sums(t.w, static_cast<float*>(t.y) + m0 * ld + n0, ld);
  const int64_t sums_count = (t.up ? 2 : 1) * rows * cols;
  // the sums, then (gated) two rows of bits; kept for the thread's next item (an item's blocks of x
  // reach a megabyte of sums, which a fresh allocation would map anew each time)
  thread_local std::vector<float> buffer;
  buffer.resize(sums_count + (t.up ? cols : 0));
  float* gate = buffer.data();
  float* up = t.up ? gate + rows * cols : nullptr;
  sums(t.w, gate, cols);
  if (up) sums(t.up, up, cols);
  uint16_t* bits = reinterpret_cast<uint16_t*>(buffer.data() + sums_count);
  for (int64_t i = 0; i < rows; ++i) {
    const float* g = gate + i * cols;
    if (up) {
      GatedRow(g, up + i * cols, cols, y_bf16, t.y, (m0 + i) * ld + n0, bits);
    } else {  // (a bfloat16 y: a float32 one is written in place above)
      RoundValues(g, cols, static_cast<uint16_t*>(t.y) + (m0 + i) * ld + n0);
    }
  }
}

// The targets' products of x [M, K] (their weights N x K, bfloat16 bits where w_bf16, else float32; their
// ys of y_bf16) for x's first m_len rows, x packed once and every target's work items handed to the
// threads together. The form follows from M, as in every step of the same bucket whatever its
// padding, so that a row's values do not depend on the others'. Rows from m_len on are the caller's.
void Products(ffi::ThreadPool pool, ffi::AnyBuffer x, int64_t m_len, bool w_bf16, bool y_bf16,
              const std::vector<Target>& targets) {
  const int64_t m_form = x.dimensions()[0], k_len = x.dimensions()[1];
  if (m_len == 0) return;
  const bool x_bf16 = IsBf16(x.element_type());
  const float* x_f32 = static_cast<const float*>(x.untyped_data());
  const uint16_t* x_bits = static_cast<const uint16_t*>(x.untyped_data());
  std::vector<int64_t> starts{0};  // where each target's columns start among all of them
  for (const Target& t : targets) starts.push_back(starts.back() + t.n_len);
  auto items = [&](int64_t rows_of_x, int64_t rows_of_w, int64_t tile_cols, const auto& item) {
    ForEachBlockOf(pool, m_len, starts, rows_of_x, rows_of_w, tile_cols,
                   [&](size_t i, int64_t m0, int64_t m1, int64_t n0, int64_t n1, std::vector<float>& scratch) {
      item(targets[i], m0, m1, n0, n1, scratch);
    });
  };
#if defined(JAXSERVE_AMX)  // (one weight at a time: a gated target's pair goes on to the pair panels)
  if (m_form >= kAmxMinRows && x_bf16 && w_bf16 && k_len % amx::kTileK == 0 && amx::TilesPermitted() &&
      std::none_of(targets.begin(), targets.end(), [](const Target& t) { return t.up; })) {
    for (const Target& t : targets) {
      const auto rows = amx::RowsInPlace(static_cast<const uint16_t*>(t.w), t.n_len, k_len);
      if (y_bf16) {  // (rounded as each block is stored)
        amx::TileProduct(pool, x_bits, m_len, k_len, t.n_len, static_cast<uint16_t*>(t.y), kRowsOfW, rows);
      } else {
        amx::TileProduct(pool, x_bits, m_len, k_len, t.n_len, static_cast<float*>(t.y), kRowsOfW, rows);
      }
    }
    return;
  }
#endif
#if defined(__AVX512BF16__)
  if (m_form >= kPanelMinRows && x_bf16 && w_bf16 && k_len % 2 == 0) {
    std::unique_ptr<uint32_t[]> pairs(new uint32_t[CeilDiv(m_len, kPanelRows) * kPanelRows * k_len / 2]);
    PackPairPanels(x_bits, m_len, k_len, pairs.get());
    const int64_t rows_of_x =  // panels per work item: about kBytesOfX, so they stay in the L2 cache
        std::max<int64_t>(1, kBytesOfX / (2 * kPanelRows * std::max<int64_t>(k_len, 1))) * kPanelRows;
    items(rows_of_x, kPairRowsOfW, kPairTileCols, [&](const Target& t, int64_t m0, int64_t m1, int64_t n0,
                                                      int64_t n1, std::vector<float>&) {
      auto block = [&](const void* w, auto* y, int64_t ld) {
        PairPanelBlock(pairs.get(), static_cast<const uint16_t*>(w), y, ld, k_len, m0, m1, n0, n1);
      };
      if (y_bf16 && !t.up) {  // (rounded as stored)
        return block(t.w, static_cast<uint16_t*>(t.y) + m0 * t.n_len + n0, t.n_len);
      }
      Item(t, y_bf16, m0, m1, n0, n1, [&](const void* w, float* y, int64_t ld) { block(w, y, ld); });
    });
    return;
  }
#endif
  std::vector<float> x_wide;  // x packed, widened or reordered for the form
  if (m_form >= kPanelMinRows) {
    x_wide.resize((m_len + kPanelRows - 1) / kPanelRows * kPanelRows * k_len);
    if (x_bf16) {
      PackPanels(x_bits, m_len, k_len, x_wide.data());
    } else {
      PackPanels(x_f32, m_len, k_len, x_wide.data());
    }
    const int64_t rows_of_x =  // panels per work item: about kBytesOfX, so they stay in the L2 cache
        std::max<int64_t>(1, kBytesOfX / (4 * kPanelRows * std::max<int64_t>(k_len, 1))) * kPanelRows;
    items(rows_of_x, kPanelRowsOfW, kPanelTileCols, [&](const Target& t, int64_t m0, int64_t m1, int64_t n0,
                                                        int64_t n1, std::vector<float>& wide) {
      Item(t, y_bf16, m0, m1, n0, n1, [&](const void* w, float* y, int64_t ld) {
        if (w_bf16) {
          PanelBlock(x_wide.data(), static_cast<const uint16_t*>(w), y, ld, k_len, m0, m1, n0, n1, wide);
        } else {
          PanelBlock(x_wide.data(), static_cast<const float*>(w), y, ld, k_len, m0, m1, n0, n1, wide);
        }
      });
    });
    return;
  }
#if defined(__AVX512BF16__)
  if (x_bf16 && w_bf16) {
    const int64_t rows_of_x = std::max<int64_t>(
        kPairTileRows, kBytesOfX / (2 * std::max<int64_t>(k_len, 1)) / kPairTileRows * kPairTileRows);
    items(rows_of_x, kRowsOfW, kTileCols, [&](const Target& t, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                                               std::vector<float>&) {
      Item(t, y_bf16, m0, m1, n0, n1, [&](const void* w, float* y, int64_t ld) {
        PairBlock(x_bits, static_cast<const uint16_t*>(w), y, ld, k_len, m0, m1, n0, n1);
      });
    });
    return;
  }
#endif
  // x in float32: the buffer itself, or a copy widened (and reordered for a bfloat16 w, see Tile)
  const float* xs = x_f32;
  if (w_bf16 || x_bf16) {
    x_wide.resize(m_len * k_len);
    if (w_bf16 && x_bf16) {
      Deinterleave(x_bits, m_len, k_len, x_wide.data());
    } else if (w_bf16) {
      Deinterleave(x_f32, m_len, k_len, x_wide.data());
    } else {
      for (int64_t i = 0; i < m_len * k_len; ++i) x_wide[i] = Bf16ToFloat(x_bits[i]);
    }
    xs = x_wide.data();
  }
  const int64_t tile_rows = w_bf16 ? kTileRows<uint16_t> : kTileRows<float>;
  const int64_t rows_of_x =
      std::max<int64_t>(tile_rows, kBytesOfX / (4 * std::max<int64_t>(k_len, 1)) / tile_rows * tile_rows);
  items(rows_of_x, kRowsOfW, kTileCols, [&](const Target& t, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                                             std::vector<float>&) {
    Item(t, y_bf16, m0, m1, n0, n1, [&](const void* w, float* y, int64_t ld) {
      if (w_bf16) {
        Block(xs, static_cast<const uint16_t*>(w), y, ld, k_len, m0, m1, n0, n1);
      } else {
        Block(xs, static_cast<const float*>(w), y, ld, k_len, m0, m1, n0, n1);
      }
    });
  });
}

// y = x ws^T for x [M, K] and ws the N x K matrix at `ws` (bfloat16 bits where w_bf16, else float32),
// computed for x's first m_len rows (its other rows' y zero).
ffi::Error Product(ffi::ThreadPool pool, ffi::AnyBuffer x, int64_t m_len, const void* ws, bool w_bf16,
                   int64_t n_len, ffi::Result<ffi::AnyBuffer> y) {
  ZeroRowsFrom(y, m_len);
  Products(pool, x, m_len, w_bf16, IsBf16(y->element_type()), {{ws, nullptr, n_len, y->untyped_data()}});
  return ffi::Error::Success();
}


bool IsFloat(ffi::DataType t) { return t == ffi::DataType::F32 || IsBf16(t); }

// y = x w^T for x's first `live` rows (`LiveRows`), the rest zero.
ffi::Error MatmulT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer live,
                   ffi::Result<ffi::AnyBuffer> y) {
  if (!IsFloat(x.element_type()) || !IsFloat(w.element_type()) || !IsFloat(y->element_type())) {
    return ffi::Error::InvalidArgument("matmul (cpu): operands must be float32 or bfloat16");
  }
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("matmul (cpu): x must be [M, K] and w [N, K]");
  }
  return Product(pool, x, LiveRows(live, xd[0]), w.untyped_data(), IsBf16(w.element_type()), wd[0], y);
}

// Several weights [N_i, K] of one float dtype against the same x [M, K], for x's first `live` rows (the
// rest zero), in one call (Products): each with its own y, or, `gated`, two (gate and up) with one y,
// silu(x gate^T) * (x up^T) (Target).
ffi::Error ManyMatmulT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer live, ffi::RemainingArgs ws,
                       ffi::RemainingRets ys, int64_t gated) {
  const size_t per_y = gated ? 2 : 1;
  if (ys.size() == 0 || ws.size() != per_y * ys.size() || !IsFloat(x.element_type()) || x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("matmul (cpu): x [M, K] and one weight per y (gated: two)");
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], m_len = LiveRows(live, m);
  const ffi::DataType w_type = ws.get<ffi::AnyBuffer>(0)->element_type();
  const ffi::DataType y_type = (*ys.get<ffi::AnyBuffer>(0))->element_type();
  std::vector<Target> targets;
  for (size_t i = 0; i < ys.size(); ++i) {
    ffi::Result<ffi::AnyBuffer> y = *ys.get<ffi::AnyBuffer>(i);
    ffi::AnyBuffer w = *ws.get<ffi::AnyBuffer>(per_y * i), up = *ws.get<ffi::AnyBuffer>(per_y * i + per_y - 1);
    auto wd = w.dimensions(), yd = y->dimensions();
    if (!IsFloat(w_type) || w.element_type() != w_type || up.element_type() != w_type || !IsFloat(y_type) ||
        y->element_type() != y_type || wd.size() != 2 || wd[1] != k || up.dimensions().size() != 2 ||
        up.dimensions()[0] != wd[0] || up.dimensions()[1] != k || yd.size() != 2 || yd[0] != m || yd[1] != wd[0]) {
      return ffi::Error::InvalidArgument("matmul (cpu): weights [N, K] of one float dtype, ys [M, N] of one");
    }
    ZeroRowsFrom(y, m_len);
    targets.push_back({w.untyped_data(), gated ? up.untyped_data() : nullptr, wd[0], y->untyped_data()});
  }
  Products(pool, x, m_len, IsBf16(w_type), IsBf16(y_type), targets);
  return ffi::Error::Success();
}

// y = x w[group]^T for a stack w [G, N, K] (a Mixture-of-Experts layer's experts; bfloat16 may come
// as its raw bits, uint16) and group i32[]: the matrix is read where it lies in the stack, where
// XLA would first copy it out (see jaxserve_kernels/matmul/grouped.py).
ffi::Error StackMatmulT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer group,
                        ffi::Result<ffi::AnyBuffer> y) {
  const bool w_bf16 = IsBf16(w.element_type()) || w.element_type() == ffi::DataType::U16;
  if (!IsFloat(x.element_type()) || !(w_bf16 || w.element_type() == ffi::DataType::F32) ||
      !IsFloat(y->element_type()) || group.element_type() != ffi::DataType::S32 || group.element_count() != 1) {
    return ffi::Error::InvalidArgument("stack matmul (cpu): float32 or bfloat16 x and w, and an int32 group");
  }
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2]) {
    return ffi::Error::InvalidArgument("stack matmul (cpu): x must be [M, K] and w [G, N, K]");
  }
  const int64_t g = *static_cast<const int32_t*>(group.untyped_data());
  if (g < 0 || g >= wd[0]) return ffi::Error::InvalidArgument("stack matmul (cpu): group out of range");
  const int64_t offset = g * wd[1] * wd[2] * (w_bf16 ? 2 : 4);
  return Product(pool, x, xd[0], static_cast<const char*>(w.untyped_data()) + offset, w_bf16, wd[1], y);
}

// out = w (bfloat16) widened to float32, for XLA's float32 dot on prefill chunks (see
// matmul/__init__.py). `after` is never read: as an operand it makes the widening wait until the
// layer's input exists. A plain convert depends on the weight alone, and XLA:CPU ran every layer's
// at the start of the step: every layer's float32 weights live at once, in a buffer mapped afresh
// every step (bench/RESULTS.md, "bfloat16 prefill").
ffi::Error WidenAfter(ffi::ThreadPool pool, ffi::AnyBuffer after, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out) {
  (void)after;
  if (!IsBf16(w.element_type()) || out->element_type() != ffi::DataType::F32 ||
      out->element_count() != w.element_count()) {
    return ffi::Error::InvalidArgument("widen (cpu): w must be bfloat16 and out float32 of its size");
  }
  constexpr int64_t kChunk = 1 << 16;
  const int64_t n = static_cast<int64_t>(w.element_count());
  const uint16_t* bits = static_cast<const uint16_t*>(w.untyped_data());
  float* wide = static_cast<float*>(out->untyped_data());
  ParallelFor(pool, (n + kChunk - 1) / kChunk, [&](int64_t item, std::vector<float>&) {
    const int64_t end = std::min(n, (item + 1) * kChunk);
    for (int64_t i = item * kChunk; i < end; ++i) wide[i] = Bf16ToFloat(bits[i]);
  });
  return ffi::Error::Success();
}

// out = silu(gate) * up (SwiGLU's activation, between a layer's gate and up products and its down
// product) for the first `live` rows (`LiveRows`), the others zero: XLA's fusion of it runs every
// row of a step's bucket. Blocks of rows are shared with XLA's threads.
ffi::Error GatedSilu(ffi::ThreadPool pool, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer live,
                     ffi::Result<ffi::AnyBuffer> out) {
  const ffi::DataType type = gate.element_type();
  if (!IsFloat(type) || up.element_type() != type || out->element_type() != type ||
      gate.dimensions().size() != 2 || up.element_count() != gate.element_count() ||
      out->element_count() != gate.element_count()) {
    return ffi::Error::InvalidArgument("gated silu (cpu): gate, up and out must be [M, N] of one float dtype");
  }
  const int64_t n = gate.dimensions()[1], rows = LiveRows(live, gate.dimensions()[0]);
  ZeroRowsFrom(out, rows);
  constexpr int64_t kValuesPerItem = 16 * 1024;
  const int64_t rows_per_item = std::max<int64_t>(1, kValuesPerItem / std::max<int64_t>(n, 1));
  ParallelFor(pool, CeilDiv(rows, rows_per_item), [&](int64_t item, std::vector<float>&) {
    const int64_t first = item * rows_per_item * n, count = std::min(rows, (item + 1) * rows_per_item) * n - first;
    if (IsBf16(type)) {
      GatedSiluValues(static_cast<const uint16_t*>(gate.untyped_data()) + first,
                      static_cast<const uint16_t*>(up.untyped_data()) + first,
                      static_cast<uint16_t*>(out->untyped_data()) + first, count);
    } else {
      GatedSiluValues(static_cast<const float*>(gate.untyped_data()) + first,
                      static_cast<const float*>(up.untyped_data()) + first,
                      static_cast<float*>(out->untyped_data()) + first, count);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

// The handlers: XLA's thread pool, two or three operands, one result.
static auto TwoOperandsOneResult() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<xla::ffi::AnyBuffer>()
      .Arg<xla::ffi::AnyBuffer>()
      .Ret<xla::ffi::AnyBuffer>();
}

static auto ThreeOperandsOneResult() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<xla::ffi::AnyBuffer>()
      .Arg<xla::ffi::AnyBuffer>()
      .Arg<xla::ffi::AnyBuffer>()
      .Ret<xla::ffi::AnyBuffer>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulT, jaxserve::MatmulT, ThreeOperandsOneResult());  // x, w, live

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWidenAfter, jaxserve::WidenAfter, TwoOperandsOneResult());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveStackMatmulT, jaxserve::StackMatmulT, ThreeOperandsOneResult());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGatedSilu, jaxserve::GatedSilu, ThreeOperandsOneResult());  // gate, up, live

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFloatManyMatmulT, jaxserve::ManyMatmulT,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // live
                                  .RemainingArgs()             // the weights (gated: gate and up)
                                  .RemainingRets()             // their ys (gated: one)
                                  .Attr<int64_t>("gated"));

// 1 where bfloat16 products run on the CPU's bfloat16 instructions (PairPanelTile), else 0.
extern "C" int JaxserveMatmulNativeBf16() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// 1 where bfloat16 products of kAmxMinRows rows and more run on AMX tiles (see the top), else 0.
extern "C" int JaxserveMatmulTiles() {
#if defined(JAXSERVE_AMX)
  return jaxserve::amx::TilesPermitted() ? 1 : 0;
#else
  return 0;
#endif
}

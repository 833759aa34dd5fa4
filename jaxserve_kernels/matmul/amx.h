// The tile form of the products (quant.cc's for quantized weights, cpu.cc's for bfloat16 ones), on
// AMX: x rounded to bfloat16, w's rows as bfloat16 (decoded by the caller, or read in place), and
// their products summed in float32 by the CPU's tile unit (`tdpbf16ps`: 16 x 16 sums of 32 products
// each per instruction). Built where the compiler targets AMX-BF16; it runs where Linux lets the
// process use the tiles (TilesPermitted).
//
// A is w: 16 rows of 32 bfloat16 values of K each, rows k_len apart. B is x: panels of 16 rows whose
// column r holds row r's values k and k + 1 as one 32-bit word (`PackPanels`). A tile product of
// 2 x 2 such tiles (32 rows of w by 32 rows of x, tiles 0-3) runs along all of K, then leaves as y^T,
// transposed into y.

#ifndef JAXSERVE_KERNELS_MATMUL_AMX_H_
#define JAXSERVE_KERNELS_MATMUL_AMX_H_

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define JAXSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace jaxserve::amx {

constexpr int64_t kTileRows = 16;    // rows of a tile: of w (A), of x (B's columns), of K pairs (B)
constexpr int64_t kTileK = 32;       // values of K of one tile product (a row of A: 64 bytes)
constexpr int64_t kRowsAtOnce = 2 * kTileRows;  // rows of w one TileSums takes
constexpr int64_t kTileRowsOfW = 96;  // w rows per work item of a prefill, about (ForEachBlock)
constexpr int64_t kTileBytesOfX = 256 * 1024;  // x panels per work item: about this much

// Whether this process may use the tile registers: Linux grants them on request, once per process.
inline bool TilesPermitted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return permitted;
}

// Holds the tile registers while it lives, each 16 rows of 64 bytes: 0-3 the sums, 4-5 w, 6-7 x.
// Released at the end of a work item, so a thread of XLA's pool does not carry their state.
class Tiles {
 public:
  Tiles() {
    struct {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t bytes_per_row[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t = 0; t < 8; ++t) {
      config.bytes_per_row[t] = 64;
      config.rows[t] = kTileRows;
    }
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// x [rows, K] as bfloat16 panels for B: panel p holds rows 16p to 16p + 15 as out[p][K / 2][16], each
// word the row's values k and k + 1 (rows past the last one are zeros). Panels [p0, p1).
inline void PackPanels(const uint16_t* x, int64_t rows, int64_t k_len, int64_t p0, int64_t p1, uint32_t* out) {
  const __m512i row_offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                 _mm512_set1_epi32(static_cast<int>(k_len * 2)));
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t valid = std::min<int64_t>(kTileRows, rows - p * kTileRows);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const uint16_t* base = x + p * kTileRows * k_len;
    uint32_t* panel = out + p * kTileRows * (k_len / 2);
    for (int64_t pair = 0; pair < k_len / 2; ++pair) {
      const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, row_offsets, base + 2 * pair, 1);
      _mm512_storeu_si512(panel + pair * kTileRows, words);
    }
  }
}

// c[(gw * 2 + gx) * 256 + 16 j + i] = row j of w's group gw . row i of x's group gx, for GW x GX
// groups of 16 rows: w's rows k_len apart (bfloat16), x's groups panel_words apart.
template <int GW, int GX>
void TileSums(const uint16_t* w, int64_t k_len, const uint32_t* x, int64_t panel_words, float* c) {
  _tile_zero(0);
  if constexpr (GX > 1) _tile_zero(1);
  if constexpr (GW > 1) _tile_zero(2);
  if constexpr (GW > 1 && GX > 1) _tile_zero(3);
  for (int64_t k = 0; k < k_len; k += kTileK) {
    _tile_loadd(4, w + k, k_len * 2);
    _tile_loadd(6, x + k / 2 * kTileRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (GX > 1) {
      _tile_loadd(7, x + panel_words + k / 2 * kTileRows, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (GW > 1) {
      _tile_loadd(5, w + kTileRows * k_len + k, k_len * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (GX > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (GX > 1) _tile_stored(1, c + 256, 64);
  if constexpr (GW > 1) _tile_stored(2, c + 512, 64);
  if constexpr (GW > 1 && GX > 1) _tile_stored(3, c + 768, 64);
}

// y[m0:m1, n0:n1] of y [M, N] (m0 a multiple of 16): w's rows taken kRowsAtOnce at a time, each time
// multiplied by all the item's panels of x. `rows(n, count, scratch)` gives rows n to n + 31 of w as
// bfloat16, k_len apart: the first `count` are w's, the others any values (their sums are dropped);
// `scratch` has room for kRowsAtOnce rows.
template <typename Y, typename Rows>
void TileBlock(const uint32_t* panels, int64_t k_len, const Rows& rows, Y* y, int64_t n_len, int64_t m0,
               int64_t m1, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  constexpr std::array kProducts{&TileSums<1, 1>, &TileSums<1, 2>, &TileSums<2, 1>, &TileSums<2, 2>};
  const int64_t panel_words = kTileRows * k_len / 2;
  scratch.resize(kTileRows * k_len);  // kRowsAtOnce rows of bfloat16
  uint16_t* room = reinterpret_cast<uint16_t*>(scratch.data());
  alignas(64) float c[4 * kTileRows * kTileRows];
  const Tiles tiles;
  for (int64_t n = n0; n < n1; n += kRowsAtOnce) {
    const int64_t gw = std::min<int64_t>(2, CeilDiv(n1 - n, kTileRows));
    const uint16_t* w = rows(n, std::min(kRowsAtOnce, n1 - n), room);
    for (int64_t m = m0; m < m1; m += 2 * kTileRows) {
      const int64_t gx = std::min<int64_t>(2, CeilDiv(m1 - m, kTileRows));
      kProducts[(gw - 1) * 2 + gx - 1](w, k_len, panels + m / kTileRows * panel_words, panel_words, c);
      for (int64_t a = 0; a < gw; ++a) {
        const int64_t cols = std::min(kTileRows, n1 - n - a * kTileRows);
        for (int64_t b = 0; b < gx; ++b) {
          StoreTransposed(c + (a * 2 + b) * kTileRows * kTileRows, std::min(kTileRows, m1 - m - b * kTileRows), cols,
                          y + (m + b * kTileRows) * n_len + n + a * kTileRows, n_len);
        }
      }
    }
  }
}

// y = x w^T in the tile form (see the top of the file), K a multiple of kTileK, w's rows given by
// `rows` (see TileBlock). Where x is one block (decode), w goes in blocks of decode_rows_of_w rows;
// else in blocks small enough that the items of several blocks of x split evenly over the threads.
template <typename X, typename Y, typename Rows>
void TileProduct(ffi::ThreadPool& pool, const X* x, int64_t m_len, int64_t k_len, int64_t n_len, Y* y,
                 int64_t decode_rows_of_w, const Rows& rows) {
  const int64_t panels = CeilDiv(m_len, kTileRows);
  std::vector<uint16_t> rounded;
  const uint16_t* x_bf16;
  if constexpr (std::is_same_v<X, float>) {
    rounded.resize(m_len * k_len);
    RoundToBf16(pool, x, m_len * k_len, rounded.data());
    x_bf16 = rounded.data();
  } else {
    x_bf16 = x;
  }
  std::vector<uint32_t> packed(panels * kTileRows * k_len / 2);
  ParallelFor(pool, panels, [&](int64_t p, std::vector<float>&) {
    PackPanels(x_bf16, m_len, k_len, p, p + 1, packed.data());
  });
  const int64_t rows_of_x =  // panels per work item: about kTileBytesOfX, so they stay in the L2 cache
      std::max<int64_t>(1, kTileBytesOfX / (2 * kTileRows * k_len)) * kTileRows;
  const int64_t rows_of_w = m_len <= rows_of_x ? decode_rows_of_w : kTileRowsOfW;
  ForEachBlock(pool, m_len, n_len, rows_of_x, rows_of_w, kRowsAtOnce,
               [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1, std::vector<float>& scratch) {
    TileBlock(packed.data(), k_len, rows, y, n_len, m0, m1, n0, n1, scratch);
  });
}

// w's rows as TileBlock takes them, from a bfloat16 w [n_len, k_len] read in place; the last rows,
// which would run past w's end, copied into `scratch` beside zeros.
inline auto RowsInPlace(const uint16_t* w, int64_t n_len, int64_t k_len) {
  return [=](int64_t n, int64_t count, uint16_t* scratch) -> const uint16_t* {
    if (n + kRowsAtOnce <= n_len) return w + n * k_len;
    std::memcpy(scratch, w + n * k_len, count * k_len * sizeof(uint16_t));
    std::memset(scratch + count * k_len, 0, (kRowsAtOnce - count) * k_len * sizeof(uint16_t));
    return scratch;
  };
}

}  // namespace jaxserve::amx

#endif  // AMX
#endif  // JAXSERVE_KERNELS_MATMUL_AMX_H_

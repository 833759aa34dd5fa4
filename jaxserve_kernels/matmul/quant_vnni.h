// The quantized matmul's integer forms (quant.cc), on AVX512-VNNI (`vpdpbusd`: 64 products of an
// unsigned by a signed byte, summed by fours into 16 int32 lanes). Each row of x is first quantized to
// int8 per block of 32 values (d_x = max |x| / 127), as llama.cpp does: a block of x and one of w then
// multiply in integers, d_x d_w times an exact integer dot, at four times the products per
// instruction of a float32 multiply-add.
// - The weight's bytes are the unsigned operand: int4 values (0..15) as they are, int8 ones shifted
//   by 128 (xor 0x80); the shift adds 128 d_x d_w sum(q_x) to a block, which is taken back.
// - Both that and int4's min add to y a term per block, v_w t_x, with v = d_w and t = -128 d_x
//   sum(q_x) for int8, v = m and t = d_x sum(q_x) for int4: a dot of K / 32 values a row. (With x's
//   exact sum instead, the error of x's rounding would follow w - m rather than w: about twice it.)
//
// Dot form (DotTile), under kPanelMinRows rows (and under the tile form's, where it runs): for one
// row of x, bounded by reading w once; each further row adds, per step, its integer dots (one per
// part), their conversion, the scale d_x d_w and the sum. A tile of up to 4 rows of x and 4
// rows of w (a quarter of the block apart, as in cpu.cc) takes one 64-byte vector of w's values per
// step (int8: two blocks; int4: four, 128 values of K, so that the scale's work is paid once per four
// blocks), decoded once and multiplied by each row of x. x is laid out per step in the order the
// weight's bytes decode to (StepByte), its scales per int32 lane.
//
// Grouped dot form (GroupTile), for a grouped weight (quant.h) at every row count: the lanes of a
// vector are the rows of a group, so that no sums cross lanes and a group is one stretch of memory.
//
// Panel form (PanelTile), from kPanelMinRows rows where the tile form does not run: bounded by the
// multiply-adds. x is packed into
// panels of 16 rows whose lane r holds 4 values of row r; a tile of w's rows is decoded once into a
// buffer of bytes, each 4 of them broadcast against 2 panels, 12 int32 sums per step; each block's
// sums are scaled into float32 accumulators.

#ifndef JAXSERVE_KERNELS_MATMUL_QUANT_VNNI_H_
#define JAXSERVE_KERNELS_MATMUL_QUANT_VNNI_H_

#include "common.h"
#include "quant.h"

#if defined(JAXSERVE_QUANT_INTEGER)
#include <algorithm>
#include <array>
#include <utility>
#include <vector>

namespace jaxserve::quant {

constexpr int kTileCols = 4;  // w rows of one dot-form tile
constexpr int64_t kPanelMinRows = 16;  // from this many rows of x on, the panel form
constexpr int64_t kPanelRows = 16;     // x rows of one panel
constexpr int kPanels = 2;             // panels of one panel tile
constexpr int kPanelTileCols = 6;      // w rows of one panel tile
constexpr int64_t kPanelRowsOfW = 96;  // w rows per panel-form work item, about
constexpr int64_t kBytesOfX = 256 * 1024;  // quantized x per panel-form work item: about this much

// 32 values of x from p widened to float32, as two vectors of 16.
inline void LoadBlock(const float* p, __m512 v[2]) {
  v[0] = _mm512_loadu_ps(p);
  v[1] = _mm512_loadu_ps(p + 16);
}
inline void LoadBlock(const uint16_t* p, __m512 v[2]) {
  for (int h = 0; h < 2; ++h) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h)));
    v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

template <Format F, typename X>
inline XBlock QuantizeBlock(const X* x) {
  __m512 v[2];
  LoadBlock(x, v);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
  const __m512 inverse = _mm512_set1_ps(amax > 0 ? 127 / amax : 0);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], inverse));  // (to nearest even)
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], inverse));
  XBlock out;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + 16), _mm512_cvtsepi32_epi8(q1));
  out.d = amax / 127;
  const float sum_q = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  out.t = (F == Format::kInt8 ? -128 : 1) * out.d * sum_q;
  return out;
}

// Dot form. A step is one 64-byte vector of w's values: int8, two blocks one after the other; int4,
// four blocks of 16 bytes, each byte holding its block's value j (low nibble) and j + 16 (high). The
// int4 step decodes into two vectors, the low nibbles and the high ones: byte 16 h + j of each holds
// value j, resp. j + 16, of block h. x's bytes follow that order (StepByte), one vector per part, so
// that int32 lane l of every part's dot belongs to block l / (16 / kStepBlocks) of the step.
template <Format F>
constexpr int64_t kStepBlocks = F == Format::kInt8 ? 2 : 4;
template <Format F>
constexpr int kStepParts = F == Format::kInt8 ? 1 : 2;  // vectors of x (and of decoded w) per step

template <Format F>
constexpr int64_t StepByte(int64_t h, int64_t j) {  // where value j of block h lies in a step's x bytes
  if constexpr (F == Format::kInt8) return kBlock * h + j;
  return j < 16 ? 16 * h + j : 64 + 16 * h + (j - 16);
}

template <Format F>
constexpr int StepBlock(int lane) {  // the block of the step (0 to kStepBlocks - 1) of int32 lane `lane`
  return lane / (16 / kStepBlocks<F>);
}

// x for the dot form: per row, each step's 64 bytes per part (StepByte), its scale per int32 lane,
// and the block terms (zero past the last block, up to a multiple of 16).
template <Format F>
struct DotX {
  static constexpr int64_t kStepBytes = 64 * kStepParts<F>;
  std::vector<int8_t> q;
  std::vector<float> d, t;
  int64_t steps, terms;
  const int8_t* Q(int64_t row) const { return q.data() + row * steps * kStepBytes; }
  const float* D(int64_t row) const { return d.data() + row * steps * 16; }
  const float* T(int64_t row) const { return t.data() + row * terms; }
};

template <Format F, typename X>
void QuantizeDotX(const X* x, int64_t rows, int64_t k_len, DotX<F>& out) {
  const int64_t blocks = k_len / kBlock, step_bytes = DotX<F>::kStepBytes;
  out.steps = CeilDiv(blocks, kStepBlocks<F>);
  out.terms = CeilDiv(blocks, 16) * 16;
  out.q.assign(rows * out.steps * step_bytes, 0);
  out.d.assign(rows * out.steps * 16, 0.f);
  out.t.assign(rows * out.terms, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const XBlock block = QuantizeBlock<F>(x + r * k_len + b * kBlock);
      const int64_t s = b / kStepBlocks<F>, h = b % kStepBlocks<F>;
      int8_t* q = out.q.data() + (r * out.steps + s) * step_bytes;
      for (int64_t j = 0; j < kBlock; ++j) q[StepByte<F>(h, j)] = block.q[j];
      for (int lane = 0; lane < 16; ++lane) {
        if (StepBlock<F>(lane) == h) out.d[(r * out.steps + s) * 16 + lane] = block.d;
      }
      out.t[r * out.terms + b] = block.t;
    }
  }
}

// Step s of a row of w as unsigned bytes in StepByte's order, one vector per part; of a last step
// with fewer blocks (`blocks`), only those are read and the rest are zeros.
template <Format F, bool kTail>
inline void LoadStep(const uint8_t* row, int64_t s, int64_t blocks, __m512i (&parts)[kStepParts<F>]) {
  const uint8_t* p = row + 64 * s;
  const __m512i q = kTail ? _mm512_maskz_loadu_epi8(~0ull >> (64 - blocks * 64 / kStepBlocks<F>), p)
                          : _mm512_loadu_si512(p);
  if constexpr (F == Format::kInt8) {
    parts[0] = _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    parts[0] = _mm512_and_si512(q, low);
    parts[1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
  }
}

// 16 float16 values from p widened to float32 (those past `mask` are zeros, and not read).
inline __m512 LoadHalves(const uint16_t* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// The dot form's tile reads w's scales and block terms 16 blocks at a time, widened once; step s of
// the group takes its blocks' scales out of them into the lanes StepBlock assigns.
template <Format F>
inline __m512i StepIndex(int64_t s) {  // lane l: block kStepBlocks s + StepBlock(l) of the group
  static constexpr auto kBlocks = [] {
    std::array<int32_t, 16> blocks{};
    for (int lane = 0; lane < 16; ++lane) blocks[lane] = StepBlock<F>(lane);
    return blocks;
  }();
  return _mm512_add_epi32(_mm512_loadu_si512(kBlocks.data()),
                          _mm512_set1_epi32(static_cast<int>(kStepBlocks<F> * s)));
}

template <Format F, int MR, int NR, bool kTail>
inline void DotStep(const DotX<F>& x, int64_t m, const QuantW& w, const int64_t (&rows)[NR], int64_t s,
                    int64_t blocks, const __m512 (&scales)[NR], __m512i index, __m512 (&acc)[MR][NR]) {
  __m512i ws[NR][kStepParts<F>];
  __m512 ds[NR];
  for (int j = 0; j < NR; ++j) {
    LoadStep<F, kTail>(w.data + rows[j] * w.row_bytes, s, blocks, ws[j]);
    ds[j] = _mm512_permutexvar_ps(index, scales[j]);
  }
  for (int i = 0; i < MR; ++i) {
    __m512i xs[kStepParts<F>];
    for (int p = 0; p < kStepParts<F>; ++p) xs[p] = _mm512_loadu_si512(x.Q(m + i) + DotX<F>::kStepBytes * s + 64 * p);
    const __m512 dx = _mm512_loadu_ps(x.D(m + i) + 16 * s);
    for (int j = 0; j < NR; ++j) {
      __m512i dot = _mm512_setzero_si512();
      for (int p = 0; p < kStepParts<F>; ++p) dot = _mm512_dpbusd_epi32(dot, ws[j][p], xs[p]);
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dx, ds[j]), acc[i][j]);
    }
  }
}

// y[i, j * stride] = x[m + i] . w[n + j * stride] for i < MR, j < NR (y rows ldy apart).
template <Format F, int MR, int NR>
void DotTile(const DotX<F>& x, int64_t m, const QuantW& w, int64_t n, int64_t stride, float* y, int64_t ldy) {
  int64_t rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = n + j * stride;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t b0 = 0; b0 < w.blocks; b0 += 16) {
    const int64_t count = std::min<int64_t>(16, w.blocks - b0);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    __m512 scales[NR];
    for (int j = 0; j < NR; ++j) {
      scales[j] = LoadHalves(w.scales + rows[j] * w.blocks + b0, mask);
      const __m512 v = F == Format::kInt8 ? scales[j] : LoadHalves(w.mins + rows[j] * w.blocks + b0, mask);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x.T(m + i) + b0), acc[i][j]);
    }
    const int64_t s0 = b0 / kStepBlocks<F>, full = count / kStepBlocks<F>, rest = count % kStepBlocks<F>;
    for (int64_t s = 0; s < full; ++s) {
      DotStep<F, MR, NR, false>(x, m, w, rows, s0 + s, kStepBlocks<F>, scales, StepIndex<F>(s), acc);
    }
    if (rest) DotStep<F, MR, NR, true>(x, m, w, rows, s0 + full, rest, scales, StepIndex<F>(full), acc);
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) y[i * ldy + j * stride] = _mm512_reduce_add_ps(acc[i][j]);
  }
}

template <Format F, int MR, int... NR>
constexpr auto DotTiles(std::integer_sequence<int, NR...>) {
  return std::array{&DotTile<F, MR, NR + 1>...};
}

// y[m0:m1, n0:n1] of y [M, N] in the dot form; tile t takes rows n0 + t + c * stride of w.
template <Format F>
void DotBlock(const DotX<F>& x, const QuantW& w, float* y, int64_t n_len, int64_t m0, int64_t m1, int64_t n0,
              int64_t n1) {
  static_assert(kXTileRows == 4, "one row of kTiles per row count");
  static constexpr auto kCols = std::make_integer_sequence<int, kTileCols>();
  constexpr std::array kTiles{DotTiles<F, 1>(kCols), DotTiles<F, 2>(kCols), DotTiles<F, 3>(kCols),
                              DotTiles<F, 4>(kCols)};
  const int64_t stride = CeilDiv(n1 - n0, kTileCols);
  for (int64_t m = m0; m < m1; m += kXTileRows) {
    const int64_t rows = std::min<int64_t>(kXTileRows, m1 - m);
    for (int64_t t = 0; t < stride; ++t) {
      const int64_t n = n0 + t, cols = CeilDiv(n1 - n, stride);
      kTiles[rows - 1][cols - 1](x, m, w, n, stride, y + m * n_len + n, n_len);
    }
  }
}

// Grouped dot form (w grouped: quant.h), at every row count: a tile of up to 4 rows of x and one
// group of w's rows, each row of the group a lane. Per block, 4 (int4) or 8 (int8) 64-byte loads
// of w, each holding 4 bytes of every row (int4: decoded into its low nibbles and its high ones),
// each multiplied by one 4-byte word of x's block broadcast: no sums across lanes, and one stretch of
// memory per group. x is in its blocks as they are (quant.h's GroupX).
// y[i, 0:16] = x[m + i] . w[n + 0:16] for i < MR (n a group's first row; y rows ldy apart).
template <Format F, int MR>
void GroupTile(const GroupX& x, int64_t m, const QuantW& w, int64_t n, float* y, int64_t ldy) {
  constexpr int kLoads = F == Format::kInt8 ? kBlock / 4 : kBlock / 8;  // 64-byte loads of w per block
  const uint8_t* data = w.data + n * w.row_bytes;
  const uint16_t* scales = w.scales + n * w.blocks;
  const uint16_t* mins = F == Format::kInt4 ? w.mins + n * w.blocks : nullptr;
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* p = data + b * kLoads * 64;
    __m512i low[MR], high[MR];  // two sums per row, so that half as many integer products wait on each other
    for (int i = 0; i < MR; ++i) low[i] = high[i] = _mm512_setzero_si512();
    // per step, two vectors of unsigned bytes (int4: one load's low and high nibbles; int8: two loads
    // shifted by 128) and the two 4-byte words of x's block (offsets `first` and `second`) they take
    for (int l = 0; l < kLoads; l += 2 / kStepParts<F>) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kGroupPrefetch + 64 * l), _MM_HINT_T0);
      __m512i ws[2];
      int64_t first = 4 * l, second = 4 * l + 4;
      if constexpr (F == Format::kInt4) {
        const __m512i bytes = _mm512_loadu_si512(p + 64 * l), nibbles = _mm512_set1_epi8(0x0F);
        ws[0] = _mm512_and_si512(bytes, nibbles);
        ws[1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibbles);
        second = 16 + 4 * l;
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(p + kGroupPrefetch + 64 * l + 64), _MM_HINT_T0);
        const __m512i shift = _mm512_set1_epi8(static_cast<char>(0x80));
        ws[0] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * l), shift);
        ws[1] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * l + 64), shift);
      }
      for (int i = 0; i < MR; ++i) {
        const int8_t* xb = x.q.data() + (m + i) * w.k_len + b * kBlock;
        int32_t words[2];
        std::memcpy(words, xb + first, 4);
        std::memcpy(words + 1, xb + second, 4);
        low[i] = _mm512_dpbusd_epi32(low[i], ws[0], _mm512_set1_epi32(words[0]));
        high[i] = _mm512_dpbusd_epi32(high[i], ws[1], _mm512_set1_epi32(words[1]));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + b * kGroupRows)));
    const __m512 v = F == Format::kInt8 ? d
        : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + b * kGroupRows)));
    for (int i = 0; i < MR; ++i) {
      const int64_t xb = (m + i) * w.blocks + b;
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(low[i], high[i]));
      acc[i] = _mm512_fmadd_ps(dots, _mm512_mul_ps(d, _mm512_set1_ps(x.d[xb])), acc[i]);
      acc[i] = _mm512_fmadd_ps(v, _mm512_set1_ps(x.t[xb]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

// Panel form. x in panels of 16 rows, per block: lane r of quad c holds values 4c to 4c + 3 of row
// r as one int32 word; the block's scale and term per row. Rows past the last one are zeros.
struct PanelBlockX {
  int32_t q[kBlock / 4][kPanelRows];
  float d[kPanelRows], t[kPanelRows];
};

template <Format F, typename X>
void QuantizePanels(const X* x, int64_t rows, int64_t k_len, int64_t r0, int64_t r1, PanelBlockX* out) {
  const int64_t blocks = k_len / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    PanelBlockX* panel = out + r / kPanelRows * blocks;
    const int64_t lane = r % kPanelRows;
    for (int64_t b = 0; b < blocks; ++b) {
      XBlock block{};
      if (r < rows) block = QuantizeBlock<F>(x + r * k_len + b * kBlock);
      for (int64_t c = 0; c < kBlock / 4; ++c) std::memcpy(&panel[b].q[c][lane], block.q + 4 * c, 4);
      panel[b].d[lane] = block.d;
      panel[b].t[lane] = block.t;
    }
  }
}

// A tile's rows of w decoded for the panel form: values as unsigned bytes [NR][K] (int8 xor 0x80),
// scales and block terms v as float32 [NR][K / 32]; in the work item's scratch.
struct PanelW {
  uint8_t* q;
  float *d, *v;
};

template <Format F>
PanelW UnpackRows(const QuantW& w, const int64_t* rows, int64_t count, std::vector<float>& scratch) {
  scratch.resize(kPanelTileCols * (w.k_len / 4 + 2 * w.blocks));
  PanelW out{reinterpret_cast<uint8_t*>(scratch.data()), scratch.data() + kPanelTileCols * w.k_len / 4,
             scratch.data() + kPanelTileCols * (w.k_len / 4 + w.blocks)};
  for (int64_t j = 0; j < count; ++j) {
    const uint8_t* src = w.data + rows[j] * w.row_bytes;
    uint8_t* dst = out.q + j * w.k_len;
    for (int64_t b = 0; b < w.blocks; ++b) {
      for (int64_t i = 0; i < kBlock; ++i) {
        dst[b * kBlock + i] = F == Format::kInt8 ? src[b * kBlock + i] ^ 0x80
                              : i < 16          ? src[b * 16 + i] & 0xF
                                                : src[b * 16 + i - 16] >> 4;
      }
      out.d[j * w.blocks + b] = HalfToFloat(w.scales[rows[j] * w.blocks + b]);
      out.v[j * w.blocks + b] =
          F == Format::kInt8 ? out.d[j * w.blocks + b] : HalfToFloat(w.mins[rows[j] * w.blocks + b]);
    }
  }
  return out;
}

// c[i][j][0:16] = panel i of x . row j of w, for i < MP, j < NR (panels `blocks` PanelBlockX apart).
template <int MP, int NR>
void PanelTile(const PanelBlockX* x, int64_t blocks, const PanelW& w, int64_t k_len, float* c) {
  __m512 acc[MP][NR];
  for (int i = 0; i < MP; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MP][NR];
    for (int i = 0; i < MP; ++i) {
      for (int j = 0; j < NR; ++j) dot[i][j] = _mm512_setzero_si512();
    }
    for (int64_t quad = 0; quad < kBlock / 4; ++quad) {
      __m512i xs[MP];
      for (int i = 0; i < MP; ++i) xs[i] = _mm512_loadu_si512(x[i * blocks + b].q[quad]);
      for (int j = 0; j < NR; ++j) {
        int32_t word;
        std::memcpy(&word, w.q + j * k_len + b * kBlock + 4 * quad, sizeof(word));
        const __m512i ws = _mm512_set1_epi32(word);
        for (int i = 0; i < MP; ++i) dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], ws, xs[i]);
      }
    }
    for (int i = 0; i < MP; ++i) {
      const __m512 dx = _mm512_loadu_ps(x[i * blocks + b].d), t = _mm512_loadu_ps(x[i * blocks + b].t);
      for (int j = 0; j < NR; ++j) {
        const __m512 scale = _mm512_mul_ps(dx, _mm512_set1_ps(w.d[j * blocks + b]));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][j]), scale, acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(t, _mm512_set1_ps(w.v[j * blocks + b]), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MP; ++i) {
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(c + (i * kPanelTileCols + j) * kPanelRows, acc[i][j]);
  }
}

template <int MP, int... NR>
constexpr auto PanelTiles(std::integer_sequence<int, NR...>) {
  return std::array{&PanelTile<MP, NR + 1>...};
}

// y[m0:m1, n0:n1] of y [M, N] in the panel form (m0 a multiple of 16); tile t takes rows
// n0 + t + c * stride of w, decoded once for all the item's panels.
template <Format F>
void PanelBlock(const PanelBlockX* panels, const QuantW& w, float* y, int64_t n_len, int64_t m0, int64_t m1,
                int64_t n0, int64_t n1, std::vector<float>& scratch) {
  static_assert(kPanels == 2, "one row of kTiles per panel count");
  static constexpr auto kCols = std::make_integer_sequence<int, kPanelTileCols>();
  constexpr std::array kTiles{PanelTiles<1>(kCols), PanelTiles<2>(kCols)};
  const int64_t stride = CeilDiv(n1 - n0, kPanelTileCols);
  float c[kPanels * kPanelTileCols * kPanelRows];
  for (int64_t t = 0; t < stride; ++t) {
    const int64_t n = n0 + t, cols = CeilDiv(n1 - n, stride);
    int64_t rows[kPanelTileCols];
    for (int64_t j = 0; j < cols; ++j) rows[j] = n + j * stride;
    const PanelW wt = UnpackRows<F>(w, rows, cols, scratch);
    for (int64_t m = m0; m < m1; m += kPanels * kPanelRows) {
      const int64_t panels_here = std::min<int64_t>(kPanels, CeilDiv(m1 - m, kPanelRows));
      kTiles[panels_here - 1][cols - 1](panels + m / kPanelRows * w.blocks, w.blocks, wt, w.k_len, c);
      for (int64_t i = 0; i < panels_here; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          for (int64_t r = 0; r < std::min(kPanelRows, m1 - m - i * kPanelRows); ++r) {
            y[(m + i * kPanelRows + r) * n_len + rows[j]] = c[(i * kPanelTileCols + j) * kPanelRows + r];
          }
        }
      }
    }
  }
}

// The dot form of the targets' weights (one format, one K, in rows) against the same x: x quantized
// once, and the rows of all the weights split into work items as one weight's would be
// (ForEachTargetBlock: q, k and v, or gate and up, take one call and one handing of work to the threads).
template <Format F, typename X>
void DotProducts(ffi::ThreadPool& pool, const X* x, int64_t m_len, const std::vector<Target>& targets) {
  DotX<F> xq;
  QuantizeDotX<F>(x, m_len, targets[0].w.k_len, xq);
  ForEachTargetBlock(pool, m_len, targets, kTileCols,
                     [&](const Target& t, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    DotBlock<F>(xq, t.w, t.y, t.n_len, m0, m1, n0, n1);
  });
}

template <Format F, typename X>
void PanelProduct(ffi::ThreadPool& pool, const X* x, int64_t m_len, const QuantW& w, int64_t n_len, float* y) {
  const int64_t panels = CeilDiv(m_len, kPanelRows);
  std::vector<PanelBlockX> xq(panels * w.blocks);
  ParallelFor(pool, panels, [&](int64_t p, std::vector<float>&) {
    QuantizePanels<F>(x, m_len, w.k_len, p * kPanelRows, (p + 1) * kPanelRows, xq.data());
  });
  const int64_t rows_of_x =  // panels per work item: about kBytesOfX, so they stay in the L2 cache
      std::max<int64_t>(1, kBytesOfX / (sizeof(PanelBlockX) * w.blocks)) * kPanelRows;
  ForEachBlock(pool, m_len, n_len, rows_of_x, kPanelRowsOfW, kPanelTileCols,
               [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1, std::vector<float>& scratch) {
    PanelBlock<F>(xq.data(), w, y, n_len, m0, m1, n0, n1, scratch);
  });
}

// The integer forms of weights in rows, for x's first m_len rows: the dot form where x has under
// kPanelMinRows rows (m_form, padding included: see Products), else the panel form, weight by weight
// (there the products, not the handing of work, set the time).
template <Format F, typename X>
void IntegerProducts(ffi::ThreadPool& pool, const X* x, int64_t m_form, int64_t m_len,
                     const std::vector<Target>& targets) {
  if (m_form < kPanelMinRows) return DotProducts<F>(pool, x, m_len, targets);
  for (const Target& t : targets) PanelProduct<F>(pool, x, m_len, t.w, t.n_len, t.y);
}

}  // namespace jaxserve::quant

#endif  // AVX512-VNNI
#endif  // JAXSERVE_KERNELS_MATMUL_QUANT_VNNI_H_

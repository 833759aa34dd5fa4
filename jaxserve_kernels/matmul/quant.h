// What the forms of the quantized matmul (quant.cc) share: the weight's operands, as the handler
// receives them, and its float16 scales widened; what the integer forms share (x's quantized blocks,
// the grouped layout) and the work items of several weights in one call (ForEachTargetBlock).

#ifndef JAXSERVE_KERNELS_MATMUL_QUANT_H_
#define JAXSERVE_KERNELS_MATMUL_QUANT_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "common.h"

// The forms a build has (see the top of quant.cc): integer ones where the compiler targets
// AVX512-VNNI, the tile form where it also targets AMX-BF16; on AVX2 without them, the grouped dot
// form in bytes (quant_avx2.h). Either integer build multiplies grouped weights.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JAXSERVE_QUANT_INTEGER 1
#if defined(JAXSERVE_AMX)
#define JAXSERVE_QUANT_TILES 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXSERVE_QUANT_BYTES 1
#endif
#if defined(JAXSERVE_QUANT_INTEGER) || defined(JAXSERVE_QUANT_BYTES)
#define JAXSERVE_QUANT_GROUPED 1
#endif

namespace jaxserve::quant {

constexpr int64_t kBlock = 32;  // values of K per scale (quant.py's BLOCK)
// w per work item of the dot forms, about: whole rows, at least 64 (ForEachBlock). Each item is one
// stretch of memory, which the hardware prefetcher follows only after a while: long stretches keep
// a row of x at the memory's speed (bench/RESULTS.md, "Quantized weights").
constexpr int64_t kBytesOfW = 1 << 20;
inline int64_t RowsOfW(int64_t row_bytes) { return std::max<int64_t>(64, kBytesOfW / row_bytes); }

enum class Format { kInt8, kInt4 };

inline float HalfToFloat(uint16_t h) {  // IEEE float16 to float32, exactly
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa 2^-24 is exact in float32
    const float magnitude = static_cast<float>(mantissa) * 5.9604645e-8f;
    std::memcpy(&bits, &magnitude, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// The grouped layout (quant.py's `group_rows`): in each group of kGroupRows rows, the rows' 4-byte
// words of data are interleaved (word j of the group's row r at 4 (kGroupRows j + r)), and so are
// their scales and mins (block b of row r at kGroupRows b + r), so that one 64-byte load holds 4
// bytes of every row of the group: the dot form's lanes are the group's rows.
constexpr int64_t kGroupRows = 16;

// The weight's operands (quant.py): `data` int8 [N, K] or uint8 [N, K / 2]; `scales` and `mins`
// (int4 only) float16 [N, K / 32] as raw 16-bit words; in rows, or grouped.
struct QuantW {
  const uint8_t* data;
  const uint16_t* scales;
  const uint16_t* mins;
  int64_t k_len, blocks;  // blocks = k_len / kBlock
  int64_t row_bytes;
  bool grouped = false;
};

// w's bytes this far ahead of a group's loads are prefetched by the grouped dot forms: the hardware's
// prefetcher restarts at every 4 KB page, and a product of one row of x reads each byte of w once.
constexpr int64_t kGroupPrefetch = 4096;
constexpr int kXTileRows = 4;  // x rows of one dot-form tile

// One block of x quantized for the integer forms (QuantizeBlock, per instruction set): q = round(x / d)
// with d = max |x| / 127, and the block's term t (see the top of quant_vnni.h and of quant_avx2.h).
struct XBlock {
  int8_t q[kBlock];
  float d, t;
};

// x for the grouped dot forms: its blocks as they are.
struct GroupX {
  std::vector<int8_t> q;    // [rows, K]
  std::vector<float> d, t;  // [rows, K / 32]: each block's scale and term
};

// A row of a grouped weight copied out in rows (the forms that decode w row by row read it so).
struct RowCopy {
  std::vector<uint8_t> data;
  std::vector<uint16_t> scales, mins;
};

// Row `row` of w as row 0 of a weight in rows: in place, or (grouped) copied into `copy`.
inline QuantW RowOf(const QuantW& w, int64_t row, RowCopy& copy) {
  if (!w.grouped) {
    return {w.data + row * w.row_bytes, w.scales + row * w.blocks, w.mins ? w.mins + row * w.blocks : nullptr,
            w.k_len, w.blocks, w.row_bytes};
  }
  const int64_t first = row - row % kGroupRows, lane = row % kGroupRows;
  copy.data.resize(w.row_bytes);
  for (int64_t j = 0; j < w.row_bytes / 4; ++j) {
    std::memcpy(copy.data.data() + 4 * j, w.data + first * w.row_bytes + 4 * (kGroupRows * j + lane), 4);
  }
  copy.scales.resize(w.blocks);
  copy.mins.resize(w.blocks);
  for (int64_t b = 0; b < w.blocks; ++b) {
    copy.scales[b] = w.scales[first * w.blocks + kGroupRows * b + lane];
    if (w.mins) copy.mins[b] = w.mins[first * w.blocks + kGroupRows * b + lane];
  }
  return {copy.data.data(), copy.scales.data(), w.mins ? copy.mins.data() : nullptr, w.k_len, w.blocks, w.row_bytes};
}

// One weight of a call and its y [M, n_len], in float32 (quant.cc: several weights may share x).
struct Target {
  QuantW w;
  int64_t n_len;
  float* y;
};

// fn(target, m0, m1, n0, n1) over the rows of all the targets' weights split into work items as one
// weight's would be (ForEachBlock; `tile_cols` a multiple of every item's rows), an item cut where a
// weight ends: q, k and v, or gate and up, take one call and one handing of work to the threads.
template <typename Fn>
void ForEachTargetBlock(ffi::ThreadPool& pool, int64_t m_len, const std::vector<Target>& targets, int64_t tile_cols,
                        const Fn& fn) {
  std::vector<int64_t> starts{0};  // where each weight's rows start among all of them
  for (const Target& t : targets) starts.push_back(starts.back() + t.n_len);
  ForEachBlockOf(pool, m_len, starts, m_len, RowsOfW(targets[0].w.row_bytes), tile_cols,
                 [&](size_t i, int64_t m0, int64_t m1, int64_t n0, int64_t n1, std::vector<float>&) {
    fn(targets[i], m0, m1, n0, n1);
  });
}

}  // namespace jaxserve::quant

#endif  // JAXSERVE_KERNELS_MATMUL_QUANT_H_

// The quantized matmul's tile form (quant.cc), on AMX (amx.h): w's rows dequantized to bfloat16, a
// work item's 32 rows at a time into its scratch (`DecodeRow`), x rounded to bfloat16, their products
// summed in float32 by the tile unit.

#ifndef JAXSERVE_KERNELS_MATMUL_QUANT_AMX_H_
#define JAXSERVE_KERNELS_MATMUL_QUANT_AMX_H_

#include "amx.h"
#include "common.h"
#include "quant.h"

#if defined(JAXSERVE_QUANT_TILES)
namespace jaxserve::quant {

using amx::TilesPermitted;

// Row `row` of w as bfloat16 [K]: d q (+ m) in float32, rounded to nearest even. Scales and mins are
// widened 16 blocks at a time; a block's values are widened from bytes to int32 lanes first, where
// int4's two nibbles are one mask and one shift apart.
template <Format F>
inline void DecodeRow(const QuantW& w, int64_t row, uint16_t* out) {
  const uint8_t* src = w.data + row * w.row_bytes;
  for (int64_t b0 = 0; b0 < w.blocks; b0 += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, w.blocks - b0)) - 1);
    const __m512 scales = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.scales + row * w.blocks + b0));
    __m512 mins = _mm512_setzero_ps();
    if constexpr (F == Format::kInt4) {
      mins = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.mins + row * w.blocks + b0));
    }
    for (int64_t b = b0; b < std::min<int64_t>(w.blocks, b0 + 16); ++b) {
      const __m512i lane = _mm512_set1_epi32(static_cast<int>(b - b0));
      const __m512 d = _mm512_permutexvar_ps(lane, scales);
      __m512 low, high;  // values 0-15 and 16-31 of the block
      if constexpr (F == Format::kInt8) {
        const __m128i* q = reinterpret_cast<const __m128i*>(src + b * kBlock);
        low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
        high = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
      } else {
        const __m512 m = _mm512_permutexvar_ps(lane, mins);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + b * 16)));
        low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xF))), d, m);
        high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
      }
      _mm512_storeu_si512(out + b * kBlock, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
  }
}

// y = x w^T in the tile form (see the top of the file).
template <Format F, typename X>
void TileProduct(ffi::ThreadPool& pool, const X* x, int64_t m_len, const QuantW& w, int64_t n_len, float* y) {
  const int64_t k_len = w.k_len;
  amx::TileProduct(pool, x, m_len, k_len, n_len, y, RowsOfW(w.row_bytes),
                   [&](int64_t n, int64_t count, uint16_t* scratch) -> const uint16_t* {
    thread_local RowCopy copy;
    for (int64_t j = 0; j < amx::kRowsAtOnce; ++j) {
      if (j < count) {
        DecodeRow<F>(RowOf(w, n + j, copy), 0, scratch + j * k_len);
      } else {
        std::memset(scratch + j * k_len, 0, k_len * sizeof(uint16_t));
      }
    }
    return scratch;
  });
}

}  // namespace jaxserve::quant

#endif  // JAXSERVE_QUANT_TILES
#endif  // JAXSERVE_KERNELS_MATMUL_QUANT_AMX_H_

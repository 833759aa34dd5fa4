// The quantized matmul's grouped dot form on AVX2 without AVX512-VNNI (quant.cc), for a grouped weight
// (quant.h) at every row count. As in quant_vnni.h, each row of x is quantized to int8 per block of 32
// values (d_x = max |x| / 127) and a block of x and one of w multiply in integers: here by
// `vpmaddubsw` (32 products of an unsigned by a signed byte, summed by pairs into 16 int16 lanes) and
// `vpmaddwd` (pairs of int16 lanes summed into 8 int32 ones), the instructions llama.cpp uses on AVX2.
// - int4: w's values (0..15) are the unsigned operand, and a block's 8 sums of pairs add up in int16
//   (at most 8 x 2 x 15 x 127 = 30480 in magnitude) before one `vpmaddwd` with ones. The min adds a
//   term per block, m_w t_x with t = d_x sum(q_x), as in quant_vnni.h.
// - int8: the unsigned operand is |w| and x takes w's sign (`vpsignb`), as llama.cpp does: the VNNI
//   forms' shift by 128 would overflow a pair's int16 sum (2 x 255 x 127). Nothing is shifted, so the
//   block term is zero.
// A tile is up to 4 rows of x against one half of a group (8 rows of w, one int32 lane each; a 64-byte
// word of the group holds both halves): each 32-byte load of w takes a 4-byte word of x broadcast per
// row of x (int4: two, one for its low nibbles and one for its high ones), and no sums cross lanes.

#ifndef JAXSERVE_KERNELS_MATMUL_QUANT_AVX2_H_
#define JAXSERVE_KERNELS_MATMUL_QUANT_AVX2_H_

#include "common.h"
#include "quant.h"

#if defined(JAXSERVE_QUANT_BYTES)
#include <immintrin.h>

namespace jaxserve::quant {

constexpr int64_t kHalfRows = kGroupRows / 2;  // w rows of one tile: one int32 lane each

inline float MaxOf(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t SumOf(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One block of x quantized (quant.h's XBlock): rounded to nearest even, as quant_vnni.h's.
template <Format F, typename X>
inline XBlock QuantizeBlock(const X* x) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int g = 0; g < 4; ++g) {
    v[g] = Load(x + 8 * g);  // (common.h's Lanes are a __m256)
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[g], magnitude));
  }
  const float top = MaxOf(amax);
  const __m256 inverse = _mm256_set1_ps(top > 0 ? 127 / top : 0);
  __m256i q[4];
  for (int g = 0; g < 4; ++g) q[g] = _mm256_cvtps_epi32(_mm256_mul_ps(v[g], inverse));
  // packing works within 128-bit lanes: its 4-byte words come out as the block's 0, 2, 4, 6, 1, 3, 5, 7
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  XBlock out;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  out.d = top / 127;
  const int32_t sum_q = SumOf(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  out.t = F == Format::kInt8 ? 0.f : out.d * static_cast<float>(sum_q);
  return out;
}

inline __m256i Broadcast(const int8_t* p) {  // 4 bytes of x in every int32 lane
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm256_set1_epi32(word);
}

// One block's integer dots of rows m..m + MR - 1 of x with the 8 rows of a half group (`p`: the block's
// bytes of the group, `half` 0 or 1), as int32 lanes.
template <Format F, int MR>
inline void BlockDots(const int8_t* const (&xb)[MR], const uint8_t* p, int64_t half, __m256i (&dots)[MR]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (F == Format::kInt4) {
    __m256i pairs[MR];  // int16: a block's sums fit (see the top)
    for (int i = 0; i < MR; ++i) pairs[i] = _mm256_setzero_si256();
    const __m256i nibbles = _mm256_set1_epi8(0x0F);
    for (int l = 0; l < 4; ++l) {  // 64-byte words: values 4l.. in the low nibbles, 16 + 4l.. in the high
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * l + 32 * half));
      const __m256i low = _mm256_and_si256(bytes, nibbles);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibbles);
      for (int i = 0; i < MR; ++i) {
        pairs[i] = _mm256_add_epi16(pairs[i], _mm256_maddubs_epi16(low, Broadcast(xb[i] + 4 * l)));
        pairs[i] = _mm256_add_epi16(pairs[i], _mm256_maddubs_epi16(high, Broadcast(xb[i] + 16 + 4 * l)));
      }
    }
    for (int i = 0; i < MR; ++i) dots[i] = _mm256_madd_epi16(pairs[i], ones);
  } else {
    for (int i = 0; i < MR; ++i) dots[i] = _mm256_setzero_si256();
    for (int l = 0; l < 8; ++l) {  // 64-byte words: values 4l..4l + 3
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * l + 32 * half));
      const __m256i size = _mm256_sign_epi8(w, w);
      for (int i = 0; i < MR; ++i) {
        const __m256i pair = _mm256_maddubs_epi16(size, _mm256_sign_epi8(Broadcast(xb[i] + 4 * l), w));
        dots[i] = _mm256_add_epi32(dots[i], _mm256_madd_epi16(pair, ones));
      }
    }
  }
}

// y[i, 8 half:8 half + 8] = x[m + i] . w[n + 8 half + 0:8] for i < MR (n a group's first row; y rows
// ldy apart).
template <Format F, int MR>
void HalfTile(const GroupX& x, int64_t m, const QuantW& w, int64_t n, int64_t half, float* y, int64_t ldy) {
  constexpr int64_t kBlockBytes = F == Format::kInt8 ? kBlock * kGroupRows : kBlock / 2 * kGroupRows;
  const uint8_t* data = w.data + n * w.row_bytes;
  const uint16_t* scales = w.scales + n * w.blocks + kHalfRows * half;
  const uint16_t* mins = F == Format::kInt4 ? w.mins + n * w.blocks + kHalfRows * half : nullptr;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* p = data + b * kBlockBytes;
    for (int64_t ahead = 0; ahead < kBlockBytes && half == 0; ahead += 64) {  // (the first half reads all)
      _mm_prefetch(reinterpret_cast<const char*>(p + kGroupPrefetch + ahead), _MM_HINT_T0);
    }
    const int8_t* xb[MR];
    for (int i = 0; i < MR; ++i) xb[i] = x.q.data() + (m + i) * w.k_len + b * kBlock;
    __m256i dots[MR];
    BlockDots<F, MR>(xb, p, half, dots);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kGroupRows)));
    for (int i = 0; i < MR; ++i) {
      const int64_t xi = (m + i) * w.blocks + b;
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i]), _mm256_mul_ps(d, _mm256_set1_ps(x.d[xi])), acc[i]);
      if constexpr (F == Format::kInt4) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * kGroupRows));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtph_ps(v), _mm256_set1_ps(x.t[xi]), acc[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) _mm256_storeu_ps(y + i * ldy + kHalfRows * half, acc[i]);
}

// y[i, 0:16] = x[m + i] . w[n + 0:16] for i < MR: both halves of the group, the second from the caches.
template <Format F, int MR>
void GroupTile(const GroupX& x, int64_t m, const QuantW& w, int64_t n, float* y, int64_t ldy) {
  HalfTile<F, MR>(x, m, w, n, 0, y, ldy);
  HalfTile<F, MR>(x, m, w, n, 1, y, ldy);
}

}  // namespace jaxserve::quant

#endif  // JAXSERVE_QUANT_BYTES
#endif  // JAXSERVE_KERNELS_MATMUL_QUANT_AVX2_H_

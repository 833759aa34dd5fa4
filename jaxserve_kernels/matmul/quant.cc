// y = x w^T for XLA:CPU with w quantized (jaxserve_kernels/matmul/quant.py): "int8" (GGUF's Q8_0) or "int4"
// (GGUF's Q4_1), both in blocks of 32 values of K with a float16 scale d (and, for int4, a float16
// min m: w = d q + m). x [M, K] in float32 or bfloat16, accumulated in float32, y [M, N] in float32
// or bfloat16. An XLA FFI custom call of the same family as cpu.cc (see matmul/__init__.py); its
// measurements are in bench/RESULTS.md ("Quantized weights"). A third handler takes several weights
// of one format against the same x (a layer's q, k and v; gate and up), each with its own y: in the
// dot form (decode) x is quantized once and the work of all of them is handed to the threads at once.
//
// The weight is read as stored, never widened in memory as a whole. One form per CPU and regime
// (`Products`), each rounding x or w its own way before float32 sums:
// - Integer forms (quant_vnni.h), on AVX512-VNNI: x quantized to int8 per block of 32, as llama.cpp
//   does, and multiplied by w's bytes in integers. The dot form under 16 rows, bounded by reading w
//   once; the panel form from 16 rows on, where the CPU has no tiles.
// - Tile form (quant_amx.h), on AMX, from kTileMinRows rows on: w dequantized to bfloat16 by rows,
//   x rounded to bfloat16, multiplied by the tile unit.
// - Grouped dot form in bytes (quant_avx2.h), on AVX2 without AVX512-VNNI, for grouped weights: x
//   quantized to int8 per block as above, multiplied by pairs of bytes into int16 sums.
// - Float form (FloatTile, below), on CPUs without AVX512-VNNI, for weights in rows: each block of w
//   dequantized in registers and multiplied by x in float32; nothing rounded.
// A weight may come grouped (quant.h; the handler of many's attribute `row_group` 16, else 0 for
// rows), where an integer form runs (on AVX512-VNNI or AVX2): as one operand, its data, scales and
// mins one after the other (quant.py's `GroupedRows`). It then takes the grouped dot form at every
// row count (GroupProducts), and the tile form decodes each row copied out of its group.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"
#include "quant.h"
#include "quant_amx.h"
#include "quant_avx2.h"
#include "quant_vnni.h"

namespace jaxserve::quant {

#if !defined(JAXSERVE_QUANT_INTEGER)
constexpr int kFloatTileRows = 3;  // x rows of one tile: with 2 rows of w, 6 accumulators and 8 vectors of w

typedef int32_t Int32s __attribute__((vector_size(32)));

// 8 bytes widened to int32 lanes, where int4's two nibbles are a mask and a shift apart (GCC 12 has
// no shift of bytes), and then to float32 lanes (ToLanes).
template <typename Byte>
inline Int32s WidenBytes(const Byte* p) {
#if defined(__AVX2__)  // one instruction: GCC 12 moves the portable form's bytes through general registers
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i v = std::is_signed_v<Byte> ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
#else
  typedef Byte Bytes __attribute__((vector_size(8)));
  Bytes bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  const Int32s v = __builtin_convertvector(bytes, Int32s);
#endif
  Int32s out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

inline Lanes ToLanes(Int32s q) { return __builtin_convertvector(q, Lanes); }

// Block b of row `row` of w as 4 x 8 float32 values: d q (+ m).
template <Format F>
inline void DequantizeBlock(const QuantW& w, int64_t row, int64_t b, Lanes out[4]) {
  const float d = HalfToFloat(w.scales[row * w.blocks + b]);
  const uint8_t* src = w.data + row * w.row_bytes;
  if constexpr (F == Format::kInt8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(src + b * kBlock);
    for (int g = 0; g < 4; ++g) out[g] = ToLanes(WidenBytes(q + 8 * g)) * d;
  } else {
    const float m = HalfToFloat(w.mins[row * w.blocks + b]);
    for (int g = 0; g < 2; ++g) {  // bytes 8g..8g+7: values 8g.. in the low nibbles, 16 + 8g.. in the high
      const Int32s q = WidenBytes(src + b * 16 + 8 * g);
      out[g] = ToLanes(q & 0xF) * d + m;
      out[g + 2] = ToLanes(q >> 4) * d + m;
    }
  }
}

// y[i, j * stride] = x[i] . w[n + j * stride] for i < MR, j < NR (x rows k_len apart, y rows ldy).
template <Format F, int MR, int NR>
void FloatTile(const float* x, const QuantW& w, int64_t n, int64_t stride, float* y, int64_t ldy) {
  Lanes acc[MR][NR] = {};
  for (int64_t b = 0; b < w.blocks; ++b) {
    Lanes ws[NR][4];
    for (int j = 0; j < NR; ++j) DequantizeBlock<F>(w, n + j * stride, b, ws[j]);
    for (int i = 0; i < MR; ++i) {
      const float* xb = x + i * w.k_len + b * kBlock;
      for (int j = 0; j < NR; ++j) {
        acc[i][j] += (Load(xb) * ws[j][0] + Load(xb + 8) * ws[j][1]) +
                     (Load(xb + 16) * ws[j][2] + Load(xb + 24) * ws[j][3]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) y[i * ldy + j * stride] = Sum(acc[i][j]);
  }
}

template <Format F, int MR>
void FloatTileRows(const float* x, const QuantW& w, int64_t n, int64_t stride, float* y, int64_t ldy, int64_t cols) {
  if (cols == 2) return FloatTile<F, MR, 2>(x, w, n, stride, y, ldy);
  return FloatTile<F, MR, 1>(x, w, n, stride, y, ldy);
}

template <Format F>
void FloatBlock(const float* x, const QuantW& w, float* y, int64_t n_len, int64_t m0, int64_t m1, int64_t n0,
                int64_t n1) {
  const int64_t stride = CeilDiv(n1 - n0, 2);
  for (int64_t m = m0; m < m1; m += kFloatTileRows) {
    const int64_t rows = std::min<int64_t>(kFloatTileRows, m1 - m);
    for (int64_t t = 0; t < stride; ++t) {
      const int64_t n = n0 + t, cols = CeilDiv(n1 - n, stride);
      const float* xm = x + m * w.k_len;
      float* ym = y + m * n_len + n;
      if (rows == 3) {
        FloatTileRows<F, 3>(xm, w, n, stride, ym, n_len, cols);
      } else if (rows == 2) {
        FloatTileRows<F, 2>(xm, w, n, stride, ym, n_len, cols);
      } else {
        FloatTileRows<F, 1>(xm, w, n, stride, ym, n_len, cols);
      }
    }
  }
}

template <Format F, typename X>
void FloatProduct(ffi::ThreadPool& pool, const X* x, int64_t m_len, const QuantW& w, int64_t n_len, float* y) {
  std::vector<float> wide(m_len * w.k_len);
  for (int64_t i = 0; i < m_len * w.k_len; ++i) wide[i] = Widen(x[i]);
  ForEachBlock(pool, m_len, n_len, 4 * kFloatTileRows, RowsOfW(w.row_bytes), 2,  // (a few tiles of x: in L1)
               [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1, std::vector<float>&) {
    FloatBlock<F>(wide.data(), w, y, n_len, m0, m1, n0, n1);
  });
}

#endif  // not AVX512-VNNI

#if defined(JAXSERVE_QUANT_GROUPED)
template <Format F, typename X>
void QuantizeGroupX(const X* x, int64_t rows, int64_t k_len, GroupX& out) {
  const int64_t blocks = k_len / kBlock;
  out.q.resize(rows * k_len);
  out.d.resize(rows * blocks);
  out.t.resize(rows * blocks);
  for (int64_t i = 0; i < rows * blocks; ++i) {
    const XBlock block = QuantizeBlock<F>(x + i * kBlock);  // (this instruction set's)
    std::memcpy(out.q.data() + i * kBlock, block.q, kBlock);
    out.d[i] = block.d;
    out.t[i] = block.t;
  }
}

// y[m0:m1, n0:n1] of y [M, N] in the grouped dot form (n0 and n1 multiples of kGroupRows): group by
// group, every tile of x's rows while the group is in the L1 cache.
template <Format F>
void GroupBlock(const GroupX& x, const QuantW& w, float* y, int64_t n_len, int64_t m0, int64_t m1, int64_t n0,
                int64_t n1) {
  static_assert(kXTileRows == 4, "one tile per row count");
  constexpr std::array kTiles{&GroupTile<F, 1>, &GroupTile<F, 2>, &GroupTile<F, 3>, &GroupTile<F, 4>};
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    for (int64_t m = m0; m < m1; m += kXTileRows) {
      kTiles[std::min<int64_t>(kXTileRows, m1 - m) - 1](x, m, w, n, y + m * n_len + n, n_len);
    }
  }
}

// The grouped dot form of the targets' weights (all grouped, one format, one K) against the same x,
// quantized once, their rows split into work items of whole groups (ForEachTargetBlock). It measured
// faster than the VNNI panel form up to 512 rows of x, and on AVX2 2-3x the float form's speed
// (bench/RESULTS.md, "Quantized matrices kept grouped" and "The quantized products on AVX2").
template <Format F, typename X>
void GroupProducts(ffi::ThreadPool& pool, const X* x, int64_t m_len, const std::vector<Target>& targets) {
  GroupX xg;
  QuantizeGroupX<F>(x, m_len, targets[0].w.k_len, xg);
  ForEachTargetBlock(pool, m_len, targets, kGroupRows,
                     [&](const Target& t, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    GroupBlock<F>(xg, t.w, t.y, t.n_len, m0, m1, n0, n1);
  });
}
#endif

#if defined(JAXSERVE_QUANT_TILES)
constexpr int64_t kTileMinRows = 8;  // from this many rows of x on, the tile form where permitted
#endif

// y = x w^T for each target's weight (one format and one K) and x's first m_len rows, in the form
// this CPU and m_form (x's rows, padding included: see Product in cpu.cc) take.
template <Format F, typename X>
void Products(ffi::ThreadPool& pool, const X* x, int64_t m_form, int64_t m_len, const std::vector<Target>& targets) {
#if defined(JAXSERVE_QUANT_TILES)
  if (m_form >= kTileMinRows && TilesPermitted()) {
    for (const Target& t : targets) TileProduct<F>(pool, x, m_len, t.w, t.n_len, t.y);
    return;
  }
#endif
#if defined(JAXSERVE_QUANT_GROUPED)
  if (targets[0].w.grouped) return GroupProducts<F>(pool, x, m_len, targets);  // (all of them or none)
#endif
#if defined(JAXSERVE_QUANT_INTEGER)
  IntegerProducts<F>(pool, x, m_form, m_len, targets);
#else
  for (const Target& t : targets) FloatProduct<F>(pool, x, m_len, t.w, t.n_len, t.y);
#endif
}

template <Format F>  // Products on x as the handler receives it
void ProductsOf(ffi::ThreadPool& pool, ffi::AnyBuffer& x, int64_t m_len, const std::vector<Target>& targets) {
  const int64_t m_form = x.dimensions()[0];
  if (m_len == 0) return;
  if (IsBf16(x.element_type())) {
    Products<F>(pool, static_cast<const uint16_t*>(x.untyped_data()), m_form, m_len, targets);
  } else {
    Products<F>(pool, static_cast<const float*>(x.untyped_data()), m_form, m_len, targets);
  }
}

// One weight's operands as the handler receives them, and its y: in rows, data, scales and (int4)
// mins; grouped, `data` alone holds all three.
struct Operands {
  ffi::AnyBuffer data;
  std::optional<ffi::AnyBuffer> scales, mins;
  ffi::Result<ffi::AnyBuffer> y;
};

// Why the operands do not fit the format and layout (`grouped`: the weight as one operand), or "".
std::string CheckOperands(Format format, bool grouped, ffi::AnyBuffer& x, Operands& o) {
  if ((x.element_type() != ffi::DataType::F32 && !IsBf16(x.element_type())) ||
      (o.y->element_type() != ffi::DataType::F32 && !IsBf16(o.y->element_type()))) {
    return "x and y must be float32 or bfloat16";
  }
  const bool int8 = format == Format::kInt8;
  if (o.data.element_type() != (int8 ? ffi::DataType::S8 : ffi::DataType::U8)) {
    return int8 ? "data must be int8" : "data must be uint8";
  }
  auto xd = x.dimensions(), dd = o.data.dimensions(), yd = o.y->dimensions();
  if (xd.size() != 2 || dd.size() != 2 || yd.size() != 2) return "every operand must be 2-D";
  const int64_t k_len = xd[1], n_len = dd[0], row_bytes = int8 ? k_len : k_len / 2, blocks = k_len / kBlock;
  if (k_len % kBlock || yd[0] != xd[0] || yd[1] != n_len) return "x must be [M, K] (K a multiple of 32), y [M, N]";
  if (grouped) {
    return dd[1] == row_bytes + (int8 ? 2 : 4) * blocks ? "" : "a grouped weight must be [N, K + K / 16] (int4: "
                                                              "[N, K / 2 + K / 8]): its data, scales and mins";
  }
  if (!o.scales || o.scales->element_type() != ffi::DataType::F16 || o.mins.has_value() == int8 ||
      (o.mins && o.mins->element_type() != ffi::DataType::F16)) {
    return int8 ? "scales must be float16" : "scales and mins must be float16";
  }
  auto fits = [&](ffi::AnyBuffer& part) {
    return part.dimensions().size() == 2 && part.dimensions()[0] == n_len && part.dimensions()[1] == blocks;
  };
  if (dd[1] != row_bytes || !fits(*o.scales) || (o.mins && !fits(*o.mins))) {
    return "data must be [N, K] (int4: K / 2), scales and mins [N, K / 32]";
  }
  return "";
}

constexpr int64_t kGatedRows = 16;  // rows of y per work item of a gated call's activation (Multiply)

// y = x w^T for each weight (see the top) and x's first `live` rows (`LiveRows`; the other rows of
// y zero), every weight of `format`, in rows (`row_group` 0) or grouped (kGroupRows: quant.h); a
// bfloat16 y is computed in a float32 buffer and rounded at the end (every form writes all of it).
// `gated`: two weights (gate and up) of one y, silu(x gate^T) * (x up^T) (GatedRow), both products
// computed in float32 buffers.
ffi::Error Multiply(Format format, ffi::ThreadPool& pool, ffi::AnyBuffer& x, ffi::AnyBuffer& live,
                    std::vector<Operands>& weights, int64_t row_group, bool gated = false) {
  const int64_t m_len = LiveRows(live, x.dimensions()[0]), k_len = x.dimensions()[1];
  const bool grouped = row_group == kGroupRows;
#if defined(JAXSERVE_QUANT_GROUPED)
  const bool layouts_ok = row_group == 0 || grouped;
#else
  const bool layouts_ok = row_group == 0;  // (the float form reads rows only)
#endif
  if (!layouts_ok) {
    return ffi::Error::InvalidArgument("quantized matmul (cpu): row_group must be 0 (rows) or 16 (grouped, where "
                                       "an integer form runs)");
  }
  int64_t wide = 0;  // floats of the bfloat16 ys
  for (Operands& o : weights) {
    if (std::string why = CheckOperands(format, grouped, x, o); !why.empty()) {
      return ffi::Error::InvalidArgument("quantized matmul (cpu): " + why);
    }
    if (grouped && o.data.dimensions()[0] % kGroupRows) {
      return ffi::Error::InvalidArgument("quantized matmul (cpu): a grouped weight's rows must be a multiple of 16");
    }
    wide += gated || IsBf16(o.y->element_type()) ? m_len * o.data.dimensions()[0] : 0;
  }
  std::unique_ptr<float[]> buffer(new float[wide]);
  std::vector<Target> targets;
  int64_t used = 0;  // of the buffer
  const int64_t blocks = k_len / kBlock, row_bytes = format == Format::kInt8 ? k_len : k_len / 2;
  for (Operands& o : weights) {
    const int64_t n_len = o.data.dimensions()[0];
    const uint8_t* data = static_cast<const uint8_t*>(o.data.untyped_data());
    // (grouped: the scales, then the mins, after the data)
    const uint16_t* scales = grouped ? reinterpret_cast<const uint16_t*>(data + n_len * row_bytes)
                                     : static_cast<const uint16_t*>(o.scales->untyped_data());
    const uint16_t* mins = format == Format::kInt8 ? nullptr
                           : grouped               ? scales + n_len * blocks
                                                   : static_cast<const uint16_t*>(o.mins->untyped_data());
    const QuantW w{data, scales, mins, k_len, blocks, row_bytes, grouped};
    float* y = static_cast<float*>(o.y->untyped_data());
    if (gated || IsBf16(o.y->element_type())) {
      y = buffer.get() + used;
      used += m_len * n_len;
    }
    targets.push_back({w, n_len, y});
  }
  if (format == Format::kInt8) {
    ProductsOf<Format::kInt8>(pool, x, m_len, targets);
  } else {
    ProductsOf<Format::kInt4>(pool, x, m_len, targets);
  }
  if (gated) {
    ffi::Result<ffi::AnyBuffer>& y = weights[0].y;
    ZeroRowsFrom(y, m_len);
    const int64_t n_len = targets[0].n_len;
    ParallelFor(pool, CeilDiv(m_len, kGatedRows), [&](int64_t item, std::vector<float>& bits) {
      bits.resize(n_len);
      for (int64_t i = item * kGatedRows; i < std::min(m_len, (item + 1) * kGatedRows); ++i) {
        GatedRow(targets[0].y + i * n_len, targets[1].y + i * n_len, n_len, IsBf16(y->element_type()),
                 y->untyped_data(), i * n_len, reinterpret_cast<uint16_t*>(bits.data()));
      }
    });
    return ffi::Error::Success();
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    ffi::Result<ffi::AnyBuffer>& y = weights[i].y;
    ZeroRowsFrom(y, m_len);
    if (IsBf16(y->element_type())) {
      RoundToBf16(pool, targets[i].y, m_len * targets[i].n_len, static_cast<uint16_t*>(y->untyped_data()));
    }
  }
  return ffi::Error::Success();
}

// One weight in rows.
ffi::Error Int8MatmulT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer live, ffi::AnyBuffer data,
                       ffi::AnyBuffer scales, ffi::Result<ffi::AnyBuffer> y) {
  std::vector<Operands> weights{{data, scales, std::nullopt, y}};
  return Multiply(Format::kInt8, pool, x, live, weights, 0);
}

ffi::Error Int4MatmulT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer live, ffi::AnyBuffer data,
                       ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::Result<ffi::AnyBuffer> y) {
  std::vector<Operands> weights{{data, scales, mins, y}};
  return Multiply(Format::kInt4, pool, x, live, weights, 0);
}

// Several weights of one format and layout against the same x, each with its own y (or one grouped
// weight), or, `gated`, gate and up with one y (Multiply): the operands of each weight in turn, in rows
// data, scales (and mins, int4), grouped its one array; the format follows from the first data's dtype.
ffi::Error ManyMatmulT(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer live, ffi::RemainingArgs parts,
                       ffi::RemainingRets ys, int64_t row_group, int64_t gated) {
  const bool int8 = parts.size() > 0 && parts.get<ffi::AnyBuffer>(0)->element_type() == ffi::DataType::S8;
  const size_t per_weight = row_group == kGroupRows ? 1 : int8 ? 2 : 3, count = gated ? 2 : ys.size();
  if (ys.size() == 0 || (gated && ys.size() != 1) || parts.size() != per_weight * count) {
    return ffi::Error::InvalidArgument("quantized matmul (cpu): each y needs its weight's data, scales and, "
                                       "int4, mins (grouped: its one array); gated, two weights' of one y");
  }
  std::vector<Operands> weights;
  for (size_t i = 0; i < count; ++i) {
    auto part = [&](size_t j) { return std::optional(*parts.get<ffi::AnyBuffer>(per_weight * i + j)); };
    const bool has_mins = per_weight == 3;
    weights.push_back({*part(0), per_weight > 1 ? part(1) : std::nullopt, has_mins ? part(2) : std::nullopt,
                       *ys.get<ffi::AnyBuffer>(gated ? 0 : i)});
  }
  return Multiply(int8 ? Format::kInt8 : Format::kInt4, pool, x, live, weights, row_group, gated);
}

}  // namespace jaxserve::quant

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8MatmulT, jaxserve::quant::Int8MatmulT,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // live (see Multiply)
                                  .Arg<xla::ffi::AnyBuffer>()  // data
                                  .Arg<xla::ffi::AnyBuffer>()  // scales
                                  .Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt4MatmulT, jaxserve::quant::Int4MatmulT,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // live (see Multiply)
                                  .Arg<xla::ffi::AnyBuffer>()  // data
                                  .Arg<xla::ffi::AnyBuffer>()  // scales
                                  .Arg<xla::ffi::AnyBuffer>()  // mins
                                  .Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveManyMatmulT, jaxserve::quant::ManyMatmulT,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // live (see Multiply)
                                  .RemainingArgs()             // each weight's data, scales (, mins), or one array
                                  .RemainingRets()             // each weight's y (gated: one)
                                  .Attr<int64_t>("row_group")
                                  .Attr<int64_t>("gated"));

// The forms this build may run, by name, comma-separated: "integer", "tile", "float" (see the top;
// on AVX2, the integer form for grouped weights, the float form for weights in rows).
extern "C" const char* JaxserveQuantMatmulForms() {
#if defined(JAXSERVE_QUANT_TILES)
  if (jaxserve::quant::TilesPermitted()) return "integer,tile";
#endif
#if defined(JAXSERVE_QUANT_INTEGER)
  return "integer";
#elif defined(JAXSERVE_QUANT_BYTES)
  return "integer,float";
#else
  return "float";
#endif
}

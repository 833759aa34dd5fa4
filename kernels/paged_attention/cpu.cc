// Ragged paged attention for XLA:CPU, as an XLA FFI custom call (see cpu.py).
//
// Same semantics as reference.py: query row i of sequence b sits at position
// kv_lens[b] - q_len_b + i and attends causally (and within the sliding window) to the
// keys of its own pages; padding rows are zeros. Unlike the XLA implementations it reads
// each key straight from its page (no gathered copy of the context), visits only the keys
// a row can see (no masked padding up to the page-table width), and computes the scores
// of every query head in one pass over the keys.
//
// Work items are (sequence, block of up to 16 query rows), claimed from an atomic
// counter by the calling thread and by helpers scheduled on XLA's intra-op thread pool
// (common.h's ParallelFor).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace jaxserve {
namespace {

constexpr int64_t kRowsPerItem = 16;

// Elements are float32 or bfloat16 (as raw 16-bit words): widened to float32 for the math.
struct Elements {
  const void* data;
  bool bf16;
  // n elements from `offset` into `dst` (float32); returns where they can be read.
  inline const float* Read(int64_t offset, int64_t n, float* dst) const {
    if (!bf16) return static_cast<const float*>(data) + offset;
    const uint16_t* src = static_cast<const uint16_t*>(data) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
    return dst;
  }
};

inline float Dot(const float* a, const float* b, int64_t n) {
  Lanes even = {}, odd = {};  // two chains, so consecutive multiply-adds do not wait on each other
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    even += Load(a + i) * Load(b + i);
    odd += Load(a + i + kLanes) * Load(b + i + kLanes);
  }
  float s = Sum(even + odd);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

typedef int32_t IntLanes __attribute__((vector_size(32)));

// exp of 8 lanes (x <= 0 here: scores minus their maximum), Cephes' expf: 2^n * e^r with
// r = x - n ln 2 in [-ln2/2, ln2/2] and e^r by a degree-7 polynomial; within 2 ulp of expf.
inline Lanes Exp(Lanes x) {
  const Lanes lowest = Lanes{} - 87.3f;  // below: e^x < 2^-126, taken as 2^-126
  x = x < lowest ? lowest : x;
  const Lanes magic = Lanes{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  Lanes n = (x * 1.44269504088896341f + magic) - magic;
  Lanes r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Lanes poly = Lanes{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  Lanes e = poly * r * r + r + 1.0f;
  IntLanes scale = (__builtin_convertvector(n, IntLanes) + 127) << 23;
  Lanes two_n;
  std::memcpy(&two_n, &scale, sizeof(two_n));
  return e * two_n;
}

// x[i] = exp(x[i] - max) for i < n; returns their sum.
inline float ExpShifted(float* x, float max, int64_t n) {
  Lanes total = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Lanes e = Exp(Load(x + i) - max);
    Store(x + i, e);
    total += e;
  }
  float sum = Sum(total);
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - max));
  return sum;
}

inline void AddScaled(float* acc, float w, const float* x, int64_t n) {  // acc += w * x
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Store(acc + i, Load(acc + i) + w * Load(x + i));
  for (; i < n; ++i) acc[i] += w * x[i];
}

struct Problem {
  Elements q, k, v;
  void* out;
  bool out_bf16;
  const int32_t* kv_lens;
  const int32_t* page_table;
  const int32_t* query_start;
  int64_t num_heads, num_kv_heads, head_dim, page_size, pages_per_seq;
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t sliding_window;    // 0: none
};

struct Item {
  int64_t seq, first_row, end_row;
};

// One work item: every query head of every row of the block. A key's (and a value's) KV heads
// lie side by side in its page, so each is read as one contiguous row of num_kv_heads * head_dim.
void Attend(const Problem& p, const Item& item, std::vector<float>& scratch) {
  const int64_t heads = p.num_heads, group = heads / p.num_kv_heads, d = p.head_dim;
  const int64_t width = p.num_kv_heads * d;  // one key (or value) of every KV head
  const int64_t q_len = p.query_start[item.seq + 1] - p.query_start[item.seq];
  const int64_t kv_len = p.kv_lens[item.seq];
  const int32_t* pages = p.page_table + item.seq * p.pages_per_seq;
  // scratch: scores [heads][kv_len], the query row [heads][d], accumulators [heads][d], maxima
  // [heads], a key or value row [width]
  scratch.resize(heads * kv_len + 2 * heads * d + heads + width);
  float* scores = scratch.data();
  float* query = scores + heads * kv_len;
  float* acc = query + heads * d;
  float* maxima = acc + heads * d;
  float* row = maxima + heads;
  auto slot = [&](int64_t key) {  // where the key's row starts in the pages, in elements
    return (static_cast<int64_t>(pages[key / p.page_size]) * p.page_size + key % p.page_size) * width;
  };
  for (int64_t t = item.first_row; t < item.end_row; ++t) {
    const int64_t pos = kv_len - q_len + (t - p.query_start[item.seq]);
    const int64_t first_key = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
    // (keys past the page table's width are outside the context, as in the reference)
    const int64_t num_keys = std::min(pos + 1, p.pages_per_seq * p.page_size) - first_key;
    const float* q = p.q.Read(t * heads * d, heads * d, query);
    std::fill(maxima, maxima + heads, -INFINITY);
    for (int64_t j = 0; j < num_keys; ++j) {
      const float* k = p.k.Read(slot(first_key + j), width, row);
      for (int64_t h = 0; h < heads; ++h) {
        float s = Dot(q + h * d, k + (h / group) * d, d) * p.sm_scale;
        if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
        scores[h * kv_len + j] = s;
        maxima[h] = std::max(maxima[h], s);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores + h * kv_len;
      const float total = ExpShifted(s, maxima[h], num_keys);
      // Weights are normalized before the values are summed, as in the reference; in a bfloat16
      // cache they are rounded to bfloat16 too (the reference multiplies in the cache's dtype).
      for (int64_t j = 0; j < num_keys; ++j) s[j] = p.v.bf16 ? Bf16ToFloat(FloatToBf16(s[j] / total)) : s[j] / total;
    }
    std::fill(acc, acc + heads * d, 0.0f);
    for (int64_t j = 0; j < num_keys; ++j) {
      const float* v = p.v.Read(slot(first_key + j), width, row);
      for (int64_t h = 0; h < heads; ++h) AddScaled(acc + h * d, scores[h * kv_len + j], v + (h / group) * d, d);
    }
    if (p.out_bf16) {
      uint16_t* o = static_cast<uint16_t*>(p.out) + t * heads * d;
      for (int64_t i = 0; i < heads * d; ++i) o[i] = FloatToBf16(acc[i]);
    } else {
      std::memcpy(static_cast<float*>(p.out) + t * heads * d, acc, heads * d * sizeof(float));
    }
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::Result<ffi::AnyBuffer> out, float sm_scale, int64_t sliding_window, float soft_cap) {
  for (ffi::DataType t : {q.element_type(), k_pages.element_type(), v_pages.element_type()}) {
    if (t != ffi::DataType::F32 && !IsBf16(t)) {
      return ffi::Error::InvalidArgument("paged attention (cpu): q and the pages must be float32 or bfloat16");
    }
  }
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || page_table.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged attention (cpu): q must be [T, H, D], pages [N, S, KV, D]");
  }
  Problem p;
  p.q = {q.untyped_data(), IsBf16(q.element_type())};
  p.k = {k_pages.untyped_data(), IsBf16(k_pages.element_type())};
  p.v = {v_pages.untyped_data(), IsBf16(v_pages.element_type())};
  p.out = out->untyped_data();
  p.out_bf16 = IsBf16(out->element_type());
  p.kv_lens = kv_lens.typed_data();
  p.page_table = page_table.typed_data();
  p.query_start = query_start.typed_data();
  p.num_heads = qd[1];
  p.head_dim = qd[2];
  p.page_size = kd[1];
  p.num_kv_heads = kd[2];
  p.pages_per_seq = page_table.dimensions()[1];
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.sliding_window = sliding_window;

  std::memset(out->untyped_data(), 0, out->size_bytes());  // padding rows stay zero
  const int64_t seqs = std::min<int64_t>(num_seqs.typed_data()[0], kv_lens.dimensions()[0]);
  std::vector<Item> items;
  for (int64_t b = 0; b < seqs; ++b) {
    for (int64_t first = p.query_start[b]; first < p.query_start[b + 1]; first += kRowsPerItem) {
      items.push_back({b, first, std::min<int64_t>(first + kRowsPerItem, p.query_start[b + 1])});
    }
  }
  ParallelFor(pool, static_cast<int64_t>(items.size()),
              [&](int64_t i, std::vector<float>& scratch) { Attend(p, items[i], scratch); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, jaxserve::PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

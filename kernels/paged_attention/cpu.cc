// Ragged paged attention for XLA:CPU, as an XLA FFI custom call (see cpu.py).
//
// Same semantics as reference.py: query row i of sequence b sits at position
// kv_lens[b] - q_len_b + i and attends causally (and within the sliding window) to the
// keys of its own pages; padding rows are zeros. Unlike the XLA implementations it reads
// each key straight from its page (no gathered copy of the context) and visits only the keys
// a row can see (no masked padding up to the page-table width).
//
// For each query row: the scores of every query head, 4 keys at a time (a block's slots are read
// for every KV head while they are in L1; per query head, 4 accumulators over the head dimension,
// summed horizontally together), the softmax over each head's row of scores, then the weighted
// sum of values, 8 at a time, with the sums of 2 heads x 32 dimensions in registers. Keys and
// values are read in their own dtype and widened in registers.
//
// Work items are (sequence, block of up to 16 query rows), claimed from an atomic counter by the
// calling thread and by helpers scheduled on XLA's intra-op thread pool (common.h's ParallelFor).
// An item takes all KV heads, so that a key's slot (every KV head side by side) is read at once.
// (Splitting one decoding sequence's KV heads over the threads made an engine step faster in
// isolation, but the server's one-stream decode slower and less steady: the threads it waits for
// share the cores with the server's own.)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace jaxserve {
namespace {

constexpr int64_t kRowsPerItem = 16;
constexpr int64_t kKeysPerBlock = 4;     // keys whose scores are computed together
constexpr int64_t kValuesPerBlock = 8;   // values summed for every head before the next ones
constexpr int64_t kHeadsPerPass = 2;  // heads and 8-lane chunks of d whose value sums stay in registers
constexpr int64_t kChunksPerPass = 4;

typedef float Quad __attribute__((vector_size(16)));
typedef int32_t IntLanes __attribute__((vector_size(32)));
typedef uint32_t Words __attribute__((vector_size(32)));

inline Quad Fold(Lanes v) {  // the two halves added
  Quad low, high;
  std::memcpy(&low, &v, sizeof(low));
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(low), sizeof(high));
  return low + high;
}

// The horizontal sums of a, b, c and d, as one vector.
inline Quad Sum4(Lanes a, Lanes b, Lanes c, Lanes d) {
  const Quad qa = Fold(a), qb = Fold(b), qc = Fold(c), qd = Fold(d);
  const Quad ab = __builtin_shufflevector(qa, qb, 0, 4, 1, 5) + __builtin_shufflevector(qa, qb, 2, 6, 3, 7);
  const Quad cd = __builtin_shufflevector(qc, qd, 0, 4, 1, 5) + __builtin_shufflevector(qc, qd, 2, 6, 3, 7);
  return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
}

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

// x[i] /= total for i < n, rounded to bfloat16 (as float32) where `round`: the softmax weights, as
// the reference normalizes them before the values are summed (in the cache's dtype).
inline void Normalize(float* x, float total, int64_t n, bool round) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Lanes p = Load(x + i) / total;
    if (round) {  // to nearest even, as FloatToBf16 (the weights are finite)
      Words bits;
      std::memcpy(&bits, &p, sizeof(bits));
      bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
      std::memcpy(&p, &bits, sizeof(p));
    }
    Store(x + i, p);
  }
  for (; i < n; ++i) x[i] = round ? Bf16ToFloat(FloatToBf16(x[i] / total)) : x[i] / total;
}

struct Problem {
  const void* q;
  const void *k, *v;  // pages [N, S, KV, D] of T (float or uint16_t: bfloat16 bits)
  void* out;
  bool q_bf16, out_bf16;
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

// scores[h * ld + j] = q_h . key j for the query heads h of `kv_heads` KV heads (`group` each, rows
// of q [heads, d]), key j's KV head g at base + offsets[j] + g * d. Keys go 4 at a time, each
// block's slots read for every KV head while they are in the L1 cache.
template <typename T>
void Scores(const float* q, int64_t kv_heads, int64_t group, const T* base, const int64_t* offsets, int64_t n,
            int64_t d, float* scores, int64_t ld) {
  const int64_t whole = d / kLanes * kLanes;
  int64_t j = 0;
  for (; j + kKeysPerBlock <= n; j += kKeysPerBlock) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      const T *k0 = base + offsets[j] + g * d, *k1 = base + offsets[j + 1] + g * d,
              *k2 = base + offsets[j + 2] + g * d, *k3 = base + offsets[j + 3] + g * d;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qh = q + h * d;
        Lanes a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int64_t c = 0; c < whole; c += kLanes) {
          Lanes x = Load(qh + c);
          InRegister(x);
          a0 += x * Load(k0 + c);
          a1 += x * Load(k1 + c);
          a2 += x * Load(k2 + c);
          a3 += x * Load(k3 + c);
        }
        Quad s = Sum4(a0, a1, a2, a3);
        for (int64_t c = whole; c < d; ++c) {
          s += qh[c] * Quad{Widen(k0[c]), Widen(k1[c]), Widen(k2[c]), Widen(k3[c])};
        }
        std::memcpy(scores + h * ld + j, &s, sizeof(s));
      }
    }
  }
  for (; j < n; ++j) {
    for (int64_t h = 0; h < kv_heads * group; ++h) {
      const T* k = base + offsets[j] + h / group * d;
      const float* qh = q + h * d;
      Lanes a = {};
      for (int64_t c = 0; c < whole; c += kLanes) a += Load(qh + c) * Load(k + c);
      float s = Sum(a);
      for (int64_t c = whole; c < d; ++c) s += qh[c] * Widen(k[c]);
      scores[h * ld + j] = s;
    }
  }
}

// out[h * d + c0 + i] += sum_j w[h * ld + j] * value j[c0 + i] for H heads and the C chunks of 8
// dimensions from c0, over the n values at base + offsets[j].
template <int H, int C, typename T>
void ValuePass(const float* w, int64_t ld, const T* base, const int64_t* offsets, int64_t n, int64_t c0,
               float* out, int64_t d) {
  Lanes acc[H][C];
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) acc[h][c] = Load(out + h * d + c0 + c * kLanes);
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* v = base + offsets[j] + c0;
    Lanes vs[C];
    for (int c = 0; c < C; ++c) {
      vs[c] = Load(v + c * kLanes);
      InRegister(vs[c]);
    }
    for (int h = 0; h < H; ++h) {
      const float p = w[h * ld + j];
      for (int c = 0; c < C; ++c) acc[h][c] += p * vs[c];
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) Store(out + h * d + c0 + c * kLanes, acc[h][c]);
  }
}

template <int H, typename T>
void ValueChunks(const float* w, int64_t ld, const T* base, const int64_t* offsets, int64_t n, int64_t c0,
                 int64_t chunks, float* out, int64_t d) {
  switch (chunks) {
    case 4: return ValuePass<H, 4>(w, ld, base, offsets, n, c0, out, d);
    case 3: return ValuePass<H, 3>(w, ld, base, offsets, n, c0, out, d);
    case 2: return ValuePass<H, 2>(w, ld, base, offsets, n, c0, out, d);
    default: return ValuePass<H, 1>(w, ld, base, offsets, n, c0, out, d);
  }
}

// out [heads, d] = w [heads, n] (rows ld apart) times the n values, for the query heads of
// `kv_heads` KV heads as in Scores. Values go kValuesPerBlock at a time, each block's slots read
// for every head while they are in the L1 cache, the sums of 2 heads x 4 chunks of 8 dimensions
// in registers.
template <typename T>
void Values(const float* w, int64_t kv_heads, int64_t group, int64_t ld, const T* base, const int64_t* offsets,
            int64_t n, int64_t d, float* out) {
  static_assert(kHeadsPerPass == 2, "Values passes the heads in pairs and a single one");
  const int64_t heads = kv_heads * group, whole = d / kLanes;
  std::fill(out, out + heads * d, 0.0f);
  for (int64_t j = 0; j < n; j += kValuesPerBlock) {
    const int64_t keys = std::min(kValuesPerBlock, n - j);
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t h = g * group; h < (g + 1) * group; h += kHeadsPerPass) {
        for (int64_t c = 0; c < whole; c += kChunksPerPass) {
          const int64_t chunks = std::min(kChunksPerPass, whole - c);
          if ((g + 1) * group - h >= 2) {
            ValueChunks<2>(w + h * ld + j, ld, base + g * d, offsets + j, keys, c * kLanes, chunks, out + h * d, d);
          } else {
            ValueChunks<1>(w + h * ld + j, ld, base + g * d, offsets + j, keys, c * kLanes, chunks, out + h * d, d);
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {  // the dimensions past the last whole chunk
    for (int64_t c = whole * kLanes; c < d; ++c) {
      float s = 0.0f;
      for (int64_t j = 0; j < n; ++j) s += w[h * ld + j] * Widen(base[offsets[j] + h / group * d + c]);
      out[h * d + c] = s;
    }
  }
}

// One work item: every query head, for every row of its block.
template <typename T>
void Attend(const Problem& p, const Item& item, std::vector<float>& scratch) {
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim;
  const int64_t kv_heads = p.num_kv_heads, heads = p.num_heads;
  const int64_t width = p.num_kv_heads * d;  // one key (or value) slot: every KV head side by side
  const int64_t q_len = p.query_start[item.seq + 1] - p.query_start[item.seq];
  const int64_t kv_len = p.kv_lens[item.seq];
  // (keys past the page table's width are outside the context, as in the reference)
  const int64_t visible = std::min(kv_len, p.pages_per_seq * p.page_size);
  const int32_t* pages = p.page_table + item.seq * p.pages_per_seq;
  const T* k_pages = static_cast<const T*>(p.k);
  const T* v_pages = static_cast<const T*>(p.v);
  // scratch: scores [heads][kv_len], the query rows [heads][d] and their outputs [heads][d]; and
  // where each key's slot starts in the pages
  scratch.resize(heads * kv_len + 2 * heads * d);
  float* scores = scratch.data();
  float* query = scores + heads * kv_len;
  float* acc = query + heads * d;
  thread_local std::vector<int64_t> slots;
  slots.resize(visible);
  for (int64_t key = 0; key < visible; ++key) {
    slots[key] = (static_cast<int64_t>(pages[key / p.page_size]) * p.page_size + key % p.page_size) * width;
  }
  for (int64_t t = item.first_row; t < item.end_row; ++t) {
    const int64_t pos = kv_len - q_len + (t - p.query_start[item.seq]);
    const int64_t first_key = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
    const int64_t num_keys = std::min(pos + 1, visible) - first_key;
    const int64_t* keys = slots.data() + first_key;
    const int64_t in = t * heads * d;  // the row's first query head
    for (int64_t i = 0; i < heads * d; ++i) {
      query[i] = p.q_bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(p.q)[in + i]) : static_cast<const float*>(p.q)[in + i];
    }
    Scores(query, kv_heads, group, k_pages, keys, num_keys, d, scores, kv_len);
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores + h * kv_len;
      float max = -INFINITY;
      for (int64_t j = 0; j < num_keys; ++j) {
        float x = s[j] * p.sm_scale;
        if (p.soft_cap > 0.0f) x = p.soft_cap * std::tanh(x / p.soft_cap);
        s[j] = x;
        max = std::max(max, x);
      }
      Normalize(s, ExpShifted(s, max, num_keys), num_keys, std::is_same_v<T, uint16_t>);
    }
    Values(scores, kv_heads, group, kv_len, v_pages, keys, num_keys, d, acc);
    if (p.out_bf16) {
      uint16_t* o = static_cast<uint16_t*>(p.out) + in;
      for (int64_t i = 0; i < heads * d; ++i) o[i] = FloatToBf16(acc[i]);
    } else {
      std::memcpy(static_cast<float*>(p.out) + in, acc, heads * d * sizeof(float));
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
  const bool pages_bf16 = IsBf16(k_pages.element_type());
  if (IsBf16(v_pages.element_type()) != pages_bf16) {
    return ffi::Error::InvalidArgument("paged attention (cpu): the K and V pages must have one dtype");
  }
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || page_table.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged attention (cpu): q must be [T, H, D], pages [N, S, KV, D]");
  }
  Problem p;
  p.q = q.untyped_data();
  p.q_bf16 = IsBf16(q.element_type());
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
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
  ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i, std::vector<float>& scratch) {
    if (pages_bf16) {
      Attend<uint16_t>(p, items[i], scratch);
    } else {
      Attend<float>(p, items[i], scratch);
    }
  });
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

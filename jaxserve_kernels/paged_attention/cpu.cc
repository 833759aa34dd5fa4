// Ragged paged attention for XLA:CPU, as an XLA FFI custom call (see cpu.py).
//
// Same semantics as reference.py: query row i of sequence b sits at position
// kv_lens[b] - q_len_b + i and attends causally (and within the sliding window) to the
// keys of its own pages; padding rows are zeros. Unlike the XLA implementations it reads
// each key straight from its page (no gathered copy of the context) and visits only the keys
// a row can see (no masked padding up to the page-table width).
//
// A work item of several query rows (a prefill chunk, drafts to verify) takes AttendBlock: per KV
// head, the rows of its query heads are the lanes of 16-lane vectors, so that each key and value read
// serves them all (bench/paged_attention.py, its CPU shapes); in bfloat16 on a CPU with AVX512-BF16,
// two dimensions (scores) or two keys (values) per multiply-add (PairBlockHead). It sums in another
// order than the one-row form, so a batch-invariant step (`block_rows` 0) keeps every row in the
// one-row form.
//
// A decode row alone: the scores of every query head, 4 keys at a time (a block's slots are read
// for every KV head while they are in L1; bfloat16 keys widened once for the KV head's query heads;
// per query head, 4 accumulators over the head dimension, summed horizontally together), the
// softmax over each head's row of scores, then the weighted sum of values, 8 at a time, with the
// sums of up to 4 heads x 64 dimensions in registers (2 x 32 without AVX-512: its vectors are 16
// lanes there, 8 elsewhere). Values are read in their own dtype and widened in registers.
//
// Work items are (sequence, block of up to 16 query rows), claimed from an atomic counter by the
// calling thread and by helpers scheduled on XLA's intra-op thread pool (common.h's ParallelFor).
// An item takes all KV heads, so that a key's slot (every KV head side by side) is read at once.
// A decode row alone in the call (one stream) splits its keys in two halves instead, over the
// kernels' own helper (AttendSplit). (Splitting its KV heads, 2 and 1 of 3, was slower.)

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
// The one-row form's vectors: 16 lanes where AVX-512 gives 32 registers of them, 8 elsewhere; and
// how many query heads' value sums (of kChunksPerPass vectors of d each) stay in registers.
#if defined(__AVX512F__)
typedef Wide RowLanes;
constexpr int64_t kHeadsPerPass = 4;
#else
typedef Lanes RowLanes;
constexpr int64_t kHeadsPerPass = 2;
#endif
constexpr int64_t kRowLanes = sizeof(RowLanes) / sizeof(float);
constexpr int64_t kChunksPerPass = 4;

typedef float Quad __attribute__((vector_size(16)));

inline Quad Fold(Lanes v) {  // the two halves added
  return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
}

// The horizontal sums of a, b, c and d, as one vector.
inline Quad Sum4(Lanes a, Lanes b, Lanes c, Lanes d) {
  const Quad qa = Fold(a), qb = Fold(b), qc = Fold(c), qd = Fold(d);
  const Quad ab = __builtin_shufflevector(qa, qb, 0, 4, 1, 5) + __builtin_shufflevector(qa, qb, 2, 6, 3, 7);
  const Quad cd = __builtin_shufflevector(qc, qd, 0, 4, 1, 5) + __builtin_shufflevector(qc, qd, 2, 6, 3, 7);
  return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
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

// x[i] *= scale for i < n; returns their largest.
inline float Scale(float* x, int64_t n, float scale) {
  Lanes top = Lanes{} - INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes v = Load(x + i) * scale;
    Store(x + i, v);
    top = v > top ? v : top;
  }
  float max = -INFINITY;
  for (int64_t l = 0; l < kLanes; ++l) max = std::max(max, top[l]);
  for (; i < n; ++i) max = std::max(max, x[i] *= scale);
  return max;
}

// x[i] = cap * tanh(x[i] * scale / cap) for i < n (logit soft-capping); returns their largest.
inline float ScaleCapped(float* x, int64_t n, float scale, float cap) {
  float max = -INFINITY;
  for (int64_t i = 0; i < n; ++i) max = std::max(max, x[i] = cap * std::tanh(x[i] * scale / cap));
  return max;
}

// x[i] /= total for i < n, rounded to bfloat16 (as float32) where `round`: the softmax weights, as
// the reference normalizes them before the values are summed (in the cache's dtype).
inline void Normalize(float* x, float total, int64_t n, bool round) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Lanes p = Load(x + i) / total;
    Store(x + i, round ? Bf16Values(p) : p);
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
  int64_t block_rows;        // items of this many query rows and more take AttendBlock; 0: none
};

struct Item {
  int64_t seq, first_row, end_row;
};

// The keys of an item's sequence that its query row t sees: [Begin(t), End(t)). Row t sits at
// position kv_len - q_len + (t - start); keys past the page table's width are outside the context, as
// in the reference.
struct Keys {
  int64_t start, q_len, kv_len, visible, window;
  Keys(const Problem& p, const Item& item)
      : start(p.query_start[item.seq]), q_len(p.query_start[item.seq + 1] - start), kv_len(p.kv_lens[item.seq]),
        visible(std::min(kv_len, p.pages_per_seq * p.page_size)), window(p.sliding_window) {}
  int64_t Position(int64_t t) const { return kv_len - q_len + (t - start); }
  int64_t Begin(int64_t t) const { return window > 0 ? std::max<int64_t>(0, Position(t) - window + 1) : 0; }
  int64_t End(int64_t t) const { return std::min(Position(t) + 1, visible); }
};

// slots[j] = where key first + j's slot (every KV head side by side) starts in the sequence's pages, j < n.
inline void Slots(const Problem& p, int64_t seq, int64_t first, int64_t n, std::vector<int64_t>& slots) {
  const int32_t* pages = p.page_table + seq * p.pages_per_seq;
  const int64_t width = p.num_kv_heads * p.head_dim;
  slots.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t key = first + j;
    slots[j] = (static_cast<int64_t>(pages[key / p.page_size]) * p.page_size + key % p.page_size) * width;
  }
}

// A decode row's keys and values come from memory (the weights a step streams evict them between
// steps), and read in order they arrive a line or two at a time. So while scoring key j, Scores asks
// for key j + kKeysAhead's slot and value j's (needed once every score is known) by prefetches.
constexpr int64_t kKeysAhead = 16;

template <int Locality, typename T>  // (__builtin_prefetch takes its locality as a constant)
inline void PrefetchSlot(const T* slot, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(slot);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, Locality);
}

inline Lanes LoadAs(Lanes, const float* p) { return Load(p); }
inline Lanes LoadAs(Lanes, const uint16_t* p) { return Load(p); }
inline Wide LoadAs(Wide, const float* p) { return LoadWide(p); }
inline Wide LoadAs(Wide, const uint16_t* p) { return LoadWide(p); }
inline void StoreAs(float* p, Lanes v) { Store(p, v); }
inline void StoreAs(float* p, Wide v) { StoreWide(p, v); }

inline Lanes Halves(Lanes v) { return v; }
inline Lanes Halves(Wide v) {  // the two halves added (shuffles: a copy through memory kept v on the stack)
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}

// out[0..d) = the d values at x, as float32.
template <typename T>
inline void Widened(const T* x, int64_t d, float* out) {
  int64_t c = 0;
  for (; c + kRowLanes <= d; c += kRowLanes) StoreAs(out + c, LoadAs(RowLanes{}, x + c));
  for (; c < d; ++c) out[c] = Widen(x[c]);
}

// out[h * ld + 0..3] = q_h . k0..k3 for the `heads` query rows of q [heads, d] (keys of either dtype).
template <typename K>
inline void ScoreFour(const float* q, int64_t heads, const K* k0, const K* k1, const K* k2, const K* k3, int64_t d,
                      float* out, int64_t ld) {
  const int64_t whole = d / kRowLanes * kRowLanes;
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * d;
    RowLanes a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t c = 0; c < whole; c += kRowLanes) {
      RowLanes x = LoadAs(RowLanes{}, qh + c);
      InRegister(x);
      a0 += x * LoadAs(RowLanes{}, k0 + c);
      a1 += x * LoadAs(RowLanes{}, k1 + c);
      a2 += x * LoadAs(RowLanes{}, k2 + c);
      a3 += x * LoadAs(RowLanes{}, k3 + c);
    }
    Quad s = Sum4(Halves(a0), Halves(a1), Halves(a2), Halves(a3));
    for (int64_t c = whole; c < d; ++c) s += qh[c] * Quad{Widen(k0[c]), Widen(k1[c]), Widen(k2[c]), Widen(k3[c])};
    std::memcpy(out + h * ld, &s, sizeof(s));
  }
}

// scores[h * ld + j] = q_h . key j for the query heads h of `kv_heads` KV heads (`group` each, rows
// of q [heads, d]), key j's KV head g at base + offsets[j] + g * d. Keys go 4 at a time, each
// block's slots read for every KV head while they are in the L1 cache.
template <typename T>
void Scores(const float* q, int64_t kv_heads, int64_t group, const T* base, const int64_t* offsets, int64_t n,
            int64_t d, float* scores, int64_t ld, const T* values) {
  const int64_t whole = d / kLanes * kLanes, slot = kv_heads * d * sizeof(T);
  thread_local std::vector<float> widened;
  widened.resize(kKeysPerBlock * d);
  for (int64_t j = 0; j < std::min(n, kKeysAhead); ++j) PrefetchSlot<3>(base + offsets[j], slot);
  int64_t j = 0;
  for (; j + kKeysPerBlock <= n; j += kKeysPerBlock) {
    for (int64_t a = j; a < j + kKeysPerBlock; ++a) {
      if (a + kKeysAhead < n) PrefetchSlot<3>(base + offsets[a + kKeysAhead], slot);
      PrefetchSlot<1>(values + offsets[a], slot);
    }
    for (int64_t g = 0; g < kv_heads; ++g) {
      const T *k0 = base + offsets[j] + g * d, *k1 = base + offsets[j + 1] + g * d,
              *k2 = base + offsets[j + 2] + g * d, *k3 = base + offsets[j + 3] + g * d;
      float* out = scores + g * group * ld + j;
      if (std::is_same_v<T, float> || group == 1) {
        ScoreFour(q + g * group * d, group, k0, k1, k2, k3, d, out, ld);
      } else {  // bfloat16 keys widened once for the group's query heads, not once per head
        const T* keys[kKeysPerBlock] = {k0, k1, k2, k3};
        for (int64_t a = 0; a < kKeysPerBlock; ++a) Widened(keys[a], d, widened.data() + a * d);
        const float* w = widened.data();
        ScoreFour(q + g * group * d, group, w, w + d, w + 2 * d, w + 3 * d, d, out, ld);
      }
    }
  }
  for (; j < n; ++j) {
    PrefetchSlot<1>(values + offsets[j], slot);
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

// out[h * d + c0 + i] += sum_j w[h * w_row + j * w_key] * value j[c0 + i] for H rows of weights and
// the C chunks of V's lanes from c0, over the n values at base + offsets[j].
template <typename V, int H, int C, typename T>
void ValuePass(const float* w, int64_t w_row, int64_t w_key, const T* base, const int64_t* offsets, int64_t n,
               int64_t c0, float* out, int64_t d) {
  constexpr int64_t lanes = sizeof(V) / sizeof(float);
  V acc[H][C];
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) acc[h][c] = LoadAs(V{}, out + h * d + c0 + c * lanes);
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* v = base + offsets[j] + c0;
    V vs[C];
    for (int c = 0; c < C; ++c) {
      vs[c] = LoadAs(V{}, v + c * lanes);
      if constexpr (std::is_same_v<V, Lanes>) InRegister(vs[c]);
    }
    for (int h = 0; h < H; ++h) {
      const float p = w[h * w_row + j * w_key];
      for (int c = 0; c < C; ++c) acc[h][c] += p * vs[c];
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) StoreAs(out + h * d + c0 + c * lanes, acc[h][c]);
  }
}

template <typename V, int H, typename T>
void ValueChunks(const float* w, int64_t w_row, int64_t w_key, const T* base, const int64_t* offsets, int64_t n,
                 int64_t c0, int64_t chunks, float* out, int64_t d) {
  switch (chunks) {
    case 4: return ValuePass<V, H, 4>(w, w_row, w_key, base, offsets, n, c0, out, d);
    case 3: return ValuePass<V, H, 3>(w, w_row, w_key, base, offsets, n, c0, out, d);
    case 2: return ValuePass<V, H, 2>(w, w_row, w_key, base, offsets, n, c0, out, d);
    default: return ValuePass<V, H, 1>(w, w_row, w_key, base, offsets, n, c0, out, d);
  }
}

template <typename T>
void ValueHeads(int64_t heads, const float* w, int64_t w_row, const T* base, const int64_t* offsets, int64_t n,
                int64_t c0, int64_t chunks, float* out, int64_t d) {
  static_assert(kHeadsPerPass == 2 || kHeadsPerPass == 4, "ValueHeads passes 1 to kHeadsPerPass heads");
  switch (heads) {
    case 1: return ValueChunks<RowLanes, 1>(w, w_row, 1, base, offsets, n, c0, chunks, out, d);
    case 2: return ValueChunks<RowLanes, 2>(w, w_row, 1, base, offsets, n, c0, chunks, out, d);
#if defined(__AVX512F__)
    case 3: return ValueChunks<RowLanes, 3>(w, w_row, 1, base, offsets, n, c0, chunks, out, d);
    default: return ValueChunks<RowLanes, 4>(w, w_row, 1, base, offsets, n, c0, chunks, out, d);
#endif
  }
}

// out [heads, d] = w [heads, n] (rows ld apart) times the n values, for the query heads of
// `kv_heads` KV heads as in Scores. Values go kValuesPerBlock at a time, each block's slots read
// for every head while they are in the L1 cache, the sums of up to kHeadsPerPass heads x 4 vectors
// of dimensions in registers.
template <typename T>
void Values(const float* w, int64_t kv_heads, int64_t group, int64_t ld, const T* base, const int64_t* offsets,
            int64_t n, int64_t d, float* out) {
  const int64_t heads = kv_heads * group, whole = d / kRowLanes;
  std::fill(out, out + heads * d, 0.0f);
  for (int64_t j = 0; j < n; j += kValuesPerBlock) {
    const int64_t keys = std::min(kValuesPerBlock, n - j);
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t h = g * group; h < (g + 1) * group; h += kHeadsPerPass) {
        const int64_t pass = std::min(kHeadsPerPass, (g + 1) * group - h);
        for (int64_t c = 0; c < whole; c += kChunksPerPass) {
          ValueHeads(pass, w + h * ld + j, ld, base + g * d, offsets + j, keys, c * kRowLanes,
                     std::min(kChunksPerPass, whole - c), out + h * d, d);
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {  // the dimensions past the last whole vector
    for (int64_t c = whole * kRowLanes; c < d; ++c) {
      float s = 0.0f;
      for (int64_t j = 0; j < n; ++j) s += w[h * ld + j] * Widen(base[offsets[j] + h / group * d + c]);
      out[h * d + c] = s;
    }
  }
}

// Blocks of query rows (prefill chunks): per KV head, the item's rows of its query heads side by
// side as the lanes of 16-lane vectors, so that each key and value read serves all of them. Scores
// are kept as st [keys][ld] (a key's scores for every row in lanes), from 16 keys at a time widened
// into kb [16][d], against the queries transposed as qt [d][ld].

// st[j * ld + m0 + ...] = key j . query rows m0.. for J keys of kb and C chunks of 16 rows.
template <int J, int C>
void ScoreTile(const float* kb, int64_t d, const float* qt, int64_t ld, int64_t m0, float* st) {
  Wide acc[J][C] = {};
  for (int64_t c = 0; c < d; ++c) {
    Wide qs[C];
    for (int i = 0; i < C; ++i) qs[i] = LoadWide(qt + c * ld + m0 + i * kWide);
    for (int j = 0; j < J; ++j) {
      const float k = kb[j * d + c];
      for (int i = 0; i < C; ++i) acc[j][i] += k * qs[i];
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int i = 0; i < C; ++i) StoreWide(st + j * ld + m0 + i * kWide, acc[j][i]);
  }
}

// The scores of the 16 keys of kb for every row of qt: tiles of up to 4 chunks of rows, with enough
// keys that the tile keeps 8 or more sums in flight.
void ScoreBlock(const float* kb, int64_t d, const float* qt, int64_t ld, float* st) {
  for (int64_t m0 = 0; m0 < ld;) {
    const int64_t chunks = std::min<int64_t>(4, (ld - m0) / kWide);
    const int64_t keys = chunks <= 2 ? 8 : 4;
    for (int64_t j = 0; j < kWide; j += keys) {
      const float* k = kb + j * d;
      float* s = st + j * ld;
      switch (chunks) {
        case 1: ScoreTile<8, 1>(k, d, qt, ld, m0, s); break;
        case 2: ScoreTile<8, 2>(k, d, qt, ld, m0, s); break;
        case 3: ScoreTile<4, 3>(k, d, qt, ld, m0, s); break;
        default: ScoreTile<4, 4>(k, d, qt, ld, m0, s);
      }
    }
    m0 += chunks * kWide;
  }
}

// Each lane's softmax over keys [lo, hi) of its own of st [n][ld] (scaled, soft-capped), the other
// keys' weights 0, rounded to bfloat16 values where `round` (as Normalize).
void SoftmaxLanes(float* st, int64_t n, int64_t ld, const int32_t* lo, const int32_t* hi, float scale,
                  float soft_cap, bool round) {
  for (int64_t m0 = 0; m0 < ld; m0 += kWide) {
    IntWide l, h;
    std::memcpy(&l, lo + m0, sizeof(l));
    std::memcpy(&h, hi + m0, sizeof(h));
    const Wide none = Wide{} - INFINITY;
    Wide max = none;
    for (int64_t j = 0; j < n; ++j) {
      Wide x = LoadWide(st + j * ld + m0) * scale;
      if (soft_cap > 0.0f) {
        for (int i = 0; i < kWide; ++i) x[i] = soft_cap * std::tanh(x[i] / soft_cap);
      }
      StoreWide(st + j * ld + m0, x);
      const IntWide at = IntWide{} + static_cast<int32_t>(j), seen = (at >= l) & (at < h);
      max = seen ? (x > max ? x : max) : max;
    }
    Wide total = {};
    for (int64_t j = 0; j < n; ++j) {
      const IntWide at = IntWide{} + static_cast<int32_t>(j), seen = (at >= l) & (at < h);
      const Wide e = seen ? Exp(LoadWide(st + j * ld + m0) - max) : Wide{};
      StoreWide(st + j * ld + m0, e);
      total += e;
    }
    const IntWide any = total > 0.0f;  // (a lane with no keys: zeros, not 0 / 0)
    const Wide divisor = any ? total : Wide{} + 1.0f;
    for (int64_t j = 0; j < n; ++j) {
      const Wide p = LoadWide(st + j * ld + m0) / divisor;
      StoreWide(st + j * ld + m0, round ? Bf16Values(p) : p);
    }
  }
}

// o [lanes][d] = one KV head's attention for a block's lanes (the float form): queries transposed
// into qt, keys widened 16 at a time into kb, scores st [keys][ld], values summed 4 lanes at a time.
template <typename T>
void FloatBlockHead(const Problem& p, const Item& item, int64_t g, int64_t n, int64_t ld, const int32_t* lo,
                    const int32_t* hi, const int64_t* slots, std::vector<float>& scratch, float* o) {
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim, heads = p.num_heads;
  const int64_t lanes = (item.end_row - item.first_row) * group, padded = CeilDiv(n, kWide) * kWide;
  scratch.resize(d * ld + kWide * d + padded * ld);
  float *qt = scratch.data(), *kb = qt + d * ld, *st = kb + kWide * d;
  std::fill(qt, qt + d * ld, 0.0f);
  for (int64_t m = 0; m < lanes; ++m) {
    const int64_t in = ((item.first_row + m / group) * heads + g * group + m % group) * d;
    for (int64_t c = 0; c < d; ++c) {
      qt[c * ld + m] = p.q_bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(p.q)[in + c])
                                : static_cast<const float*>(p.q)[in + c];
    }
  }
  const T* k_pages = static_cast<const T*>(p.k) + g * d;
  for (int64_t j0 = 0; j0 < n; j0 += kWide) {
    std::fill(kb, kb + kWide * d, 0.0f);
    for (int64_t j = j0; j < std::min(n, j0 + kWide); ++j) {
      for (int64_t c = 0; c < d; ++c) kb[(j - j0) * d + c] = Widen(k_pages[slots[j] + c]);
    }
    ScoreBlock(kb, d, qt, ld, st + j0 * ld);
  }
  SoftmaxLanes(st, n, ld, lo, hi, p.sm_scale, p.soft_cap, std::is_same_v<T, uint16_t>);
  std::fill(o, o + ld * d, 0.0f);
  const T* values = static_cast<const T*>(p.v) + g * d;
  const int64_t whole = d / kWide;
  for (int64_t m0 = 0; m0 < lanes; m0 += 4) {  // 4 lanes at a time, over the keys one of them sees
    const int64_t m1 = std::min(lanes, m0 + 4);
    const int64_t j0 = *std::min_element(lo + m0, lo + m1), j1 = *std::max_element(hi + m0, hi + m1);
    const float* w = st + j0 * ld + m0;
    for (int64_t c = 0; c < whole; c += 4) {
      ValueChunks<Wide, 4>(w, 1, ld, values, slots + j0, j1 - j0, c * kWide, std::min<int64_t>(4, whole - c),
                           o + m0 * d, d);
    }
    for (int64_t m = m0; m < m1; ++m) {  // the dimensions past the last whole 16
      for (int64_t c = whole * kWide; c < d; ++c) {
        float sum = 0.0f;
        for (int64_t j = j0; j < j1; ++j) sum += st[j * ld + m] * Widen(values[slots[j] + c]);
        o[m * d + c] = sum;
      }
    }
  }
}

#if defined(__AVX512BF16__)
// The pair form, where q and the cache are bfloat16 and the CPU multiplies pairs of bfloat16 values
// (vdpbf16ps, as the products' pair form: 32 multiply-adds an instruction, each product exact in
// float32, the sums in another order). A lane's scores take its query's dimensions two at a time
// against a key's pair broadcast, read straight from its page (nothing widened); its values, keys two
// at a time: two value rows interleaved into pairs, against the lane's two weights (bfloat16 values
// already, as the reference rounds them) broadcast. vdpbf16ps takes values under float32's normal
// range as zeros and flushes such results (a weight under 2^-126 counts 0, where the float form keeps it).
constexpr int64_t kPairLanes = 6;   // lanes whose value sums a tile keeps in registers
constexpr int64_t kPairDims = 64;   // dimensions a value tile takes, 32 per interleaved pair of vectors

// st[j * ld + m0 + ...] = key j . query lanes m0.. for J keys (keys[j]: its d values) and C chunks of
// 16 lanes of qp [d / 2][ld] (lane m's pair of dimensions 2c, 2c + 1 as one word).
template <int J, int C>
void ScorePairTile(const uint16_t* const* keys, const uint32_t* qp, int64_t pairs, int64_t ld, int64_t m0, float* st) {
  __m512 acc[J][C];
  for (int j = 0; j < J; ++j) {
    for (int i = 0; i < C; ++i) acc[j][i] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < pairs; ++c) {
    __m512bh qs[C];
    for (int i = 0; i < C; ++i) qs[i] = (__m512bh)_mm512_loadu_si512(qp + c * ld + m0 + i * kWide);
    for (int j = 0; j < J; ++j) {
      uint32_t word;
      std::memcpy(&word, keys[j] + 2 * c, sizeof(word));
      const __m512bh k = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      for (int i = 0; i < C; ++i) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], qs[i], k);
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int i = 0; i < C; ++i) _mm512_storeu_ps(st + j * ld + m0 + i * kWide, acc[j][i]);
  }
}

// o[(m0 + m) * d + c0 ...] = sum over keys 2i, 2i + 1 (i0 <= i < i1) of lane m0 + m's weights (wp
// [pairs of keys][ld]: both as one word) times their values (values[j]: key j's row), dimensions
// [c0, c0 + 32 P), for M lanes. Interleaving two rows puts dimensions 8q + 0..3 in lo's lanes 4q..
// 4q + 3 and 8q + 4..7 in hi's; the stores put them back in order.
template <int M, int P>
void ValuePairTile(const uint32_t* wp, int64_t ld, int64_t m0, const uint16_t* const* values, int64_t i0,
                   int64_t i1, int64_t c0, float* o, int64_t d) {
  __m512 lo[M][P], hi[M][P];
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < P; ++c) lo[m][c] = hi[m][c] = _mm512_setzero_ps();
  }
  for (int64_t i = i0; i < i1; ++i) {
    __m512bh vlo[P], vhi[P];
    for (int c = 0; c < P; ++c) {
      const __m512i a = _mm512_loadu_si512(values[2 * i] + c0 + 32 * c);
      const __m512i b = _mm512_loadu_si512(values[2 * i + 1] + c0 + 32 * c);
      vlo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(wp[i * ld + m0 + m]));
      for (int c = 0; c < P; ++c) {
        lo[m][c] = _mm512_dpbf16_ps(lo[m][c], vlo[c], w), hi[m][c] = _mm512_dpbf16_ps(hi[m][c], vhi[c], w);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < P; ++c) {
      float* out = o + (m0 + m) * d + c0 + 32 * c;
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo[m][c], first, hi[m][c]));
      _mm512_storeu_ps(out + kWide, _mm512_permutex2var_ps(lo[m][c], second, hi[m][c]));
    }
  }
}

template <int M>
void ValuePairTiles(const uint32_t* wp, int64_t ld, int64_t m0, const uint16_t* const* values, int64_t i0,
                    int64_t i1, float* o, int64_t d) {
  for (int64_t c0 = 0; c0 < d; c0 += kPairDims) {
    if (d - c0 >= kPairDims) ValuePairTile<M, 2>(wp, ld, m0, values, i0, i1, c0, o, d);
    else ValuePairTile<M, 1>(wp, ld, m0, values, i0, i1, c0, o, d);
  }
}

// o [lanes][d] = one KV head's attention for a block's lanes, in the pair form (d a multiple of 32).
void PairBlockHead(const Problem& p, const Item& item, int64_t g, int64_t n, int64_t ld, const int32_t* lo,
                   const int32_t* hi, const int64_t* slots, std::vector<float>& scratch, float* o) {
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim, heads = p.num_heads, pairs = d / 2;
  const int64_t lanes = (item.end_row - item.first_row) * group, key_pairs = CeilDiv(n, 2);
  thread_local std::vector<uint32_t> qp, wp;
  thread_local std::vector<uint16_t> zeros;
  thread_local std::vector<const uint16_t*> keys, values;
  qp.assign(pairs * ld, 0);
  uint32_t* qt = qp.data();  // (pointers: each use of a thread's vector in a loop would look it up)
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  for (int64_t m = 0; m < lanes; ++m) {
    const uint16_t* row = q + ((item.first_row + m / group) * heads + g * group + m % group) * d;
    for (int64_t c = 0; c < pairs; ++c) std::memcpy(qt + c * ld + m, row + 2 * c, sizeof(uint32_t));
  }
  zeros.assign(d, 0);  // the key and value past the last, where a tile takes them
  keys.assign(CeilDiv(n, 8) * 8, zeros.data());
  values.assign(2 * key_pairs, zeros.data());
  const uint16_t **k = keys.data(), **v = values.data();
  for (int64_t j = 0; j < n; ++j) {
    k[j] = static_cast<const uint16_t*>(p.k) + slots[j] + g * d;
    v[j] = static_cast<const uint16_t*>(p.v) + slots[j] + g * d;
  }
  scratch.resize(CeilDiv(n, kWide) * kWide * ld);
  float* st = scratch.data();
  for (int64_t m0 = 0; m0 < ld;) {
    const int64_t chunks = std::min<int64_t>(4, (ld - m0) / kWide);
    for (int64_t j = 0; j < n; j += chunks <= 2 ? 8 : 4) {
      switch (chunks) {
        case 1: ScorePairTile<8, 1>(k + j, qt, pairs, ld, m0, st + j * ld); break;
        case 2: ScorePairTile<8, 2>(k + j, qt, pairs, ld, m0, st + j * ld); break;
        case 3: ScorePairTile<4, 3>(k + j, qt, pairs, ld, m0, st + j * ld); break;
        default: ScorePairTile<4, 4>(k + j, qt, pairs, ld, m0, st + j * ld);
      }
    }
    m0 += chunks * kWide;
  }
  SoftmaxLanes(st, n, ld, lo, hi, p.sm_scale, p.soft_cap, true);
  wp.resize(key_pairs * ld);  // a lane's weights of keys 2i and 2i + 1 (bfloat16 values: their high halves)
  uint32_t* w = wp.data();
  for (int64_t i = 0; i < key_pairs; ++i) {
    for (int64_t m = 0; m < ld; m += kWide) {
      const __m512i a = _mm512_loadu_si512(st + 2 * i * ld + m);
      const __m512i b = 2 * i + 1 < n ? _mm512_loadu_si512(st + (2 * i + 1) * ld + m) : _mm512_setzero_si512();
      _mm512_storeu_si512(w + i * ld + m, _mm512_or_si512(_mm512_srli_epi32(a, 16),
                                                          _mm512_and_si512(b, _mm512_set1_epi32(0xFFFF0000u))));
    }
  }
  for (int64_t m0 = 0; m0 < lanes; m0 += kPairLanes) {  // over the keys one of the tile's lanes sees
    const int64_t m1 = std::min(lanes, m0 + kPairLanes);
    const int64_t i0 = *std::min_element(lo + m0, lo + m1) / 2;
    const int64_t i1 = CeilDiv(*std::max_element(hi + m0, hi + m1), 2);
    switch (m1 - m0) {
      case 1: ValuePairTiles<1>(w, ld, m0, v, i0, i1, o, d); break;
      case 2: ValuePairTiles<2>(w, ld, m0, v, i0, i1, o, d); break;
      case 3: ValuePairTiles<3>(w, ld, m0, v, i0, i1, o, d); break;
      case 4: ValuePairTiles<4>(w, ld, m0, v, i0, i1, o, d); break;
      case 5: ValuePairTiles<5>(w, ld, m0, v, i0, i1, o, d); break;
      default: ValuePairTiles<6>(w, ld, m0, v, i0, i1, o, d);
    }
  }
}
#endif  // __AVX512BF16__

template <typename T>
void AttendBlock(const Problem& p, const Item& item, std::vector<float>& scratch) {
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim, heads = p.num_heads;
  const int64_t rows = item.end_row - item.first_row, lanes = rows * group, ld = CeilDiv(lanes, kWide) * kWide;
  const Keys keys(p, item);
  const int64_t first = keys.Begin(item.first_row), n = keys.End(item.end_row - 1) - first;
  if (n <= 0) return;  // (the rows stay zeros)
  // each lane's keys [lo, hi), relative to the first key any row sees; lanes past the rows see none
  thread_local std::vector<int32_t> lo, hi;
  lo.assign(ld, 0), hi.assign(ld, 0);
  for (int64_t m = 0; m < lanes; ++m) {
    lo[m] = static_cast<int32_t>(keys.Begin(item.first_row + m / group) - first);
    hi[m] = static_cast<int32_t>(std::max(keys.End(item.first_row + m / group) - first, int64_t{lo[m]}));
  }
  thread_local std::vector<int64_t> slots;
  Slots(p, item.seq, first, n, slots);
  thread_local std::vector<float> sums;
  sums.resize(ld * d);
  float* o = sums.data();  // (a pointer: each use of the thread's vector in a loop would look it up)
  for (int64_t g = 0; g < p.num_kv_heads; ++g) {
#if defined(__AVX512BF16__)
    if (std::is_same_v<T, uint16_t> && p.q_bf16 && d % 32 == 0) {
      PairBlockHead(p, item, g, n, ld, lo.data(), hi.data(), slots.data(), scratch, o);
    } else
#endif
      FloatBlockHead<T>(p, item, g, n, ld, lo.data(), hi.data(), slots.data(), scratch, o);
    for (int64_t m = 0; m < lanes; ++m) {
      const int64_t at = ((item.first_row + m / group) * heads + g * group + m % group) * d;
      if (p.out_bf16) {
        for (int64_t c = 0; c < d; ++c) static_cast<uint16_t*>(p.out)[at + c] = FloatToBf16(o[m * d + c]);
      } else {
        std::memcpy(static_cast<float*>(p.out) + at, o + m * d, d * sizeof(float));
      }
    }
  }
}

// An item's query rows times the span of keys they see: how long it takes, in proportion.
inline int64_t Work(const Problem& p, const Item& item) {
  const Keys keys(p, item);
  return (item.end_row - item.first_row) * (keys.End(item.end_row - 1) - keys.Begin(item.first_row));
}

// query [heads][d] = q's row t, as float32.
inline void QueryRow(const Problem& p, int64_t t, float* query) {
  const int64_t n = p.num_heads * p.head_dim, in = t * n;
  for (int64_t i = 0; i < n; ++i) {
    query[i] = p.q_bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(p.q)[in + i])
                        : static_cast<const float*>(p.q)[in + i];
  }
}

// One work item: every query head, for every row of its block.
template <typename T>
void Attend(const Problem& p, const Item& item, std::vector<float>& scratch) {
  if (p.block_rows > 0 && item.end_row - item.first_row >= p.block_rows) return AttendBlock<T>(p, item, scratch);
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim;
  const int64_t kv_heads = p.num_kv_heads, heads = p.num_heads;
  const Keys keys(p, item);
  const int64_t kv_len = keys.kv_len;
  const T* k_pages = static_cast<const T*>(p.k);
  const T* v_pages = static_cast<const T*>(p.v);
  // scratch: scores [heads][kv_len], the query rows [heads][d] and their outputs [heads][d]; and
  // where each key's slot starts in the pages
  scratch.resize(heads * kv_len + 2 * heads * d);
  float* scores = scratch.data();
  float* query = scores + heads * kv_len;
  float* acc = query + heads * d;
  thread_local std::vector<int64_t> slots;
  Slots(p, item.seq, 0, keys.visible, slots);
  for (int64_t t = item.first_row; t < item.end_row; ++t) {
    const int64_t first_key = keys.Begin(t), num_keys = keys.End(t) - first_key;
    const int64_t* seen = slots.data() + first_key;
    const int64_t in = t * heads * d;  // the row's first query head
    QueryRow(p, t, query);
    Scores(query, kv_heads, group, k_pages, seen, num_keys, d, scores, kv_len, v_pages);
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores + h * kv_len;
      const float max = p.soft_cap > 0.0f ? ScaleCapped(s, num_keys, p.sm_scale, p.soft_cap)
                                          : Scale(s, num_keys, p.sm_scale);
      Normalize(s, ExpShifted(s, max, num_keys), num_keys, std::is_same_v<T, uint16_t>);
    }
    Values(scores, kv_heads, group, kv_len, v_pages, seen, num_keys, d, acc);
    if (p.out_bf16) {
      uint16_t* o = static_cast<uint16_t*>(p.out) + in;
      for (int64_t i = 0; i < heads * d; ++i) o[i] = FloatToBf16(acc[i]);
    } else {
      std::memcpy(static_cast<float*>(p.out) + in, acc, heads * d * sizeof(float));
    }
  }
}

// A decode row alone in the call, its keys split in two halves over the calling thread and the
// kernels' own helper (as one item it left the other core idle for a quarter of a one-stream step):
// each half's scores, their largest and the sum of their exponentials; then each half's weights
// normalized by the row's total and its values summed; the two sums added. Within float32 rounding
// of the one-row form (its weights rescaled from the half's largest score; its sums in two parts).
template <typename T>
void AttendSplit(ffi::ThreadPool& pool, const Problem& p, const Item& item) {
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim;
  const int64_t kv_heads = p.num_kv_heads, heads = p.num_heads;
  const Keys keys(p, item);
  const int64_t t = item.first_row, first_key = keys.Begin(t), n = keys.End(t) - first_key;
  const int64_t bounds[3] = {0, n / 2 / kKeysPerBlock * kKeysPerBlock, n};
  const T* k_pages = static_cast<const T*>(p.k);
  const T* v_pages = static_cast<const T*>(p.v);
  // scores [heads][n], the query row [heads][d], each half's value sums [2][heads][d], and per half
  // and head its largest score and the sum of its exponentials [2][heads]
  thread_local std::vector<float> buffer;
  buffer.resize(heads * n + 3 * heads * d + 4 * heads);
  float* scores = buffer.data();
  float* query = scores + heads * n;
  float* acc = query + heads * d;
  float* top = acc + 2 * heads * d;
  float* total = top + 2 * heads;
  thread_local std::vector<int64_t> slots;
  Slots(p, item.seq, first_key, n, slots);
  const int64_t* seen = slots.data();  // (the lambdas below would name the helper's own thread_local)
  const int64_t in = t * heads * d;
  QueryRow(p, t, query);
  ParallelFor(pool, 2, [&](int64_t half, std::vector<float>&) {
    const int64_t j0 = bounds[half], m = bounds[half + 1] - j0;
    Scores(query, kv_heads, group, k_pages, seen + j0, m, d, scores + j0, n, v_pages);
    for (int64_t h = 0; h < heads; ++h) {
      float* s = scores + h * n + j0;
      const float max = p.soft_cap > 0.0f ? ScaleCapped(s, m, p.sm_scale, p.soft_cap) : Scale(s, m, p.sm_scale);
      top[half * heads + h] = max;
      total[half * heads + h] = ExpShifted(s, max, m);
    }
  }, true);
  for (int64_t h = 0; h < heads; ++h) {  // total[half][h]: what that half's exponentials are divided by
    const float max = std::max(top[h], top[heads + h]);
    const float c0 = std::exp(top[h] - max), c1 = std::exp(top[heads + h] - max);
    const float sum = total[h] * c0 + total[heads + h] * c1;
    total[h] = sum / c0;
    total[heads + h] = sum / c1;
  }
  ParallelFor(pool, 2, [&](int64_t half, std::vector<float>&) {
    const int64_t j0 = bounds[half], m = bounds[half + 1] - j0;
    for (int64_t h = 0; h < heads; ++h) {
      Normalize(scores + h * n + j0, total[half * heads + h], m, std::is_same_v<T, uint16_t>);
    }
    Values(scores + j0, kv_heads, group, n, v_pages, seen + j0, m, d, acc + half * heads * d);
  }, true);
  for (int64_t i = 0; i < heads * d; ++i) {
    const float sum = acc[i] + acc[heads * d + i];
    if (p.out_bf16) {
      static_cast<uint16_t*>(p.out)[in + i] = FloatToBf16(sum);
    } else {
      static_cast<float*>(p.out)[in + i] = sum;
    }
  }
}

// Keys a decode row alone needs before AttendSplit makes a one-stream step faster: alone the split
// is ahead from 128 keys, but under about 500 the step loses what it gains (the engine thread's
// host work, which ran on the idle core meanwhile, then waits); bench/RESULTS.md.
constexpr int64_t kSplitKeys = 512;

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> num_seqs,
                          ffi::Result<ffi::AnyBuffer> out, float sm_scale, int64_t sliding_window, float soft_cap,
                          int64_t block_rows) {
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
  p.block_rows = block_rows;

  std::memset(out->untyped_data(), 0, out->size_bytes());  // padding rows stay zero
  const int64_t seqs = std::min<int64_t>(num_seqs.typed_data()[0], kv_lens.dimensions()[0]);
  std::vector<Item> items;
  for (int64_t b = 0; b < seqs; ++b) {
    for (int64_t first = p.query_start[b]; first < p.query_start[b + 1]; first += kRowsPerItem) {
      items.push_back({b, first, std::min<int64_t>(first + kRowsPerItem, p.query_start[b + 1])});
    }
  }
  // the costliest items first (a prompt's last blocks see the most keys), so that the threads end together
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return Work(p, a) > Work(p, b); });
  // (not in batch-invariant mode, block_rows 0, where each row keeps the one-row form)
  if (items.size() == 1 && items[0].end_row - items[0].first_row == 1 && p.block_rows > 0 &&
      pool.num_threads() > 1 && Work(p, items[0]) >= kSplitKeys) {
    if (pages_bf16) {
      AttendSplit<uint16_t>(pool, p, items[0]);
    } else {
      AttendSplit<float>(pool, p, items[0]);
    }
    return ffi::Error::Success();
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
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("block_rows"));

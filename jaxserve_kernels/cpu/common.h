// What the CPU kernels (XLA FFI custom calls built by jaxserve_kernels/cpu/build.py) share: 8-lane float
// vectors, bfloat16 as raw 16-bit words, and work items shared with XLA's intra-op threads (the
// products' blocks of x and w among them: ForEachBlock).

#ifndef JAXSERVE_KERNELS_CPU_COMMON_H_
#define JAXSERVE_KERNELS_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

namespace ffi = xla::ffi;

inline bool IsBf16(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::U16; }

// The rows of x a product computes: the first `live` (an int32 scalar operand, clamped to [0, rows]);
// a step's padding rows after them are left to `ZeroRowsFrom`.
inline int64_t LiveRows(const ffi::AnyBuffer& live, int64_t rows) {
  if (live.element_type() != ffi::DataType::S32 || live.element_count() != 1) return rows;
  return std::clamp<int64_t>(*static_cast<const int32_t*>(live.untyped_data()), 0, rows);
}

// y [M, N] from row `m` on set to zero: the rows a product did not compute (`LiveRows`).
inline void ZeroRowsFrom(ffi::Result<ffi::AnyBuffer>& y, int64_t m) {
  const int64_t row_bytes = y->dimensions()[0] ? y->size_bytes() / y->dimensions()[0] : 0;
  std::memset(static_cast<char*>(y->untyped_data()) + m * row_bytes, 0, y->size_bytes() - m * row_bytes);
}

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

inline float Widen(float x) { return x; }  // an element of either dtype as float32
inline float Widen(uint16_t x) { return Bf16ToFloat(x); }

inline uint16_t FloatToBf16(float f) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// 8 float lanes (one AVX register on x86-64, two NEON registers on Arm), by GCC/Clang vector extensions.
typedef float Lanes __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline Lanes Load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline Lanes Load(const uint16_t* p) {  // 8 bfloat16 widened to float32
#if defined(__AVX2__)  // one zero-extension: GCC 12 split the portable form below into five shuffles
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
  typedef uint16_t Halves __attribute__((vector_size(16)));
  typedef uint32_t Words __attribute__((vector_size(32)));
  Halves h;
  std::memcpy(&h, p, sizeof(h));
  Words w = __builtin_convertvector(h, Words) << 16;
#endif
  Lanes v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline void Store(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

inline float Sum(Lanes v) {  // as a tree, so that the sums of several vectors overlap
  typedef float Quad __attribute__((vector_size(16)));
  Quad low, high;
  std::memcpy(&low, &v, sizeof(low));
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof(low), sizeof(high));
  const Quad q = low + high;
  return (q[0] + q[2]) + (q[1] + q[3]);
}

typedef int32_t IntLanes __attribute__((vector_size(32)));
typedef uint32_t Words __attribute__((vector_size(32)));
template <typename V> struct IntsOf;  // the integer vectors of a float vector's width
template <> struct IntsOf<Lanes> { typedef IntLanes type; typedef Words words; };

// 16 float lanes: one AVX-512 register (two AVX ones elsewhere), for the attention's blocks of query rows.
typedef float Wide __attribute__((vector_size(64)));
typedef int32_t IntWide __attribute__((vector_size(64)));
typedef uint32_t WideWords __attribute__((vector_size(64)));
constexpr int64_t kWide = 16;
template <> struct IntsOf<Wide> { typedef IntWide type; typedef WideWords words; };

inline Wide LoadWide(const float* p) {
  Wide v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline Wide LoadWide(const uint16_t* p) {  // 16 bfloat16 widened to float32
#if defined(__AVX512F__)  // (joining two 8-lane loads went through the stack: a stalled load per use)
  return (Wide)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  typedef uint16_t Halves __attribute__((vector_size(32)));
  Halves h;
  std::memcpy(&h, p, sizeof(h));
  const WideWords w = __builtin_convertvector(h, WideWords) << 16;
  Wide v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#endif
}

inline void StoreWide(float* p, Wide v) { std::memcpy(p, &v, sizeof(v)); }

// exp of 8 or 16 lanes for x <= 0 (attention's scores minus their maximum; -|x| for SiLU), Cephes'
// expf: 2^n * e^r with r = x - n ln 2 in [-ln2/2, ln2/2] and e^r by a degree-7 polynomial; within 2
// ulp of expf.
template <typename V>
inline V Exp(V x) {
  const V lowest = V{} - 87.3f;  // below: e^x < 2^-126, taken as 2^-126
  x = x < lowest ? lowest : x;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V poly = V{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  V e = poly * r * r + r + 1.0f;
  typedef typename IntsOf<V>::type Ints;
  Ints scale = (__builtin_convertvector(n, Ints) + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &scale, sizeof(two_n));
  return e * two_n;
}

// Finite lanes rounded to bfloat16 values (kept as float32), to nearest even as FloatToBf16.
template <typename V>
inline V Bf16Values(V p) {
  typename IntsOf<V>::words bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

// Keeps a loaded vector in a register: without it GCC folds the load into each multiply-add that
// uses the vector, loading it again for every use (x86-64: a memory operand per vfmadd).
inline void InRegister(Lanes& v) {
#if defined(__x86_64__) && defined(__AVX__)  // (without AVX no register holds 8 lanes)
  asm("" : "+x"(v));
#endif
}

inline void InRegister(Wide& v) {
#if defined(__x86_64__) && defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
}

#if defined(__AVX512F__)
// The 16 x 16 block of 32-bit lanes in r transposed in place: lane i of r[j] becomes lane j of r[i].
// Pairs of lanes, then pairs of pairs, then 128-bit quarters, in registers.
__attribute__((always_inline)) inline void Transpose16(__m512 r[16]) {
  __m512 a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);  // per quarter: lanes 0, 1 of r[2k], r[2k + 1]
    a[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);  // lanes 2, 3
  }
  for (int k = 0; k < 4; ++k) {  // b[4k + j]: per quarter, lane j of r[4k] to r[4k + 3]
    const __m512d a0 = _mm512_castps_pd(a[4 * k]), a1 = _mm512_castps_pd(a[4 * k + 1]);
    const __m512d a2 = _mm512_castps_pd(a[4 * k + 2]), a3 = _mm512_castps_pd(a[4 * k + 3]);
    b[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    b[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    b[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    b[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int j = 0; j < 4; ++j) {  // lane 4q + j of every r gathers quarter q of b[j], b[4 + j], b[8 + j], b[12 + j]
    const __m512 u0 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x44), u1 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xEE);
    const __m512 v0 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x44);
    const __m512 v1 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xEE);
    r[j] = _mm512_shuffle_f32x4(u0, v0, 0x88);
    r[4 + j] = _mm512_shuffle_f32x4(u0, v0, 0xDD);
    r[8 + j] = _mm512_shuffle_f32x4(u1, v1, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(u1, v1, 0xDD);
  }
}
#endif

#if defined(__AVX512BF16__)
// The 16 x 16 sums at c (64-byte aligned; row j: w's row j against 16 rows of x) stored as y's rows:
// y row i, columns [0, cols), gets c's column i, for i < rows; in float32, or rounded to bfloat16 (to
// nearest even). Transposed in registers (stored one value at a time instead, a block's sums cost as
// much as its products where K is small).
template <typename Y>
inline void StoreTransposed(const float* c, int64_t rows, int64_t cols, Y* y, int64_t ldy) {
  __m512 t[16];
  for (int j = 0; j < 16; ++j) t[j] = _mm512_load_ps(c + 16 * j);
  Transpose16(t);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t i = 0; i < rows; ++i) {
    if constexpr (std::is_same_v<Y, float>) {
      _mm512_mask_storeu_ps(y + i * ldy, mask, t[i]);
    } else {
      _mm256_mask_storeu_epi16(y + i * ldy, mask, (__m256i)_mm512_cvtneps_pbh(t[i]));
    }
  }
}
#endif

// Helper threads of the kernels' own, which keep looking for work for a while after each call
// before they sleep. Handing work to a sleeping thread (XLA's pool's, say) costs the caller a
// futex wake, about 8 us in a VM, as long as half of a one-row product; a helper still looking
// starts within a microsecond. While looking it yields the core to any other runnable thread.
// One set per process: a function-local static of an inline function is one object across the
// kernels' libraries (GNU unique symbol). For that reason a table of a build's own functions (a
// block's tiles) is never such a static: a second build in the process (the tests build the kernels
// for other CPUs) would call the first build's tiles, which may lay their operands out otherwise.
class Helpers {
 public:
  static Helpers& Get() {
    static Helpers* helpers = new Helpers();  // never destroyed: its threads outlive main's exit
    return *helpers;
  }

  // task() on the caller and on up to `count` helpers, returning when every call of it has
  // returned; false (task not called) when another caller holds the helpers.
  template <typename Task>
  bool Run(int64_t count, Task& task) {
    std::unique_lock<std::mutex> hold(holder_, std::try_to_lock);
    if (!hold.owns_lock()) return false;
    Start(count);
    call_ = [](void* t) { (*static_cast<Task*>(t))(); };
    task_ = &task;
    wanted_ = count;
    joined_.store(0, std::memory_order_release);
    generation_.fetch_add(1);
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    task();
    joined_.fetch_or(kClosed);  // no helper joins from here on; wait for those that did
    while ((joined_.load(std::memory_order_acquire) & ~kClosed) != 0) std::this_thread::yield();
    return true;
  }

 private:
  static constexpr int64_t kClosed = int64_t{1} << 40;
  static constexpr auto kLookFor = std::chrono::microseconds(200);  // a step's calls come closer than this

  void Start(int64_t count) {
    while (static_cast<int64_t>(threads_) < count) {
      std::thread([this] { Loop(); }).detach();
      ++threads_;
    }
  }

  void Loop() {
    uint64_t seen = generation_.load();
    for (;;) {
      const auto since = std::chrono::steady_clock::now();
      uint64_t now;
      while ((now = generation_.load()) == seen) {
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() - since > kLookFor) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = now;
      int64_t state = joined_.load();
      while (!(state & kClosed) && state < wanted_.load()) {
        if (joined_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel)) {
          call_(task_);  // the job of the caller holding the helpers now, which waits for this call
          joined_.fetch_sub(1, std::memory_order_release);
          break;
        }
      }
    }
  }

  std::mutex holder_;
  size_t threads_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> joined_{kClosed};  // helpers in the current job, kClosed once the caller is done
  std::atomic<int64_t> wanted_{0};
  void (*call_)(void*) = nullptr;
  void* task_ = nullptr;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleeping_{0};
};

// fn(item, scratch) for every item in [0, n), on the calling thread and on up to
// pool.num_threads() - 1 helpers from XLA's intra-op pool, or for `brief` work (a call of tens of
// microseconds, whose hand-off would cost as much) from the kernels' own Helpers where no other
// call holds them; each with its own scratch vector. Items are claimed from an atomic counter,
// so a helper that starts late finds none left (it never touches `fn` then) and nothing waits on
// a thread that has not started.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const Fn& fn, bool brief = false) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto run = [counters, n, &fn] {
    std::vector<float> scratch;
    for (int64_t i; (i = counters->next.fetch_add(1)) < n;) {
      fn(i, scratch);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) return run();
  if (brief && Helpers::Get().Run(helpers, run)) return;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(run)(run));  // (a copy: Schedule takes F&&)
  run();
  while (counters->done.load(std::memory_order_acquire) < n) {
    std::this_thread::yield();  // items a helper claimed are being computed right now
  }
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// out = y rounded to bfloat16 (to nearest even; AVX512_BF16 flushes values under float32's normal
// range to zero).
inline void RoundValues(const float* y, int64_t count, uint16_t* out) {
  int64_t i = 0;
#if defined(__AVX512BF16__)  // (the last few masked: every value rounded as the pair forms store theirs)
  for (; i < count; i += 16) {
    const __mmask16 mask = count - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - i)) - 1);
    _mm256_mask_storeu_epi16(out + i, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, y + i)));
  }
#endif
  for (; i < count; ++i) out[i] = FloatToBf16(y[i]);
}

// RoundValues in chunks shared with XLA's threads: a prefill's logits are large enough for one thread's
// pass to show.
inline void RoundToBf16(ffi::ThreadPool& pool, const float* y, int64_t count, uint16_t* out) {
  constexpr int64_t kChunk = 1 << 16;
  ParallelFor(pool, CeilDiv(count, kChunk), [&](int64_t item, std::vector<float>&) {
    const int64_t first = item * kChunk;
    RoundValues(y + first, std::min(count - first, kChunk), out + first);
  });
}

// fn(m0, m1, n0, n1, scratch) for every block of y [m_len, n_len]: rows_of_x rows of x times about
// rows_of_w rows of w (a multiple of tile_cols), as work items shared with XLA's threads
// (ParallelFor). Where x is one block (decode), the blocks of w are resized so that the items
// split evenly over the threads where they can (3 items on 2 threads leave one thread waiting for
// the other). (With several blocks of x, rounding the split over them could add items instead.)
// A few rows of x (a decode of a few streams) make brief work: at one row a product's half is
// 10-20 us. (With more, the kernels' own helper would contend with XLA's threads, which then
// run the step's fusions in parallel: a 32-row decode step took 20-40 % longer.)
constexpr int64_t kBriefRows = 4;

template <typename Fn>
void ForEachBlock(ffi::ThreadPool& pool, int64_t m_len, int64_t n_len, int64_t rows_of_x, int64_t rows_of_w,
                  int64_t tile_cols, const Fn& fn) {
  if (m_len == 0 || n_len == 0) return;
  const int64_t m_blocks = CeilDiv(m_len, rows_of_x);
  int64_t rows = rows_of_w;
  if (m_blocks == 1) {
    const int64_t threads = std::max<int64_t>(1, pool.num_threads());
    const int64_t items = CeilDiv(CeilDiv(n_len, rows_of_w), threads) * threads;
    rows = CeilDiv(CeilDiv(n_len, items), tile_cols) * tile_cols;
  }
  const int64_t n_blocks = CeilDiv(n_len, rows);
  ParallelFor(pool, m_blocks * n_blocks, [&](int64_t item, std::vector<float>& scratch) {
    const int64_t m0 = item % m_blocks * rows_of_x, n0 = item / m_blocks * rows;
    fn(m0, std::min(m_len, m0 + rows_of_x), n0, std::min(n_len, n0 + rows), scratch);
  }, m_len <= kBriefRows);
}

// silu(x) * u in float32; with kRound, silu(x) rounded to bfloat16 values before the product and
// the product after, as XLA computes `models.layers.gated` on bfloat16. silu(x) = x / (1 + e^-x), from
// t = e^-|x| <= 1 (never overflows): x / (1 + t), or x t / (1 + t); zero (signed) where e^x is under
// float32's normal range, as XLA's. (Just above that, from -87.3365 to -87.3, Exp takes e^x as
// e^-87.3: silu values of about 1e-36 a few percent off in float32; no bfloat16 value lies there.)
constexpr float kSiluZero = -87.3365f;  // ln of float32's smallest normal
template <bool kRound, typename V>
inline V SiluTimes(V x, V u) {
  const V t = Exp(x < 0.0f ? x : -x);
  V y = (x < 0.0f ? x * t : x) / (1.0f + t);
  y = x < kSiluZero ? x * 0.0f : y;
  if constexpr (kRound) return Bf16Values(Bf16Values(y) * u);
  return y * u;
}

// out[i] = SiluTimes(gate[i], up[i]) for `count` values of float32 or bfloat16 (rounded), 16 lanes at
// a time where the CPU has AVX-512, then 8, then the last few as 8 with zeros after them.
template <typename T>
void GatedSiluValues(const T* gate, const T* up, T* out, int64_t count) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  int64_t i = 0;
#if defined(__AVX512F__)  // (16 lanes: the 8-lane loop below took about twice as long in a step)
  for (; i + kWide <= count; i += kWide) {
    const Wide y = SiluTimes<kBf16>(LoadWide(gate + i), LoadWide(up + i));
    if constexpr (kBf16) {
      const __m512i bits = _mm512_srli_epi32((__m512i)y, 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(bits));
    } else {
      _mm512_storeu_ps(out + i, (__m512)y);
    }
  }
#endif
  auto eight = [](const T* g, const T* u, T* o) {
    const Lanes y = SiluTimes<kBf16>(Load(g), Load(u));
    if constexpr (kBf16) {
      typedef uint16_t Halves __attribute__((vector_size(16)));
      Words bits;
      std::memcpy(&bits, &y, sizeof(bits));
      const Halves halves = __builtin_convertvector(bits >> 16, Halves);
      std::memcpy(o, &halves, sizeof(halves));
    } else {
      Store(o, y);
    }
  };
  for (; i + kLanes <= count; i += kLanes) eight(gate + i, up + i, out + i);
  if (i < count) {
    T g[kLanes] = {}, u[kLanes] = {}, o[kLanes];
    std::copy(gate + i, gate + count, g);
    std::copy(up + i, up + count, u);
    eight(g, u, o);
    std::copy(o, o + (count - i), out + i);
  }
}

// out[at:at + count] (float32, or bfloat16 where bf16) = GatedSiluValues of the float32 products g and u,
// each first rounded to out's dtype as a product's y is (RoundValues): SwiGLU's values from the sums of
// a call that computes gate and up (`bits`: scratch for 2 x count bfloat16 values).
inline void GatedRow(const float* g, const float* u, int64_t count, bool bf16, void* out, int64_t at, uint16_t* bits) {
  if (!bf16) return GatedSiluValues(g, u, static_cast<float*>(out) + at, count);
  RoundValues(g, count, bits);
  RoundValues(u, count, bits + count);
  GatedSiluValues(bits, bits + count, static_cast<uint16_t*>(out) + at, count);
}

// fn(i, m0, m1, n0, n1, scratch) over the blocks of several products of one x, their ys side by side
// (product i's columns are [starts[i], starts[i + 1]) of them all): ForEachBlock's items over all the
// columns, an item cut where a product ends, so that q, k and v, or gate and up, take one call and
// one handing of work to the threads; n0 and n1 are product i's own columns.
template <typename Fn>
void ForEachBlockOf(ffi::ThreadPool& pool, int64_t m_len, const std::vector<int64_t>& starts, int64_t rows_of_x,
                    int64_t rows_of_w, int64_t tile_cols, const Fn& fn) {
  ForEachBlock(pool, m_len, starts.back(), rows_of_x, rows_of_w, tile_cols,
               [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1, std::vector<float>& scratch) {
    for (size_t i = 0; i + 1 < starts.size(); ++i) {
      const int64_t lo = std::max(n0, starts[i]), hi = std::min(n1, starts[i + 1]);
      if (lo < hi) fn(i, m0, m1, lo - starts[i], hi - starts[i], scratch);
    }
  });
}

}  // namespace jaxserve

#endif  // JAXSERVE_KERNELS_CPU_COMMON_H_

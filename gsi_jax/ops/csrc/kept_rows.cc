// Two sparse batch-1 products that read only the kept rows of W where they lie:
//   KeptRows: y = sum over kept i of x[i] * W[i, :]        (W (d, O));
//   KeptDots: y[o] = W[o, :] . x for kept o, else 0         (W (O, d), CATS' up_proj).
//
// XLA's CPU backend copies any gathered or sliced rows of W into a new buffer before
// its dot, so a kept-rows product there moves the kept bytes about three times.  This
// handler streams each kept row once, eight rows per pass over y (which stays in L1), for
// every map of a site in one call, on two threads when the product is large (each thread
// whole rows: split by columns, each read half rows, 0.80 of the byte ideal at 3/4 of
// 576x3072's rows kept against 0.92 now; results/benchmarks/sparse_rows*.json).
// Registered with XLA's FFI by gsi_jax/ops/cpu_kernels.py, which compiles it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kHeadFloats = 64;  // four cache lines

// y[j0:j1] = sum over rows of x[row] * W[row, j0:j1].
void Accumulate(const float* xs, const float* ws, const int64_t* rows, int64_t n_rows,
                int64_t o, int64_t j0, int64_t j1, float* __restrict__ ys) {
  std::fill(ys + j0, ys + j1, 0.0f);
  int64_t r = 0;
  for (; r + 8 <= n_rows; r += 8) {
    float a[8];
    const float* __restrict__ w[8];
    for (int q = 0; q < 8; ++q) {
      a[q] = xs[rows[r + q]];
      w[q] = ws + rows[r + q] * o;
    }
    // The next pass's rows start where the prefetcher cannot guess: fetch their heads now.
    for (int64_t q = r + 8; q < std::min(r + 16, n_rows); ++q) {
      const float* head = ws + rows[q] * o + j0;
      for (int64_t l = 0; l < std::min<int64_t>(j1 - j0, kHeadFloats); l += 16) {
        __builtin_prefetch(head + l);
      }
    }
    for (int64_t j = j0; j < j1; ++j) {
      ys[j] += (a[0] * w[0][j] + a[1] * w[1][j]) + (a[2] * w[2][j] + a[3] * w[3][j]) +
               (a[4] * w[4][j] + a[5] * w[5][j]) + (a[6] * w[6][j] + a[7] * w[7][j]);
    }
  }
  for (; r + 4 <= n_rows; r += 4) {
    const float a0 = xs[rows[r]], a1 = xs[rows[r + 1]], a2 = xs[rows[r + 2]],
                a3 = xs[rows[r + 3]];
    const float* __restrict__ w0 = ws + rows[r] * o;
    const float* __restrict__ w1 = ws + rows[r + 1] * o;
    const float* __restrict__ w2 = ws + rows[r + 2] * o;
    const float* __restrict__ w3 = ws + rows[r + 3] * o;
    for (int64_t j = j0; j < j1; ++j) ys[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j];
  }
  for (; r < n_rows; ++r) {
    const float a = xs[rows[r]];
    const float* __restrict__ w = ws + rows[r] * o;
    for (int64_t j = j0; j < j1; ++j) ys[j] += a * w[j];
  }
}

}  // namespace

namespace {

// One helper thread beside XLA's own: a large product gives it the upper half of the kept
// rows while the calling thread does the lower half (one core streams about 20 GB/s here;
// two read what the memory gives).  It is taken with a compare-and-swap, so calls that XLA
// runs side by side never wait for each other: a call that finds it busy does its whole
// product alone.  A decode step calls the kernel every few hundred microseconds, and on a
// virtual machine waking a sleeping thread twice a call cost about 72 us of it (every row
// kept at 0.87x dense when both sides slept on condition variables, 1.21x now:
// results/benchmarks/decode_dense_equivalents{_before,}.json).  So after each half the
// helper polls for new work for kSpin, yielding its core to any thread that wants it,
// before it sleeps on a condition variable, and the caller polls the same way for the
// helper's half, which takes as long as its own.
class Helper {
 public:
  static Helper& Instance() {
    static Helper* helper = new Helper();  // lives as long as the process (its thread too)
    return *helper;
  }

  // Runs `work` on the helper and returns true, or returns false if it is taken.
  bool Start(std::function<void()> work) {
    bool free = false;
    if (!taken_.compare_exchange_strong(free, true)) return false;
    work_ = std::move(work);
    state_.store(kPosted);
    if (sleeping_.load()) {  // seq_cst with Loop's store and load: one of them sees the other
      std::lock_guard<std::mutex> lock(mu_);
      wake_.notify_one();
    }
    return true;
  }

  void Wait() {
    while (state_.load(std::memory_order_acquire) != kDone) std::this_thread::yield();
    work_ = nullptr;
    state_.store(kIdle, std::memory_order_relaxed);
    taken_.store(false, std::memory_order_release);
  }

 private:
  enum : int { kIdle, kPosted, kDone };

  Helper() { std::thread([this] { Loop(); }).detach(); }

  void Loop() {
    for (;;) {
      const auto since = std::chrono::steady_clock::now();
      while (state_.load(std::memory_order_acquire) != kPosted) {
        if (std::chrono::steady_clock::now() - since > kSpin) {
          std::unique_lock<std::mutex> lock(mu_);
          sleeping_.store(true);
          wake_.wait(lock, [this] { return state_.load() == kPosted; });
          sleeping_.store(false);
          break;
        }
        std::this_thread::yield();
      }
      work_();
      state_.store(kDone, std::memory_order_release);
    }
  }
  static constexpr std::chrono::microseconds kSpin{1000};

  std::atomic<bool> taken_{false}, sleeping_{false};
  std::atomic<int> state_{kIdle};
  std::mutex mu_;
  std::condition_variable wake_;
  std::function<void()> work_;
};

// Products smaller than this many kept weights (1 MB of float32) stay on one thread: the
// hand-off to the helper would cost more than its half saves.
constexpr int64_t kSplitElements = 1 << 18;

}  // namespace

// y_m = sum over kept i of x[i] * W_m[i, :] for every W_m (d, O_m) of one site (q, k and v
// read one input): the kept rows are found once, and one call streams them all.
static ffi::Error KeptRowsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::PRED> keep,
                               ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  const int64_t d = x.element_count();
  if (keep.element_count() != d || ws.size() != ys.size() || ws.size() == 0) {
    return ffi::Error::InvalidArgument("kept_rows: x (d,), keep (d,) and one y per W");
  }
  struct Map {
    const float* w;
    int64_t o;
    float* y;
  };
  std::vector<Map> maps;
  int64_t columns = 0;
  for (size_t m = 0; m < ws.size(); ++m) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(m);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(m);
    if (!w.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("kept_rows: every W and y must be float32");
    }
    const auto dims = w->dimensions();
    if (dims.size() != 2 || dims[0] != d || (*y)->element_count() != dims[1]) {
      return ffi::Error::InvalidArgument("kept_rows: shapes must be W (d, O) and y (O,)");
    }
    maps.push_back({w->typed_data(), dims[1], (*y)->typed_data()});
    columns += dims[1];
  }
  const bool* ks = keep.typed_data();
  std::vector<int64_t> rows;
  rows.reserve(d);
  for (int64_t i = 0; i < d; ++i) {
    if (ks[i]) rows.push_back(i);
  }
  const float* xs = x.typed_data();
  const int64_t n = rows.size(), lower = n / 2;
  // Kept rows [0, lower) on this thread and [lower, n) on the helper's, each over whole
  // rows into its own sums, added at the end: each thread reads runs of consecutive kept
  // rows as one stream, which the hardware prefetcher follows.
  Helper& helper = Helper::Instance();
  std::vector<float> upper;
  if (n * columns >= kSplitElements) upper.resize(columns);
  auto run = [&](int64_t r0, int64_t r1, float* scratch) {
    int64_t offset = 0;
    for (const Map& m : maps) {
      Accumulate(xs, m.w, rows.data() + r0, r1 - r0, m.o, 0, m.o,
                 scratch ? scratch + offset : m.y);
      offset += m.o;
    }
  };
  if (!upper.empty() && helper.Start([&] { run(lower, n, upper.data()); })) {
    run(0, lower, nullptr);
    helper.Wait();
    int64_t offset = 0;
    for (const Map& m : maps) {
      for (int64_t j = 0; j < m.o; ++j) m.y[j] += upper[offset + j];
      offset += m.o;
    }
  } else {
    run(0, n, nullptr);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KeptRows, KeptRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .RemainingArgs()
                                  .RemainingRets());

namespace {

typedef float Lanes __attribute__((vector_size(32)));  // eight floats (GCC's vector extension)

inline Lanes Load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);  // unaligned
  return v;
}

inline float Sum(Lanes v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// ys[r] = W[r, :] . x for `Rows` rows at rows[0..Rows), in one pass over x.
template <int Rows>
void DotsPass(const float* xs, const float* ws, const int64_t* rows, int64_t d, float* ys) {
  const int64_t d8 = d - d % 8;
  const float* w[Rows];
  for (int q = 0; q < Rows; ++q) w[q] = ws + rows[q] * d;
  Lanes acc[Rows] = {};
  for (int64_t j = 0; j < d8; j += 8) {
    const Lanes xv = Load(xs + j);
    for (int q = 0; q < Rows; ++q) acc[q] += Load(w[q] + j) * xv;
  }
  for (int q = 0; q < Rows; ++q) {
    float sum = Sum(acc[q]);
    for (int64_t j = d8; j < d; ++j) sum += w[q][j] * xs[j];
    ys[rows[q]] = sum;
  }
}

// ys[r] = W[r, :] . x for the given rows, eight rows per pass over x.
void Dots(const float* xs, const float* ws, const int64_t* rows, int64_t n_rows, int64_t d,
          float* ys) {
  int64_t r = 0;
  for (; r + 8 <= n_rows; r += 8) DotsPass<8>(xs, ws, rows + r, d, ys);
  for (; r < n_rows; ++r) DotsPass<1>(xs, ws, rows + r, d, ys);
}

}  // namespace

static ffi::Error KeptDotsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::PRED> keep,
                               ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  if (dims.size() != 2 || x.element_count() != dims[1] || keep.element_count() != dims[0] ||
      y->element_count() != dims[0]) {
    return ffi::Error::InvalidArgument("kept_dots: shapes must be x (d,), keep (O,), W (O, d)");
  }
  const int64_t o = dims[0], d = dims[1];
  const bool* ks = keep.typed_data();
  float* ys = y->typed_data();
  std::vector<int64_t> rows;
  rows.reserve(o);
  for (int64_t r = 0; r < o; ++r) {
    if (ks[r]) {
      rows.push_back(r);
    } else {
      ys[r] = 0.0f;
    }
  }
  // The upper half of the kept rows on the helper thread when the product is large.
  const int64_t n = rows.size(), lower = n / 2;
  const float* xs = x.typed_data();
  const float* wd = w.typed_data();
  Helper& helper = Helper::Instance();
  if (n * d >= kSplitElements &&
      helper.Start([&] { Dots(xs, wd, rows.data() + lower, n - lower, d, ys); })) {
    Dots(xs, wd, rows.data(), lower, d, ys);
    helper.Wait();
  } else {
    Dots(xs, wd, rows.data(), n, d, ys);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KeptDots, KeptDotsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

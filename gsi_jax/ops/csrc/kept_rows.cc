// Two sparse batch-1 products that read only the kept rows of W where they lie:
//   KeptRows: y = sum over kept i of x[i] * W[i, :]        (W (d, O));
//   KeptDots: y[o] = W[o, :] . x for kept o, else 0         (W (O, d), CATS' up_proj).
//
// XLA's CPU backend copies any gathered or sliced rows of W into a new buffer before
// its dot, so a kept-rows product there moves the kept bytes about three times.  This
// handler streams each kept row once, eight rows per pass over y (which stays in L1).
// Registered with XLA's FFI by gsi_jax/ops/cpu_kernels.py, which compiles it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

static ffi::Error KeptRowsImpl(ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::PRED> keep, ffi::Buffer<ffi::F32> w,
                               ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  if (dims.size() != 2 || x.element_count() != dims[0] || keep.element_count() != dims[0] ||
      y->element_count() != dims[1]) {
    return ffi::Error::InvalidArgument("kept_rows: shapes must be x (d,), keep (d,), W (d, O)");
  }
  const int64_t d = dims[0], o = dims[1];
  const bool* ks = keep.typed_data();
  std::vector<int64_t> rows;
  rows.reserve(d);
  for (int64_t i = 0; i < d; ++i) {
    if (ks[i]) rows.push_back(i);
  }
  // One thread: XLA already runs independent thunks (q, k, v; gate, up) side by side on
  // its pool, and a handler that waited on that pool for its own parts deadlocked.
  Accumulate(x.typed_data(), w.typed_data(), rows.data(), rows.size(), o, 0, o, y->typed_data());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KeptRows, KeptRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

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

// ys[r] = W[r, :] . x for the given rows, four rows per pass over x.
void Dots(const float* xs, const float* ws, const int64_t* rows, int64_t n_rows, int64_t d,
          float* ys) {
  const int64_t d8 = d - d % 8;
  int64_t r = 0;
  for (; r + 4 <= n_rows; r += 4) {
    const float* w[4];
    for (int q = 0; q < 4; ++q) w[q] = ws + rows[r + q] * d;
    Lanes acc[4] = {};
    for (int64_t j = 0; j < d8; j += 8) {
      const Lanes xv = Load(xs + j);
      for (int q = 0; q < 4; ++q) acc[q] += Load(w[q] + j) * xv;
    }
    for (int q = 0; q < 4; ++q) {
      float sum = Sum(acc[q]);
      for (int64_t j = d8; j < d; ++j) sum += w[q][j] * xs[j];
      ys[rows[r + q]] = sum;
    }
  }
  for (; r < n_rows; ++r) {
    const float* w = ws + rows[r] * d;
    Lanes acc = {};
    for (int64_t j = 0; j < d8; j += 8) acc += Load(w + j) * Load(xs + j);
    float sum = Sum(acc);
    for (int64_t j = d8; j < d; ++j) sum += w[j] * xs[j];
    ys[rows[r]] = sum;
  }
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
  Dots(x.typed_data(), w.typed_data(), rows.data(), rows.size(), d, ys);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KeptDots, KeptDotsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

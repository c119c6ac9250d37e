// The group kernel one weight row at a time, in its natural packing (quant_matmul.cpp includes it where the build
// has neither AVX-512 nor AVX2): activations quantized to int16 per group, then each row's groups through the CPU's
// SIMD path (arch/arm/quant_neon.h), or one value at a time.
#pragma once

#include <vector>

#include "quant_format.h"

namespace quant {

// One row of activations, per group of 32: x ≈ d * q with q in -kQMax..kQMax; qs and xs: the sums of q and the
// exact sums of x (the zero term needs no rounding: llama.cpp's Q8_1 keeps d * sum(q) there instead) over inputs
// 0..15 (qs0, xs0) and over all 32 (qs, xs)
struct Acts {
  std::vector<int16_t> q;
  std::vector<float> d, xs0, xs;
  std::vector<int32_t> qs0, qs;
};

// What group g adds to an output, given s: the integer sums of q * xq over its inputs 0..15 and 16..31: per part,
// scale * d * sum((q - centre) * xq) (+ zero * the exact sum of x)
template <typename F>
float group_term(const Block<F>& b, int g, const int* s, const float* d, const int32_t* qs0, const int32_t* qs,
                 const float* xs0, const float* xs) {
  const int part_s[2] = {F::kHalf ? s[0] : s[0] + s[1], s[1]};
  const int part_qs[2] = {F::kHalf ? qs0[g] : qs[g], qs[g] - qs0[g]};
  const float part_xs[2] = {F::kHalf ? xs0[g] : xs[g], xs[g] - xs0[g]};
  float sum = 0.f;
  for (int p = 0; p < F::kParts; ++p) {
    const float scale = b.scalar(g, p, 0);
    sum += scale * d[g] * static_cast<float>(part_s[p] - F::kCentre * part_qs[p]);
    if (F::kOff) sum += (F::kCentre * scale + b.scalar(g, p, 1)) * part_xs[p];
  }
  return sum;
}

// What an output's groups [g0, g1) add, one value at a time (the scalar path)
template <typename F>
float groups_term(const Block<F>& b, const int16_t* x, const float* d, const int32_t* qs0, const int32_t* qs,
                  const float* xs0, const float* xs, int g0, int g1) {
  float sum = 0.f;
  for (int g = g0; g < g1; ++g) {
    int q[kG];
    group_values<F>(b.values(g), q);
    const int16_t* xg = x + g * kG;
    int s[2] = {0, 0};
    for (int i = 0; i < kG; ++i) s[i >= 16] += q[i] * xg[i];
    sum += group_term(b, g, s, d, qs0, qs, xs0, xs);
  }
  return sum;
}

}  // namespace quant

// the NEON path (arch/arm), for the rows in order
#if defined(__ARM_NEON) && defined(__aarch64__)
#include "arch/arm/quant_neon.h"
#endif

namespace quant {

template <typename T>
const Acts& quantize_rows(const T* x, int64_t xs, int rows, int K) {
  thread_local Acts a;  // grown once: a step calls this ~120 times
  const int ng = K / kG;
  a.q.resize(static_cast<size_t>(rows) * K);
  for (auto* v : {&a.d, &a.xs0, &a.xs}) v->resize(static_cast<size_t>(rows) * ng);
  a.qs0.resize(a.d.size()), a.qs.resize(a.d.size());
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < ng; ++g) {
      const T* xg = x + r * xs + g * kG;
      float mx = 0.f, sum[2] = {0.f, 0.f};
      for (int i = 0; i < kG; ++i) {
        mx = fmaxf(mx, fabsf(load(xg[i])));
        sum[i >= 16] += load(xg[i]);
      }
      const float inv = mx > 0.f ? kQMax / mx : 0.f;
      int16_t* qg = a.q.data() + static_cast<int64_t>(r) * K + g * kG;
      int qsum[2] = {0, 0};
      for (int i = 0; i < kG; ++i) {
        qg[i] = static_cast<int16_t>(lrintf(load(xg[i]) * inv));
        qsum[i >= 16] += qg[i];
      }
      const int at = r * ng + g;
      a.d[at] = mx / kQMax;
      a.xs0[at] = sum[0], a.xs[at] = sum[0] + sum[1];
      a.qs0[at] = qsum[0], a.qs[at] = qsum[0] + qsum[1];
    }
  }
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  split_bytes(a.q);
#endif
  return a;
}


// One output: the groups' terms, through the CPU's SIMD path where it has one (neon_groups_term), else one value at
// a time (groups_term)
template <typename F>
HOT_INLINE float row_dot(const Block<F>& b, const int16_t* x, const float* d, const int32_t* qs0, const int32_t* qs,
                     const float* xs0, const float* xs, int ng) {
  int g = 0;
  float sum = 0.f;
#if defined(__ARM_NEON) && defined(__aarch64__)
  sum = neon_groups_term(b, x, d, xs0, xs, ng), g = ng;  // every group: none left for groups_term
#endif
  return sum + groups_term(b, x, d, qs0, qs, xs0, xs, g, ng);
}

// No format rounds its activations to int8 on these paths (group_matmul's narrow)
template <typename F>
constexpr bool narrow_products() {
  return false;
}

// Each weight row is read from memory once for all rows of x. The activations are int16 here whatever `narrow` asks
// (the tiles' int8 products are what it saves, and rows in order run few rows)
template <typename F, typename T, typename U>
void group_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, U* y, int64_t ys, int N, int K,
                  bool /*narrow*/) {
  const int ng = K / kG;
  const Acts& a = quantize_rows(x, xs, rows, K);
  // Each thread asks for its rows 4 KiB ahead at one row of x, where this path reads fastest. More rows redo the
  // unpacking for each, so arithmetic binds the path and prefetches only cost instructions (docs/benchmarks.md,
  // "Prefetch distances")
  const bool ask = rows == 1;
  const int n0 = tm.share_begin(N), n1 = tm.share_end(N);
  for (int n = n0; n < n1; ++n) {
    const Block<F> b(w, n, K);
    if (ask)
      for (int c = 0; c < ng * F::kRowBytes; c += 64) __builtin_prefetch(b.base + 4096 + c);
    for (int r = 0; r < rows; ++r) {
      const int64_t at = static_cast<int64_t>(r) * ng;
      store(y + r * ys + n, row_dot(b, a.q.data() + static_cast<int64_t>(r) * K, a.d.data() + at, a.qs0.data() + at,
                                    a.qs.data() + at, a.xs0.data() + at, a.xs.data() + at, ng));
    }
  }
}

}  // namespace quant

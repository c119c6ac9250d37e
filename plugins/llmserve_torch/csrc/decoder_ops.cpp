// The elementwise parts of a Llama-style decoder layer fused into one pass each, for CPU decode steps
// where each torch op costs more in dispatch than in arithmetic (SmolLM2 at one sequence: ~40 small
// ops a layer). Every result is rounded to T exactly where Hugging Face's PyTorch code rounds it, so
// a bf16 model computes what HF computes, up to the order of float additions.
//
// Plain C ABI, loaded with ctypes together with the paged attention kernel (one library).

#include <math.h>

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kernels.h"

namespace {

// x += delta (when delta is given), then out = w * T(rms_norm(x)) with the norm in float; this member's rows.
template <typename T>
void add_rms_norm(const Team& tm, T* x, int64_t xs, const T* delta, int64_t ds, const T* w, T* out, int64_t os,
                  int rows, int n, float eps) {
  for (int r = tm.begin(rows); r < tm.end(rows); ++r) {
    T* xr = x + r * xs;
    float ss = 0.f;
    if (delta != nullptr) {
      const T* dr = delta + r * ds;
      for (int i = 0; i < n; ++i) {
        float v = round_to<T>(load(xr[i]) + load(dr[i]));
        store(xr + i, v);
        ss += v * v;
      }
    } else {
      for (int i = 0; i < n; ++i) {
        float v = load(xr[i]);
        ss += v * v;
      }
    }
    const float inv = 1.f / sqrtf(ss / n + eps);
    T* o = out + r * os;
    for (int i = 0; i < n; ++i) store(o + i, load(w[i]) * round_to<T>(load(xr[i]) * inv));
  }
}

// Rotate-half RoPE in place on the first `heads` heads of each row (the Q heads, then the K heads);
// cos/sin: [rows, D/2] float32 holding values already rounded to T (HF casts its tables to T), or with pos the
// whole tables, row r reading position pos[r]. This member's share of the rows' heads.
template <typename T>
void rope(const Team& tm, T* qk, int64_t stride, int rows, int heads, int D, const float* cos, const float* sin,
          const int32_t* pos) {
  const int half = D / 2;
  for (int item = tm.begin(rows * heads); item < tm.end(rows * heads); ++item) {
    const int r = item / heads, h = item % heads;
    const int64_t at = static_cast<int64_t>(pos != nullptr ? pos[r] : r) * half;
    const float* c = cos + at;
    const float* s = sin + at;
    T* p = qk + r * stride + static_cast<int64_t>(h) * D;
    for (int i = 0; i < half; ++i) {
      const float x1 = load(p[i]), x2 = load(p[i + half]);
      store(p + i, round_to<T>(x1 * c[i]) - round_to<T>(x2 * s[i]));
      store(p + i + half, round_to<T>(x2 * c[i]) + round_to<T>(x1 * s[i]));
    }
  }
}

// out = T(silu(gate)) * up, gate and up the two halves of each gate|up row; this member's columns.
template <typename T>
void silu_mul(const Team& tm, const T* gu, int64_t gs, T* out, int64_t os, int rows, int inter) {
  for (int r = 0; r < rows; ++r) {
    const T* g = gu + r * gs;
    const T* u = g + inter;
    T* o = out + r * os;
    for (int i = tm.begin(inter); i < tm.end(inter); ++i) {
      const float x = load(g[i]);
      store(o + i, round_to<T>(x / (1.f + expf(-x))) * load(u[i]));
    }
  }
}

// y[r, n] = scale[n] * sum_k x[r, k] * w[n, k] for a few rows: each int8 weight row is read once from
// memory for all of them (torch's _weight_int8pack_mm streams the weights far below the memory's bandwidth).
constexpr int kMaxRows = LLMSERVE_INT8_MAX_ROWS;
constexpr int kMaxK = LLMSERVE_INT8_MAX_K;
constexpr int kBlock = 64;  // activations are rounded to int16 with one scale per 64

#if defined(__AVX2__)
// Asks for the weight row prefetch_distance(rows, 12 KiB) past this one's K bytes: the hardware prefetcher alone
// does not keep enough of a streamed LM head in flight at a few rows (docs/benchmarks.md, "Prefetch distances")
inline void prefetch_ahead(const int8_t* wn, int K, int rows) {
  const int ahead = prefetch_distance(rows, 12288);
  for (int b = 0; b < K; b += 64) _mm_prefetch(reinterpret_cast<const char*>(wn) + ahead + b, _MM_HINT_T0);
}

// The activations rounded to int16 per block of 64 and multiplied with the widened int8 weights by vpmaddwd
// (vpdpwssd with AVX512-VNNI). Not int8, as llama.cpp's Q8_0 x Q8_0: that lost SmolLM2's small activations beside
// its outliers (see quant_matmul.cpp: ~1% of a row's largest output off, against 0.005% here), and its vpdpbusd
// path was no faster than this one up to 4 rows. The float loop of int8_matmul is the fallback (no AVX2, or K not a
// multiple of 64): several times slower (docs/benchmarks.md, "The kernels' choices").
inline __m256i dot16(const int16_t* x, const int8_t* w) {  // 16 products, as 8 int32 pair sums
  const __m256i wi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), wi);
}

#if defined(__AVX512BW__)
// Outputs [n0, n1) for RB rows of x: each block of 64 weights widened to int16 once for all of them (per row of x it
// was, and at 8 rows the widening was a third of the work)
template <int RB>
void int8_rows(const int8_t* w, const float* scale, const int16_t (*xq)[kMaxK], const float (*xs)[kMaxK / kBlock],
               float* y, int64_t ys, int n0, int n1, int K) {
  const int nb = K / kBlock;
  for (int n = n0; n < n1; ++n) {
    const int8_t* wn = w + static_cast<int64_t>(n) * K;
    prefetch_ahead(wn, K, RB);
    __m512 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {  // a block's sum: at most 64 * 127 * 32767 < 2^31
      const int8_t* wb = wn + b * kBlock;
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb)));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32)));
      for (int r = 0; r < RB; ++r) {
        const int16_t* xb = xq[r] + b * kBlock;
#if defined(__AVX512VNNI__)
        const __m512i d = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_load_si512(xb), w0),
                                              _mm512_load_si512(xb + 32), w1);
#else
        const __m512i d = _mm512_add_epi32(_mm512_madd_epi16(_mm512_load_si512(xb), w0),
                                           _mm512_madd_epi16(_mm512_load_si512(xb + 32), w1));
#endif
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(xs[r][b]), acc[r]);
      }
    }
    for (int r = 0; r < RB; ++r) y[r * ys + n] = _mm512_reduce_add_ps(acc[r]) * scale[n];
  }
}

void (*const kInt8Rows[kMaxRows])(const int8_t*, const float*, const int16_t (*)[kMaxK],
                                  const float (*)[kMaxK / kBlock], float*, int64_t, int, int, int) = {
    int8_rows<1>, int8_rows<2>, int8_rows<3>, int8_rows<4>, int8_rows<5>, int8_rows<6>, int8_rows<7>, int8_rows<8>};
#endif

void int8_matmul_i16(const Team& tm, const float* xf, int rows, const int8_t* w, const float* scale, float* y,
                     int64_t ys, int N, int K) {
  const int nb = K / kBlock;
  alignas(64) static thread_local int16_t xq[kMaxRows][kMaxK];
  static thread_local float xs[kMaxRows][kMaxK / kBlock];
  for (int r = 0; r < rows; ++r) {
    for (int b = 0; b < nb; ++b) {
      const float* x = xf + r * kMaxK + b * kBlock;
      float mx = 0.f;
      for (int i = 0; i < kBlock; ++i) mx = fmaxf(mx, fabsf(x[i]));
      const float inv = mx > 0.f ? 32767.f / mx : 0.f;
      xs[r][b] = mx / 32767.f;
      for (int i = 0; i < kBlock; ++i) xq[r][b * kBlock + i] = static_cast<int16_t>(lrintf(x[i] * inv));
    }
  }
  const int16_t(*xqp)[kMaxK] = xq;
  const float(*xsp)[kMaxK / kBlock] = xs;
#if defined(__AVX512BW__)
  if (rows > 0) kInt8Rows[rows - 1](w, scale, xqp, xsp, y, ys, tm.share_begin(N), tm.share_end(N), K);
#else
  const int n0 = tm.share_begin(N), n1 = tm.share_end(N);
  for (int n = n0; n < n1; ++n) {
    const int8_t* wn = w + static_cast<int64_t>(n) * K;
    prefetch_ahead(wn, K, rows);
    for (int r = 0; r < rows; ++r) {
      __m256 acc = _mm256_setzero_ps();
      for (int b = 0; b < nb; ++b) {  // a block's sum: at most 64 * 127 * 32767 < 2^31
        const int16_t* xb = xqp[r] + b * kBlock;
        const int8_t* wb = wn + b * kBlock;
        const __m256i d = _mm256_add_epi32(_mm256_add_epi32(dot16(xb, wb), dot16(xb + 16, wb + 16)),
                                           _mm256_add_epi32(dot16(xb + 32, wb + 32), dot16(xb + 48, wb + 48)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(xsp[r][b]), acc);
      }
      __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
      y[r * ys + n] = _mm_cvtss_f32(s4) * scale[n];
    }
  }
#endif
}
#endif

// This member's outputs; every member rounds x itself (into its own buffers)
template <typename T>
void int8_matmul(const Team& tm, const T* x, int64_t xs, int rows, const int8_t* w, const float* scale, float* y,
                 int64_t ys, int N, int K) {
  static thread_local float xf[kMaxRows][kMaxK];
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < K; ++k) xf[r][k] = load(x[r * xs + k]);
#if defined(__AVX2__)
  if (K % kBlock == 0) {
    int8_matmul_i16(tm, &xf[0][0], rows, w, scale, y, ys, N, K);
    return;
  }
#endif
  const float(*xfp)[kMaxK] = xf;
  const int n0 = tm.share_begin(N), n1 = tm.share_end(N);
  for (int n = n0; n < n1; ++n) {
    const int8_t* wn = w + static_cast<int64_t>(n) * K;
    for (int r = 0; r < rows; ++r) {
      const float* xr = xfp[r];
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int k = 0; k < K; ++k) acc += xr[k] * static_cast<float>(wn[k]);
      y[r * ys + n] = acc * scale[n];
    }
  }
}

}  // namespace

extern "C" {

void llmserve_int8_matmul(const void* x, int64_t xs, int rows, const int8_t* w, const float* scale, float* y,
                          int64_t ys, int N, int K, int elem_size, int th) {
  on_team(th, true, [&](const Team& tm) { team_int8_matmul(tm, x, xs, rows, w, scale, y, ys, N, K, elem_size); });
}

// The elementwise kernels run on one thread up to 8 rows (a parallel region costs more than they do)
void llmserve_add_rms_norm(void* x, int64_t xs, const void* delta, int64_t ds, const void* w, void* out, int64_t os,
                           int rows, int n, float eps, int elem_size, int th) {
  on_team(th, rows > 8,
          [&](const Team& tm) { team_add_rms_norm(tm, x, xs, delta, ds, w, out, os, rows, n, eps, elem_size); });
}

void llmserve_rope(void* qk, int64_t stride, int rows, int heads, int D, const float* cos, const float* sin,
                   int elem_size, int th) {
  on_team(th, rows > 8,
          [&](const Team& tm) { team_rope(tm, qk, stride, rows, heads, D, cos, sin, nullptr, elem_size); });
}

void llmserve_silu_mul(const void* gu, int64_t gs, void* out, int64_t os, int rows, int inter, int elem_size,
                       int th) {
  on_team(th, rows > 8, [&](const Team& tm) { team_silu_mul(tm, gu, gs, out, os, rows, inter, elem_size); });
}

}  // extern "C"

void team_int8_matmul(const Team& tm, const void* x, int64_t xs, int rows, const int8_t* w, const float* scale,
                      float* y, int64_t ys, int N, int K, int elem_size) {
  if (elem_size == 4)
    int8_matmul<float>(tm, static_cast<const float*>(x), xs, rows, w, scale, y, ys, N, K);
  else
    int8_matmul<uint16_t>(tm, static_cast<const uint16_t*>(x), xs, rows, w, scale, y, ys, N, K);
}

void team_add_rms_norm(const Team& tm, void* x, int64_t xs, const void* delta, int64_t ds, const void* w, void* out,
                       int64_t os, int rows, int n, float eps, int elem_size) {
  if (elem_size == 4)
    add_rms_norm<float>(tm, static_cast<float*>(x), xs, static_cast<const float*>(delta), ds,
                        static_cast<const float*>(w), static_cast<float*>(out), os, rows, n, eps);
  else
    add_rms_norm<uint16_t>(tm, static_cast<uint16_t*>(x), xs, static_cast<const uint16_t*>(delta), ds,
                           static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), os, rows, n, eps);
}

void team_rope(const Team& tm, void* qk, int64_t stride, int rows, int heads, int D, const float* cos,
               const float* sin, const int32_t* pos, int elem_size) {
  if (elem_size == 4)
    rope<float>(tm, static_cast<float*>(qk), stride, rows, heads, D, cos, sin, pos);
  else
    rope<uint16_t>(tm, static_cast<uint16_t*>(qk), stride, rows, heads, D, cos, sin, pos);
}

void team_silu_mul(const Team& tm, const void* gu, int64_t gs, void* out, int64_t os, int rows, int inter,
                   int elem_size) {
  if (elem_size == 4)
    silu_mul<float>(tm, static_cast<const float*>(gu), gs, static_cast<float*>(out), os, rows, inter);
  else
    silu_mul<uint16_t>(tm, static_cast<const uint16_t*>(gu), gs, static_cast<uint16_t*>(out), os, rows, inter);
}

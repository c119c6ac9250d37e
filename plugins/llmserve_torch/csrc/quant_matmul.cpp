// The int4 weight-only matmul for a few rows (decode steps): y[r, n] = sum_k x[r, k] * w[n, k], each
// quantized weight row read once from memory for all rows (torch's _weight_int4pack_mm_for_cpu read ~16 GB/s
// with bf16 activations, and took a slow path with float32 ones). Activations are quantized to int8 per block,
// as llama.cpp does, so the inner products run on integer SIMD: AVX512-VNNI (vpdpbusd), AVX-VNNI, or AVX2
// (vpmaddubsw + vpmaddwd), with a scalar loop where none of them exists (-march=native picks).
//
// Plain C ABI, loaded with ctypes together with the other CPU kernels (one library).

#include <math.h>

#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"

namespace {

constexpr int kMaxRows = 8;  // rows one pass keeps accumulators for; more rows take more passes
constexpr int kG4 = 32;      // int4 group: one scale and offset per 32 inputs (llama.cpp's Q4_0/Q4_1 block)

// x[r, :] ≈ d[r, b] * q[r, b*B:(b+1)*B] with q in -127..127; sx[r, b] = the block's exact sum (the offset
// term needs no rounding: llama.cpp's Q8_1 keeps d * sum(q) there instead)
template <typename T>
void quantize_rows(const T* x, int64_t xs, int rows, int K, int B, int8_t* q, float* d, float* sx) {
  const int nb = K / B;
  for (int r = 0; r < rows; ++r) {
    for (int b = 0; b < nb; ++b) {
      const T* xb = x + r * xs + b * B;
      float mx = 0.f, sum = 0.f;
      for (int i = 0; i < B; ++i) {
        mx = fmaxf(mx, fabsf(load(xb[i])));
        sum += load(xb[i]);
      }
      const float inv = mx > 0.f ? 127.f / mx : 0.f;
      int8_t* qb = q + static_cast<int64_t>(r) * K + b * B;
      for (int i = 0; i < B; ++i) qb[i] = static_cast<int8_t>(lrintf(load(xb[i]) * inv));
      d[r * nb + b] = mx / 127.f;
      sx[r * nb + b] = sum;
    }
  }
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// eight int32 sums of four u8 * s8 products each (without VNNI, pairs of u * s are summed in int16: safe for
// |x| <= 127 and |w| <= 8)
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

// int4: w[n, 32g + j] = (q - 8) * scale[n, g] + zero[n, g], q in 0..15 packed two per byte, byte j of a group
// holding j (low nibble) and j + 16 (high nibble); sz[n, g] = (scale, zero). Centred on 8, the weights the
// rounded activations meet are half as large as llama.cpp's Q4_1 x Q8_1 (q * scale + min), and so is the error.
template <int R>
void int4_pass(const int8_t* xq, const float* xd, const float* xsum, const uint8_t* w, const float* sz, float* y,
               int64_t ys, int N, int K, int th) {
  const int ng = K / kG4;
#pragma omp parallel for num_threads(th) schedule(static)
  for (int n = 0; n < N; ++n) {
    const uint8_t* wn = w + static_cast<int64_t>(n) * (K / 2);
    const float* sn = sz + static_cast<int64_t>(n) * ng * 2;
    float corr[R];
    for (int r = 0; r < R; ++r) corr[r] = 0.f;
#if defined(__AVX2__)
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i eight = _mm256_set1_epi8(8);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < ng; ++g) {
      const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + g * 16));
      const __m256i qw = _mm256_sub_epi8(
          _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), m4), _mm_and_si128(p, m4)), eight);
      for (int r = 0; r < R; ++r) {
        const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * kG4));
        // |x| times w with x's sign: the unsigned-by-signed products the instruction takes
        const __m256i dot = dot_u8s8(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qw, qx));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sn[2 * g] * xd[r * ng + g]), acc[r]);
        corr[r] += sn[2 * g + 1] * xsum[r * ng + g];
      }
    }
    for (int r = 0; r < R; ++r) y[r * ys + n] = hsum(acc[r]) + corr[r];
#else
    float acc[R];
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int g = 0; g < ng; ++g) {
      const uint8_t* p = wn + g * 16;
      for (int r = 0; r < R; ++r) {
        const int8_t* qx = xq + r * K + g * kG4;
        int dot = 0;
        for (int j = 0; j < 16; ++j) dot += ((p[j] & 15) - 8) * qx[j] + ((p[j] >> 4) - 8) * qx[j + 16];
        acc[r] += static_cast<float>(dot) * sn[2 * g] * xd[r * ng + g];
        corr[r] += sn[2 * g + 1] * xsum[r * ng + g];
      }
    }
    for (int r = 0; r < R; ++r) y[r * ys + n] = acc[r] + corr[r];
#endif
  }
}

template <template <int> class Pass, typename... A>
void by_rows(int rows, A... a) {
  switch (rows) {
    case 1: Pass<1>::run(a...); break;
    case 2: Pass<2>::run(a...); break;
    case 3: Pass<3>::run(a...); break;
    case 4: Pass<4>::run(a...); break;
    case 5: Pass<5>::run(a...); break;
    case 6: Pass<6>::run(a...); break;
    case 7: Pass<7>::run(a...); break;
    default: Pass<8>::run(a...); break;
  }
}

template <int R>
struct Int4Pass {
  static void run(const int8_t* xq, const float* xd, const float* xsum, const uint8_t* w, const float* sz, float* y,
                  int64_t ys, int N, int K, int th) {
    int4_pass<R>(xq, xd, xsum, w, sz, y, ys, N, K, th);
  }
};

// quantize the activations, then run passes of up to kMaxRows rows
template <typename T, typename F>
void in_passes(const T* x, int64_t xs, int rows, int K, int B, float* y, int64_t ys, F pass) {
  const int nb = K / B;
  std::vector<int8_t> q(static_cast<size_t>(rows) * K);
  std::vector<float> d(static_cast<size_t>(rows) * nb), ds(static_cast<size_t>(rows) * nb);
  quantize_rows(x, xs, rows, K, B, q.data(), d.data(), ds.data());
  for (int r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int rs = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
    pass(rs, q.data() + static_cast<int64_t>(r0) * K, d.data() + r0 * nb, ds.data() + r0 * nb, y + r0 * ys);
  }
}

template <typename T>
void int4_matmul(const T* x, int64_t xs, int rows, const uint8_t* w, const float* sz, float* y, int64_t ys, int N,
                 int K, int th) {
  in_passes(x, xs, rows, K, kG4, y, ys, [&](int rs, const int8_t* q, const float* d, const float* ds, float* yr) {
    by_rows<Int4Pass>(rs, q, d, ds, w, sz, yr, ys, N, K, th);
  });
}

}  // namespace

extern "C" {

// Which integer dot product this build runs (for /stats and the start-up log).
const char* llmserve_quant_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX2__)
  return "avx512-vnni";
#elif defined(__AVXVNNI__) && defined(__AVX2__)
  return "avx-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// x: [rows, K] float32 (elem_size 4) or bf16 (2), row stride xs; K a multiple of 32; y: [rows, N] float32.
void llmserve_int4_matmul(const void* x, int64_t xs, int rows, const uint8_t* w, const float* sz, float* y, int64_t ys,
                          int N, int K, int elem_size, int th) {
  if (elem_size == 4)
    int4_matmul<float>(static_cast<const float*>(x), xs, rows, w, sz, y, ys, N, K, th);
  else
    int4_matmul<uint16_t>(static_cast<const uint16_t*>(x), xs, rows, w, sz, y, ys, N, K, th);
}

}  // extern "C"

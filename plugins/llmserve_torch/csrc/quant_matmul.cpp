// The int4 weight-only matmul: y[r, n] = sum_k x[r, k] * w[n, k], each quantized weight row read once from
// memory for all rows (torch's _weight_int4pack_mm_for_cpu read ~16 GB/s with bf16 activations, and took a
// slow path with float32 ones). Activations are quantized to int16 per group of 32, so the inner products run
// on integer SIMD (AVX2 vpmaddwd; for one or two rows with AVX512-VNNI, vpdpbusd on each int16's two bytes; a scalar
// loop without AVX2; -march=native picks). Not int8 as llama.cpp's
// Q8_1: SmolLM2's activations have outliers, a group's small values then round to zero, and greedy answers
// changed with a prefix-cache hit (the last prompt rows taking this kernel instead of the dense copy).
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

constexpr int kG4 = 32;  // int4 group: one scale and zero per 32 inputs (llama.cpp's Q4_0/Q4_1 block)

// One row of activations, per group of 32: x ≈ d * q with q in -kQMax..kQMax, qsum = sum(q), xsum = the exact sum
// (the zero term needs no rounding: llama.cpp's Q8_1 keeps d * sum(q) there instead)
struct Acts {
  std::vector<int16_t> q;
  std::vector<float> d, xsum;
  std::vector<int32_t> qsum;
  std::vector<int8_t> xh, xl;  // (split layout only) q = 256 * xh + xl, both signed, groups in blocks of four
};

// The largest |q|: 256 * 127 + 127, so that q splits into two signed bytes (xh = (q + 128) >> 8 stays <= 127)
constexpr float kQMax = 32639.f;

// How a row of activations is laid out for the kernel that reads it
enum class Layout {
  natural,  // groups in order (the AVX2 and scalar paths)
  paired,   // groups in pairs for the AVX-512 many-row path (x_index)
  split,    // natural int16 q, plus q's two bytes for the AVX512-VNNI one- and two-row path (split_index)
};

// Where element i of group g sits in the split bytes: groups in blocks of four, each block as [g0 0..15, g1 0..15,
// g2 0..15, g3 0..15, g0 16..31, …, g3 16..31], so one 512-bit load of four groups' packed bytes gives their low
// nibbles (one vector) and high nibbles (the next) against two loads of x. Groups past the last block of four are
// not split (the int16 path takes them).
inline int64_t split_index(int g, int i) { return (g & ~3) * kG4 + (i >> 4) * 64 + (g & 3) * 16 + (i & 15); }

// Where element i of group g sits in a row of quantized activations: in order, or (paired, for the AVX-512 path)
// with the groups in pairs, each as [g0 0..15, g1 0..15, g0 16..31, g1 16..31]: the low nibbles of two groups' 32
// packed bytes are then one vector's worth of values meeting one load of x, the high nibbles the next (a last odd
// group stays in order).
inline int64_t x_index(int g, int i, int ng, bool paired) {
  if (paired && g < (ng & ~1)) return (g & ~1) * kG4 + (i >> 4) * 32 + (g & 1) * 16 + (i & 15);
  return static_cast<int64_t>(g) * kG4 + i;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// A row's int16 values (natural order) as their two signed bytes in the split layout, for its first nq groups:
// h = floor((q + 128) / 256), l = q - 256 h in -128..127 (|q| <= kQMax keeps h <= 127)
inline void split_row(const int16_t* q, int8_t* xh, int8_t* xl, int nq) {
  const __m256i c128 = _mm256_set1_epi16(128);
  for (int g = 0; g < nq; ++g)
    for (int half = 0; half < 2; ++half) {  // elements 0..15, then 16..31: each lands as 16 contiguous bytes
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kG4 + half * 16));
      const __m256i h = _mm256_srai_epi16(_mm256_add_epi16(v, c128), 8);
      const __m256i l = _mm256_sub_epi16(v, _mm256_slli_epi16(h, 8));
      const int64_t at = split_index(g, half * 16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xh + at), _mm256_cvtepi16_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xl + at), _mm256_cvtepi16_epi8(l));
    }
}
#endif

template <typename T>
Acts quantize_rows(const T* x, int64_t xs, int rows, int K, Layout layout) {
  const int ng = K / kG4;
  const bool paired = layout == Layout::paired, split = layout == Layout::split;
  Acts a{std::vector<int16_t>(static_cast<size_t>(rows) * K), std::vector<float>(static_cast<size_t>(rows) * ng),
         std::vector<float>(static_cast<size_t>(rows) * ng), std::vector<int32_t>(static_cast<size_t>(rows) * ng),
         std::vector<int8_t>(split ? static_cast<size_t>(rows) * K : 0),
         std::vector<int8_t>(split ? static_cast<size_t>(rows) * K : 0)};
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < ng; ++g) {
      const T* xg = x + r * xs + g * kG4;
      float mx = 0.f, sum = 0.f;
      for (int i = 0; i < kG4; ++i) {
        mx = fmaxf(mx, fabsf(load(xg[i])));
        sum += load(xg[i]);
      }
      const float inv = mx > 0.f ? kQMax / mx : 0.f;
      int16_t* qr = a.q.data() + static_cast<int64_t>(r) * K;
      int qsum = 0;
      for (int i = 0; i < kG4; ++i) {
        const int16_t q = static_cast<int16_t>(lrintf(load(xg[i]) * inv));
        qr[x_index(g, i, ng, paired)] = q;
        qsum += q;
      }
      a.d[r * ng + g] = mx / kQMax;
      a.xsum[r * ng + g] = sum;
      a.qsum[r * ng + g] = qsum;
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (split) split_row(a.q.data() + static_cast<int64_t>(r) * K, a.xh.data() + static_cast<int64_t>(r) * K,
                         a.xl.data() + static_cast<int64_t>(r) * K, ng & ~3);
#endif
  }
  return a;
}

// One group's term of an output: s = sum((q - 8) * xq) in integers, rescaled by the weight scale and the activation
// step d, plus the zero point times the exact sum of the group's activations
inline float group_term(int s, float scale, float d, float zero, float xsum) { return s * scale * d + zero * xsum; }

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// lane i: the sum of v[i]'s eight lanes
inline __m256i hsum8(const __m256i* v) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

// one group: eight int32 partial sums of q * x, q the 4-bit values 0..15 and x int16 (the group's whole sum is
// at most 32 * 15 * 32767 < 2^24: exact in int32 and in its float conversion)
inline __m256i group_dot(const uint8_t* p16, const int16_t* x32) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p16));
  const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(p, m4));                     // q[0..15]
  const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(p, 4), m4));  // q[16..31]
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x32));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x32 + 16));
  return _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
}
#endif

// One output: sum over groups of scale * d * (sum(q * x) - 8 * qsum) + zero * xsum. The -8 centres the weights
// exactly (integers): the rounded activations meet w - zero = (q - 8) * scale, half as large as q * scale + min.
inline float row_dot(const uint8_t* w, const float* scale, const float* zero, const int16_t* x, const float* d,
                     const int32_t* qsum, const float* xsum, int ng) {
  int g = 0;
  float tail = 0.f;
#if defined(__AVX2__)
  // eight groups at a time: their int32 sums meet their eight scales in one vector (not one broadcast each)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= ng; g += 8) {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = group_dot(w + (g + j) * 16, x + (g + j) * kG4);
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qsum + g));
    const __m256i s = _mm256_sub_epi32(hsum8(v), _mm256_slli_epi32(qs, 3));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(_mm256_loadu_ps(scale + g), _mm256_loadu_ps(d + g)),
                          acc);
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(zero + g), _mm256_loadu_ps(xsum + g), acc);
  }
  for (; g < ng; ++g) {  // the groups left over (576 inputs are 18 groups): one at a time, still in SIMD
    tail += group_term(hsum_i32(group_dot(w + g * 16, x + g * kG4)) - 8 * qsum[g], scale[g], d[g], zero[g], xsum[g]);
  }
  tail += hsum(acc);
#endif
  for (; g < ng; ++g) {
    const uint8_t* p = w + g * 16;
    const int16_t* xg = x + g * kG4;
    int s = 0;
    for (int j = 0; j < 16; ++j) s += (p[j] & 15) * xg[j] + (p[j] >> 4) * xg[j + 16];
    tail += group_term(s - 8 * qsum[g], scale[g], d[g], zero[g], xsum[g]);
  }
  return tail;
}

#if defined(__AVX512BW__)
// Two groups' values as int16, centred (q - 8), from their 32 packed bytes: lo = both groups' q[0..15], hi = their
// q[16..31], in the pair layout of x_index
inline void unpack_pair(const uint8_t* p32, __m512i* lo, __m512i* hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m512i eight = _mm512_set1_epi16(8);
  const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p32));
  *lo = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(p, m4)), eight);
  *hi = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(p, 4), m4)), eight);
}

inline __m512i madd_acc(__m512i acc, __m512i w, const int16_t* x) {  // acc + pair sums of w * x
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, _mm512_loadu_si512(x));
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_loadu_si512(x)));
#endif
}

// one pair of groups against its 64 activations: lanes 0..7 sum the first group, 8..15 the second (|q - 8| <= 8,
// so a group's whole sum stays below 2^23: exact in int32 and in float)
inline __m512i pair_dot(__m512i lo, __m512i hi, const int16_t* x64) {
  return madd_acc(madd_acc(_mm512_setzero_si512(), lo, x64), hi, x64 + 32);
}

constexpr int kRowBlock = 8;  // rows that share one unpacking of a weight row's groups (their sums stay in registers)

// One weight row against every row of x: each 8 groups are unpacked once into registers and meet all rows of a
// block, so at 64 rows the unpacking is not repeated 64 times (the AVX2 path below does repeat it).
template <typename T>
inline void row_all(const uint8_t* w, const float* scale, const float* zero, const Acts& a, int rows, int K, T* y,
                    int64_t ys) {
  const int ng = K / kG4;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int rb = rows - r0 < kRowBlock ? rows - r0 : kRowBlock;
    __m256 acc[kRowBlock];
    float tail[kRowBlock];
    for (int r = 0; r < rb; ++r) acc[r] = _mm256_setzero_ps(), tail[r] = 0.f;
    int g = 0;
    for (; g + 8 <= ng; g += 8) {
      __m512i lo[4], hi[4];
      for (int j = 0; j < 4; ++j) unpack_pair(w + (g + 2 * j) * 16, lo + j, hi + j);
      const __m256 sc = _mm256_loadu_ps(scale + g), zc = _mm256_loadu_ps(zero + g);
      for (int r = 0; r < rb; ++r) {
        const int64_t row = r0 + r;
        const int16_t* xr = a.q.data() + row * K + g * kG4;
        __m256i h[8];
        for (int j = 0; j < 4; ++j) {
          const __m512i v = pair_dot(lo[j], hi[j], xr + j * 64);
          h[2 * j] = _mm512_castsi512_si256(v);
          h[2 * j + 1] = _mm512_extracti64x4_epi64(v, 1);
        }
        const float* d = a.d.data() + row * ng + g;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8(h)), _mm256_mul_ps(sc, _mm256_loadu_ps(d)), acc[r]);
        acc[r] = _mm256_fmadd_ps(zc, _mm256_loadu_ps(a.xsum.data() + row * ng + g), acc[r]);
      }
    }
    for (; g + 2 <= ng; g += 2) {  // the pairs left over (576 inputs are 18 groups: one)
      __m512i lo, hi;
      unpack_pair(w + g * 16, &lo, &hi);
      for (int r = 0; r < rb; ++r) {
        const int64_t row = r0 + r;
        const __m512i v = pair_dot(lo, hi, a.q.data() + row * K + g * kG4);
        for (int j = 0; j < 2; ++j) {
          const int s = hsum_i32(j ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v));
          const int64_t at = row * ng + g + j;
          tail[r] += group_term(s, scale[g + j], a.d[at], zero[g + j], a.xsum[at]);
        }
      }
    }
    if (g < ng) {  // an odd last group, in its natural order: the AVX2 group dot, centred through qsum
      for (int r = 0; r < rb; ++r) {
        const int64_t row = r0 + r;
        const int64_t at = row * ng + g;
        const int s = hsum_i32(group_dot(w + g * 16, a.q.data() + row * K + g * kG4)) - 8 * a.qsum[at];
        tail[r] += group_term(s, scale[g], a.d[at], zero[g], a.xsum[at]);
      }
    }
    for (int r = 0; r < rb; ++r) store(y + (r0 + r) * ys, hsum(acc[r]) + tail[r]);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// How far ahead the split path asks for weight rows: without it the hardware prefetcher left this kernel slower
// than the AVX2 one on weights streamed from memory (a step's 30 layers do not fit the L3), though faster on weights
// in cache; 4 KiB ahead measured best of 1–8 KiB on a Zen 5 EPYC (210 SmolLM2-shaped matrices: 2.28 → 1.91 ms)
constexpr int kPrefetchBytes = 4096;

// One weight row against one row of x, for one or two rows of x (a decode step): each int16 activation is two
// signed bytes, q = 256 * xh + xl, so vpdpbusd multiplies the unsigned 4-bit weights 64 at a time with no widening
// (the int16 path widens every nibble to 16 bits first), and the same integer sums come out exactly:
// sum(w * q) = 256 * sum(w * xh) + sum(w * xl). Each lane's sum is scaled as a float lane by its group's scale,
// so no horizontal sum is taken per group. The -8 centring and the zero term are one vector pass over the groups.
inline float row_dot_split(const uint8_t* w, const float* scale, const float* zero, const Acts& a, int64_t row,
                           int K) {
  const int ng = K / kG4, nq = ng & ~3;
  const int8_t* xh = a.xh.data() + row * K;
  const int8_t* xl = a.xl.data() + row * K;
  const float* d = a.d.data() + row * ng;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // lane → its group
  __m512 acc = _mm512_setzero_ps();
  for (int g = 0; g < nq; g += 4) {
    // two 32-byte loads: a row of 576 inputs is 288 bytes, so one 64-byte load would straddle two cache lines on
    // every other row
    const __m256i* p32 = reinterpret_cast<const __m256i*>(w + g * 16);
    const __m512i p = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(p32)), _mm256_loadu_si256(p32 + 1), 1);
    const __m512i lo = _mm512_and_si512(p, m4), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
    const int8_t* bh = xh + g * kG4;
    const int8_t* bl = xl + g * kG4;
    const __m512i sh = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(bh)),
                                           hi, _mm512_loadu_si512(bh + 64));
    const __m512i sl = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(bl)),
                                           hi, _mm512_loadu_si512(bl + 64));
    const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl);  // lanes 4j..4j+3: group g + j
    const __m128 sd = _mm_mul_ps(_mm_loadu_ps(scale + g), _mm_loadu_ps(d + g));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(sd)), acc);
  }
  float tail = 0.f;
  for (int g = nq; g < ng; ++g)  // the groups past the last four (576 inputs are 18 groups: two), in int16
    tail += scale[g] * d[g] * static_cast<float>(hsum_i32(group_dot(w + g * 16, a.q.data() + row * K + g * kG4)));
  // every group's centring (scale * d * -8 * qsum) and zero term (zero * xsum), 16 groups a vector
  const int32_t* qs = a.qsum.data() + row * ng;
  const float* xsum = a.xsum.data() + row * ng;
  for (int g = 0; g < ng; g += 16) {
    const __mmask16 m = ng - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (ng - g)) - 1);
    const __m512 sd = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scale + g), _mm512_maskz_loadu_ps(m, d + g));
    const __m512 c = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, qs + g)), _mm512_set1_ps(-8.f));
    acc = _mm512_fmadd_ps(sd, c, acc);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, zero + g), _mm512_maskz_loadu_ps(m, xsum + g), acc);
  }
  return _mm512_reduce_add_ps(acc) + tail;
}
#endif

// w[n, 32g + j] = (q - 8) * scale[n, g] + zero[n, g], q in 0..15 packed two per byte, byte j of a group holding
// j (low nibble) and j + 16 (high nibble). Each weight row is read from memory once for all rows of x.
template <typename T>
void int4_matmul(const T* x, int64_t xs, int rows, const uint8_t* w, const float* scale, const float* zero, T* y,
                 int64_t ys, int N, int K, int th) {
  const int ng = K / kG4;
  // one or two rows: the split-byte path where AVX512-VNNI is (16% faster than the AVX2 path on a Zen 5 EPYC),
  // else the AVX2 path, unpacking each group as it meets x (faster on Zen 4 than the 512-bit unpacking: its
  // 512-bit shuffles and widenings cost twice a 256-bit one); from three rows, unpacking once per block of rows wins
  Layout layout = Layout::natural;
#if defined(__AVX512BW__)
  if (rows > 2) layout = Layout::paired;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (rows <= 2) layout = Layout::split;
#endif
  const bool paired = layout == Layout::paired;
  const Acts a = quantize_rows(x, xs, rows, K, layout);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int ahead = kPrefetchBytes / (ng * 16) > 1 ? kPrefetchBytes / (ng * 16) : 1;  // rows, for the split path
#endif
#pragma omp parallel for num_threads(th) schedule(static)
  for (int n = 0; n < N; ++n) {
    const int64_t off = static_cast<int64_t>(n) * ng;
#if defined(__AVX512BW__)
    if (paired) {
      row_all(w + off * 16, scale + off, zero + off, a, rows, K, y + n, ys);
      continue;
    }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (layout == Layout::split) {
      if (n + ahead < N) {  // the weight row `ahead` rows on, with its scales and zeros
        const int64_t at = static_cast<int64_t>(n + ahead) * ng;
        for (int b = 0; b < ng * 16; b += 64) _mm_prefetch(reinterpret_cast<const char*>(w + at * 16 + b), _MM_HINT_T0);
        for (int b = 0; b < ng * 4; b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(scale + at) + b, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(zero + at) + b, _MM_HINT_T0);
        }
      }
      for (int r = 0; r < rows; ++r) store(y + r * ys + n, row_dot_split(w + off * 16, scale + off, zero + off, a, r, K));
      continue;
    }
#endif
    for (int r = 0; r < rows; ++r)
      store(y + r * ys + n, row_dot(w + off * 16, scale + off, zero + off, a.q.data() + static_cast<int64_t>(r) * K,
                                    a.d.data() + r * ng, a.qsum.data() + r * ng, a.xsum.data() + r * ng, ng));
  }
}

}  // namespace

extern "C" {

// The integer SIMD this build's quantized kernels run on (for /stats and the start-up log): both kernels multiply
// int16 activations with vpdpwssd where AVX512-VNNI exists (the int4 one at one or two rows: vpdpbusd on the int16s'
// two bytes), vpmaddwd with AVX2 or AVX512BW, scalar code elsewhere.
const char* llmserve_quant_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512-vnni";
#elif defined(__AVX512BW__)
  return "avx512bw";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// x: [rows, K] float32 (elem_size 4) or bf16 (2), row stride xs; K a multiple of 32; scale, zero: [N, K/32]
// float32; y: [rows, N] in x's dtype (a bf16 model's linears then need no cast after each call).
void llmserve_int4_matmul(const void* x, int64_t xs, int rows, const uint8_t* w, const float* scale,
                          const float* zero, void* y, int64_t ys, int N, int K, int elem_size, int th) {
  if (elem_size == 4)
    int4_matmul<float>(static_cast<const float*>(x), xs, rows, w, scale, zero, static_cast<float*>(y), ys, N, K,
                       th);
  else
    int4_matmul<uint16_t>(static_cast<const uint16_t*>(x), xs, rows, w, scale, zero, static_cast<uint16_t*>(y), ys,
                          N, K, th);
}

}  // extern "C"

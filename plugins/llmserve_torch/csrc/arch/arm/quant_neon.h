// The rows path on ARM64 NEON (quant_rows.h includes it on aarch64): the same rows in order, one group at a time;
// vdotq_s32 where the build has the dot product (-march=armv8.2-a+dotprod and later).
#pragma once

#include <arm_neon.h>

#include <vector>

#include "quant_format.h"

namespace quant {

//
// Each group's sum of (q - centre) * xq in integer SIMD: exact, so the results are the scalar path's (groups_term:
// the same integers meet the same scales), and its bound holds. Checked under qemu (test_kernels_cross.py); how fast
// it runs on an ARM core is not measured.

// One group's values as bytes, lo inputs 0..15, hi 16..31 (group_values' and unpack_row's order)
template <typename F>
inline void neon_unpack(const uint8_t* v, uint8x16_t& lo, uint8x16_t& hi) {
  if (F::kBits == 8) {
    lo = vld1q_u8(v), hi = vld1q_u8(v + 16);
    return;
  }
  const uint8x16_t p = vld1q_u8(v);
  lo = vandq_u8(p, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(p, 4);
  // Input 4c + j's bit is bit c of plane byte j (16 + 4c + j's bit 4 + c): the plane's 4 bytes repeated (byte i of
  // the vector is plane byte i % 4), each byte tested against its bit i / 4, gives 0xFF where the input's bit is set
  static const uint8_t kSel[16] = {1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8};
  const uint8x16_t sel = vld1q_u8(kSel), sel_hi = vshlq_n_u8(sel, 4);
  for (int pl = 0; pl < F::kBits - 4; ++pl) {
    uint32_t bits;
    std::memcpy(&bits, v + 16 + 4 * pl, 4);
    const uint8x16_t b = vreinterpretq_u8_u32(vdupq_n_u32(bits)), bit = vdupq_n_u8(static_cast<uint8_t>(16 << pl));
    lo = vorrq_u8(lo, vandq_u8(vtstq_u8(b, sel), bit));
    hi = vorrq_u8(hi, vandq_u8(vtstq_u8(b, sel_hi), bit));
  }
}

// The values minus the centre, as signed bytes: q - 2^(Bits-1) is in -128..127 for every format, so the centre needs
// no term of its own (the scalar path subtracts centre * sum(xq) afterwards)
template <typename F>
inline void neon_centred(const uint8_t* v, int8x16_t& lo, int8x16_t& hi) {
  uint8x16_t u_lo, u_hi;
  neon_unpack<F>(v, u_lo, u_hi);
  const uint8x16_t c = vdupq_n_u8(static_cast<uint8_t>(F::kCentre));  // wraps mod 256: 200 - 128 = 72, 3 - 8 = -5
  lo = vreinterpretq_s8_u8(vsubq_u8(u_lo, c)), hi = vreinterpretq_s8_u8(vsubq_u8(u_hi, c));
}

#if defined(__ARM_FEATURE_DOTPROD)
// sum(w * xq) over 16 inputs, xq as split_bytes keeps it: each byte half in vdotq_s32 (four products a lane), then
// (sum of h's << 8) + sum of l's. Exact: |sum h| <= 16 * 128 * 127, so shifted it stays far below 2^31
inline int32_t neon_dot16(int8x16_t w, const int8_t* h, const int8_t* l) {
  const int32x4_t sh = vdotq_s32(vdupq_n_s32(0), w, vld1q_s8(h)), sl = vdotq_s32(vdupq_n_s32(0), w, vld1q_s8(l));
  return vaddvq_s32(vaddq_s32(vshlq_n_s32(sh, 8), sl));
}

// A group's two halves' sums of (q - centre) * xq: s[0] inputs 0..15, s[1] 16..31 (xg: 32 h bytes, then 32 l)
template <typename F>
inline void neon_group_sums(const uint8_t* v, const int16_t* xg, int32_t* s) {
  int8x16_t lo, hi;
  neon_centred<F>(v, lo, hi);
  const int8_t* hl = reinterpret_cast<const int8_t*>(xg);
  s[0] = neon_dot16(lo, hl, hl + kG), s[1] = neon_dot16(hi, hl + 16, hl + kG + 16);
}
#else
// sum(w * xq) over 16 inputs: the weights widened to int16, products widened to int32 (vmull / vmlal). Exact: each
// product at most 128 * 32639, sixteen of them below 2^27
inline int32_t neon_dot16(int8x16_t w, const int16_t* x) {
  const int16x8_t w0 = vmovl_s8(vget_low_s8(w)), w1 = vmovl_high_s8(w), x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8);
  int32x4_t acc = vmull_s16(vget_low_s16(w0), vget_low_s16(x0));
  acc = vmlal_high_s16(acc, w0, x0);
  acc = vmlal_s16(acc, vget_low_s16(w1), vget_low_s16(x1));
  acc = vmlal_high_s16(acc, w1, x1);
  return vaddvq_s32(acc);
}

// A group's two halves' sums of (q - centre) * xq: s[0] inputs 0..15, s[1] 16..31
template <typename F>
inline void neon_group_sums(const uint8_t* v, const int16_t* xg, int32_t* s) {
  int8x16_t lo, hi;
  neon_centred<F>(v, lo, hi);
  s[0] = neon_dot16(lo, xg), s[1] = neon_dot16(hi, xg + 16);
}
#endif

// groups_term over all of a row's groups, its integer sums from NEON (the same sums, already centred: no
// centre * sum(q) term), then the same float steps in the same order
template <typename F>
float neon_groups_term(const Block<F>& b, const int16_t* x, const float* d, const float* xs0, const float* xs, int ng) {
  float sum = 0.f;
  for (int g = 0; g < ng; ++g) {
    int32_t s[2];
    neon_group_sums<F>(b.values(g), x + g * kG, s);
    if (!F::kHalf) s[0] += s[1];
    const float part_xs[2] = {F::kHalf ? xs0[g] : xs[g], xs[g] - xs0[g]};
    for (int p = 0; p < F::kParts; ++p) {
      const float scale = b.scalar(g, p, 0);
      sum += scale * d[g] * static_cast<float>(s[p]);
      if (F::kOff) sum += (F::kCentre * scale + b.scalar(g, p, 1)) * part_xs[p];
    }
  }
  return sum;
}

#if defined(__ARM_FEATURE_DOTPROD)
// With ARM's dot product (vdotq_s32 multiplies signed bytes only), each group's q is kept as two signed bytes, q =
// 256 * h + l as the AVX-512 path splits it (|q| <= kQMax: h = (q + 128) >> 8 stays <= 127, l in -128..127): the
// group's 64 bytes in Acts::q then hold its 32 h, then its 32 l, in place of its 32 int16 (nothing else reads them).
inline void split_bytes(std::vector<int16_t>& q) {
  for (size_t i = 0; i < q.size(); i += kG) {
    int8_t hl[2 * kG];
    for (int j = 0; j < kG; j += 8) {
      const int16x8_t v = vld1q_s16(q.data() + i + j);
      const int16x8_t h = vshrq_n_s16(vaddq_s16(v, vdupq_n_s16(128)), 8);
      vst1_s8(hl + j, vmovn_s16(h));
      vst1_s8(hl + kG + j, vmovn_s16(vsubq_s16(v, vshlq_n_s16(h, 8))));
    }
    std::memcpy(q.data() + i, hl, sizeof(hl));
  }
}
#endif

}  // namespace quant

// float32 / bfloat16 (stored as uint16_t) loads and stores shared by the CPU kernels; float16 loads.
#pragma once

#include <cstdint>
#include <cstring>

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bfloat16 -> float
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float load_half(uint16_t h) {  // float16 -> float, exactly (subnormals, infinities and NaNs too)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t u = sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// float -> float16, round to nearest even, as torch's .half() (overflow to infinity, subnormals; integer arithmetic
// only, so -ffast-math changes nothing)
inline uint16_t store_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u | (x > 0x7F800000u ? 0x200u : 0u));
  if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // 65520 and up round to infinity
  uint32_t h, rest, half;
  if (x < 0x38800000u) {  // below float16's smallest normal, 2^-14: a multiple of 2^-24
    if (x < 0x33000000u) return static_cast<uint16_t>(sign);
    const int shift = 126 - static_cast<int>(x >> 23);
    const uint32_t mant = (x & 0x7FFFFFu) | 0x800000u;
    h = mant >> shift, rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
  } else {
    h = (x - 0x38000000u) >> 13, rest = x & 0x1FFFu, half = 0x1000u;  // exponent rebased, 13 bits dropped
  }
  if (rest > half || (rest == half && (h & 1))) ++h;  // (a carry into the exponent is right)
  return static_cast<uint16_t>(sign | h);
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // float -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}

// x rounded to T's precision (what torch does after every elementwise op in T)
template <typename T>
inline float round_to(float x) {
  T t;
  store(&t, x);
  return load(t);
}

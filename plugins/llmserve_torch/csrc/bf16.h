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

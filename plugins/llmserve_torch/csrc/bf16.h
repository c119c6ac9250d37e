// float32 / bfloat16 (stored as uint16_t) loads and stores shared by the CPU kernels.
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

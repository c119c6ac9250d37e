// Sampling from softmax(x / t) in one pass over a row of float32 logits: the exponential race of sampling.py in
// log form. The token is the largest x_i / t + g_i, with g_i = -log(-log u_i) Gumbel noise, where u_i comes from a
// hash of a key and the vocabulary index alone: no generator state, so any share of a row is drawn by whoever
// computes it, and a key made from (seed, output index) draws the same noise whatever else is in the batch.
//
// A row is taken kRaceChunk entries at a time by one function (race_chunks, never inlined), the chunks always cut at
// the same places: every entry's score is made by the same instructions wherever it is computed (the sampler's
// llmserve_race_f32, or a member of the fused call's LM head), so both find the same token bit for bit, however the
// chunks are shared out. Masked entries (-inf, or anything at or below -1e30: a top-k/top-p/min-p filter, a
// constraint) never win: the library is built with -ffast-math, so they are tested for, not computed with.

#include <math.h>

#include <cstdint>

#include "kernels.h"

namespace {

inline uint32_t fmix32(uint32_t h) {  // MurmurHash3's finalizer: a bijection that mixes every bit into every bit
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

constexpr float kMasked = -1e30f;

// x_i / t + Gumbel noise of entry i: u in (0, 1) from the top 23 bits of a keyed hash of i, the middle of its bin
// (for one key the hash is a permutation of the indices). 23, not 24: the middle of the last of 2^24 bins,
// 1 - 2^-25, rounds to 1.0 in float32, whose noise -log(-log 1) is +inf. The noise lies in [-2.81, 16.64]
inline float score(float x, float t, uint32_t k0, uint32_t k1, uint32_t i) {
  const uint32_t h = fmix32(fmix32(i ^ k0) + k1);
  const float u = (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
  const float s = x / t - logf(-logf(u));
  return x > kMasked ? s : kMasked;
}

}  // namespace

__attribute__((noinline)) Best race_chunks(const float* x, int64_t n, int c0, int c1, float t, uint64_t key) {
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  Best best{kMasked, -1};
  alignas(64) float s[kRaceChunk];
  for (int c = c0; c < c1; ++c) {
    const int64_t b = static_cast<int64_t>(c) * kRaceChunk;
    const float* xb = x + b;
    const uint32_t ib = static_cast<uint32_t>(b);
    int m = kRaceChunk;
    if (n - b >= kRaceChunk) {  // a whole chunk: a loop of a fixed count, vectorized whole
#pragma omp simd
      for (int j = 0; j < kRaceChunk; ++j) s[j] = score(xb[j], t, k0, k1, ib + j);
    } else {  // the row's last, shorter chunk: always this loop
      m = static_cast<int>(n - b);
      for (int j = 0; j < m; ++j) s[j] = score(xb[j], t, k0, k1, ib + j);
    }
    const int at = first_max(s, m);
    if (s[at] > best.value) best = {s[at], b + at};
  }
  return best;
}

extern "C" {

// Each row's token drawn from softmax(x / temps[r]) with keys[r]'s noise (rows of `stride` floats, n logits each);
// a row where nothing wins (every entry masked, or NaN) gets 0, as torch's argmax over such a row gave
void llmserve_race_f32(const float* x, int rows, int n, int64_t stride, const float* temps, const uint64_t* keys,
                       int64_t* out, int threads) {
  const int chunks = race_chunk_count(n);
  if (rows >= threads || threads <= 1) {
#pragma omp parallel for num_threads(threads) if (rows > 1)
    for (int r = 0; r < rows; ++r) {
      const int64_t at = race_chunks(x + r * stride, n, 0, chunks, temps[r], keys[r]).at;
      out[r] = at < 0 ? 0 : at;
    }
    return;
  }
  // fewer rows than threads: each row's chunks shared out, the shares' bests taken in order (a later one wins
  // only with a larger score: the first largest, as one pass over the row finds it)
  for (int r = 0; r < rows; ++r) {
    const int th = threads < 64 ? threads : 64;
    Best part[64];
    for (int i = 0; i < th; ++i) part[i] = {kMasked, -1};  // (a member the region did not start)
    on_team(th, true, [&](const Team& tm) {
      part[tm.id] = race_chunks(x + r * stride, n, tm.begin(chunks), tm.end(chunks), temps[r], keys[r]);
    });
    Best b = part[0];
    for (int i = 1; i < th; ++i)
      if (part[i].value > b.value) b = part[i];
    out[r] = b.at < 0 ? 0 : b.at;
  }
}

}  // extern "C"

// Sampling on CPU from rows of float32 logits: top-k, top-p and min-p (filter_row), then softmax(x / t) drawn in one
// pass, the exponential race of sampling.py in log form. The token is the largest x_i / t + g_i, with
// g_i = -log(-log u_i) Gumbel noise, where u_i comes from a hash of a key and the vocabulary index alone: no
// generator state, so any share of a row is drawn by whoever computes it, and a key made from (seed, output index)
// draws the same noise whatever else is in the batch.
//
// A row is taken kRaceChunk entries at a time by one function (race_chunks, never inlined), the chunks always cut at
// the same places: every entry's score is made by the same instructions wherever it is computed (the sampler's
// llmserve_sample_f32, or a member of the fused call's LM head), so both find the same token bit for bit, however the
// chunks are shared out. Masked entries (-inf, or anything at or below -1e30: a top-k/top-p/min-p filter, a
// constraint) never win: the library is built with -ffast-math, so they are tested for, not computed with.

#include <math.h>

#include <algorithm>
#include <cstdint>
#include <vector>

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

namespace {

// A rank filter's candidates: every entry within `span` of the row's largest, ordered largest first (equal values
// by index), `span` doubled from kFirstSpan until they hold what the filter keeps
constexpr float kFirstSpan = 8.f;

}  // namespace

// y = x / t over the row (masked entries stay kMasked), then what top-k, top-p and min-p drop masked, as sampling.py's
// filter_logits keeps them: top-k keeps the k largest; top-p keeps of those the smallest prefix, largest first, whose
// probabilities (softmax over what top-k kept) reach top_p (a token drops where the tokens above it reach top_p
// already; the first always stays); min-p keeps what is at least min_p times the largest probability. y: n floats
void filter_row(const float* x, int64_t n, float t, int top_k, float top_p, float min_p, float* y,
                std::vector<int32_t>& cand) {
  float m = kMasked;
  for (int64_t i = 0; i < n; ++i) {
    y[i] = x[i] > kMasked ? x[i] / t : kMasked;
    m = y[i] > m ? y[i] : m;
  }
  const int64_t k = top_k > 0 && top_k < n ? top_k : n;
  if (k < n || top_p < 1.f) {
    float z_all = 0.f;  // where top-k keeps the whole row, top-p's shares are of all of it
    if (k == n)
      for (int64_t i = 0; i < n; ++i) z_all += y[i] > kMasked ? expf(y[i] - m) : 0.f;
    int64_t keep = 0;  // how many of the ordered candidates stay
    const auto before = [&](int32_t a, int32_t b) { return y[a] > y[b] || (y[a] == y[b] && a < b); };  // the order
    for (float span = kFirstSpan;; span *= 2.f) {
      const float floor = span > 1e6f ? kMasked : m - span;  // (past any real spread: every unmasked entry)
      cand.clear();
      for (int64_t i = 0; i < n; ++i)
        if (y[i] > kMasked && y[i] >= floor) cand.push_back(static_cast<int32_t>(i));
      const bool all = floor == kMasked;
      if (k < n && static_cast<int64_t>(cand.size()) < k && !all) continue;  // top-k's k are not all in yet
      // only as much order as the filters look at: top-k's kk largest (as a set; the kk-th in its place), then
      // top-p's prefix of them, sorted a growing part at a time
      const int64_t kk = std::min<int64_t>(k, cand.size());
      if (kk < static_cast<int64_t>(cand.size()))
        std::nth_element(cand.begin(), cand.begin() + kk - 1, cand.end(), before);
      keep = kk;
      if (top_p < 1.f) {
        float z = z_all;
        if (k < n) {
          z = 0.f;
          for (int64_t j = 0; j < kk; ++j) z += expf(y[cand[j]] - m);
        }
        float cum = 0.f;
        int64_t j = 0;
        for (int64_t sorted = 0, want = 64; keep == kk && sorted < kk; want *= 4) {
          const int64_t upto = std::min(want, kk);
          std::partial_sort(cand.begin() + sorted, cand.begin() + upto, cand.begin() + kk, before);
          for (sorted = upto; j < sorted; ++j) {
            if (j > 0 && cum >= top_p) {
              keep = j;
              break;
            }
            cum += expf(y[cand[j]] - m) / z;
          }
        }
        // top-p's cut inside the candidates, or every entry top-k keeps among them: exact; else widen
        if (keep == kk && kk < k && !all) continue;
      }
      break;
    }
    if (keep > 0) {  // the first `keep` in that order: all above the last of them, and its equals up to its index
      // (where every candidate stays they may be in no order: the last is the one that comes after all others)
      const int64_t last = keep == static_cast<int64_t>(cand.size())
                               ? *std::max_element(cand.begin(), cand.end(), before)
                               : cand[keep - 1];
      const float yc = y[last];
      const int64_t ic = last;
      for (int64_t i = 0; i < n; ++i)
        if (!(y[i] > yc || (y[i] == yc && i <= ic))) y[i] = kMasked;
    }
  }
  if (min_p > 0.f) {  // p_i >= min_p * p_max: y_i - m >= log(min_p) (the largest always stays)
    const float floor = m + logf(min_p);
    for (int64_t i = 0; i < n; ++i)
      if (y[i] < floor) y[i] = kMasked;
  }
}

namespace {

// Each row's token (row[r]: its n logits) drawn from softmax(row / temps[r]) with keys[r]'s noise; a row where
// nothing wins (every entry masked, or NaN) gets 0, as torch's argmax over such a row gave
void race_rows(const float* const* row, int rows, int n, const float* temps, const uint64_t* keys, int64_t* out,
               int threads) {
  const int chunks = race_chunk_count(n);
  if (rows >= threads || threads <= 1) {
#pragma omp parallel for num_threads(threads) if (rows > 1)
    for (int r = 0; r < rows; ++r) {
      const int64_t at = race_chunks(row[r], n, 0, chunks, temps[r], keys[r]).at;
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
      part[tm.id] = race_chunks(row[r], n, tm.begin(chunks), tm.end(chunks), temps[r], keys[r]);
    });
    Best b = part[0];
    for (int i = 1; i < th; ++i)
      if (part[i].value > b.value) b = part[i];
    out[r] = b.at < 0 ? 0 : b.at;
  }
}

}  // namespace

extern "C" {

// Each row's filter_row alone into y ([rows, n]; masked entries -1e30): what the sampler's filters keep (the tests
// hold it to sampling.py's filter_logits)
void llmserve_filter_f32(const float* x, int rows, int n, int64_t stride, const float* temps, const int32_t* top_k,
                         const float* top_p, const float* min_p, float* y) {
  std::vector<int32_t> cand;
  for (int r = 0; r < rows; ++r)
    filter_row(x + r * stride, n, temps[r], top_k[r], top_p[r], min_p[r], y + static_cast<int64_t>(r) * n, cand);
}

// Each row's token drawn from softmax over what top_k[r], top_p[r] and min_p[r] keep of x / temps[r] (filter_row)
// with keys[r]'s noise (rows of `stride` floats, n logits each; top_k 0: none, top_p 1: none, min_p 0: none). A row
// that filters nothing races its logits as they are, as the fused call's LM head races such rows: the same tokens
void llmserve_sample_f32(const float* x, int rows, int n, int64_t stride, const float* temps, const int32_t* top_k,
                         const float* top_p, const float* min_p, const uint64_t* keys, int64_t* out, int threads) {
  std::vector<const float*> row(rows);
  std::vector<float> t(temps, temps + rows);
  std::vector<int> filtered;  // the rows a filter applies to
  for (int r = 0; r < rows; ++r) {
    row[r] = x + r * stride;
    if (row_filters(top_k[r], top_p[r], min_p[r], n)) filtered.push_back(r);
  }
  thread_local std::vector<float> buf;  // the filtered rows' y (the calling thread's, shared by pointer); grown once
  const int nf = static_cast<int>(filtered.size());
  if (buf.size() < static_cast<size_t>(nf) * n) buf.resize(static_cast<size_t>(nf) * n);
  float* y = buf.data();
#pragma omp parallel for num_threads(threads) if (nf > 1)
  for (int j = 0; j < nf; ++j) {
    thread_local std::vector<int32_t> cand;
    const int r = filtered[j];
    filter_row(x + r * stride, n, temps[r], top_k[r], top_p[r], min_p[r], y + static_cast<int64_t>(j) * n, cand);
  }
  for (int j = 0; j < nf; ++j) row[filtered[j]] = y + static_cast<int64_t>(j) * n, t[filtered[j]] = 1.f;
  race_rows(row.data(), rows, n, t.data(), keys, out, threads);
}

}  // extern "C"

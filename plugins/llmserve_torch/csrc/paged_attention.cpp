// Paged attention for CPU over a flattened batch of query tokens (prefill chunks and decodes mixed).
//
// Each query token t belongs to request tok_req[t] and sits at position tok_pos[t]; it attends to
// positions 0..tok_pos[t] of its request, read in place from the paged cache through the request's
// block table (no gather into a temporary buffer). One online-softmax pass per (token, kv head);
// the query heads of a GQA group share each K/V row while it is in L1.
//
// Cache layout: [num_blocks, block_size, kv_heads, head_dim] for one layer (contiguous).
// Built with -O3 -march=native -ffast-math -fopenmp; plain C ABI, loaded with ctypes.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;
constexpr int kMaxBlock = 256;

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bfloat16 → float
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // float → bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}

template <typename T>
void paged_attention(const T* q, int64_t q_stride, const T* kc, const T* vc, const int32_t* block_tables,
                     int max_blocks, const int32_t* tok_req, const int32_t* tok_pos, T* out, int64_t out_stride,
                     int num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                     int num_threads) {
  const int G = num_heads / num_kv_heads;
  const int D = head_dim;
  const int64_t row = static_cast<int64_t>(num_kv_heads) * D;  // between consecutive tokens in a block
  const int64_t blk = row * block_size;                          // between blocks

#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
  for (int t = 0; t < num_tokens; ++t) {
    for (int g = 0; g < num_kv_heads; ++g) {
      alignas(64) float qf[kMaxGroup][kMaxHeadDim];
      alignas(64) float acc[kMaxGroup][kMaxHeadDim];
      alignas(64) float s[kMaxGroup][kMaxBlock];
      float m[kMaxGroup], l[kMaxGroup];
      for (int h = 0; h < G; ++h) {
        const T* qh = q + t * q_stride + static_cast<int64_t>(g * G + h) * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) {
          qf[h][d] = load(qh[d]) * scale;
          acc[h][d] = 0.f;
        }
        m[h] = -1e30f;  // finite: the code is built with -ffast-math
        l[h] = 0.f;
      }
      const int ctx = tok_pos[t] + 1;
      const int32_t* bt = block_tables + static_cast<int64_t>(tok_req[t]) * max_blocks;
      const int nb = (ctx + block_size - 1) / block_size;
      for (int b = 0; b < nb; ++b) {
        const int n = (b == nb - 1) ? ctx - b * block_size : block_size;
        const T* kb = kc + bt[b] * blk + g * D;
        const T* vb = vc + bt[b] * blk + g * D;
        for (int h = 0; h < G; ++h) {
          float mx = m[h];
          for (int j = 0; j < n; ++j) {
            const T* kj = kb + j * row;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; ++d) dot += qf[h][d] * load(kj[d]);
            s[h][j] = dot;
            mx = dot > mx ? dot : mx;
          }
          const float corr = std::exp(m[h] - mx);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int j = 0; j < n; ++j) {
            const float p = std::exp(s[h][j] - mx);
            s[h][j] = p;
            sum += p;
          }
          l[h] = l[h] * corr + sum;
          m[h] = mx;
#pragma omp simd
          for (int d = 0; d < D; ++d) acc[h][d] *= corr;
          for (int j = 0; j < n; ++j) {
            const T* vj = vb + j * row;
            const float p = s[h][j];
#pragma omp simd
            for (int d = 0; d < D; ++d) acc[h][d] += p * load(vj[d]);
          }
        }
      }
      for (int h = 0; h < G; ++h) {
        T* oh = out + t * out_stride + static_cast<int64_t>(g * G + h) * D;
        const float inv = 1.f / l[h];
        for (int d = 0; d < D; ++d) store(oh + d, acc[h][d] * inv);
      }
    }
  }
}

}  // namespace

extern "C" {

int llmserve_attn_limits(int* max_head_dim, int* max_group, int* max_block) {
  *max_head_dim = kMaxHeadDim;
  *max_group = kMaxGroup;
  *max_block = kMaxBlock;
  return 1;
}

#define LLMSERVE_ATTN_ENTRY(NAME, T)                                                                          \
  void NAME(const void* q, int64_t q_stride, const void* kc, const void* vc, const int32_t* block_tables,      \
            int max_blocks, const int32_t* tok_req, const int32_t* tok_pos, void* out, int64_t out_stride,     \
            int num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,       \
            int num_threads) {                                                                                 \
    paged_attention<T>(static_cast<const T*>(q), q_stride, static_cast<const T*>(kc),                          \
                       static_cast<const T*>(vc), block_tables, max_blocks, tok_req, tok_pos,                  \
                       static_cast<T*>(out), out_stride, num_tokens, num_heads, num_kv_heads, head_dim,        \
                       block_size, scale, num_threads);                                                        \
  }

LLMSERVE_ATTN_ENTRY(llmserve_paged_attention_f32, float)
LLMSERVE_ATTN_ENTRY(llmserve_paged_attention_bf16, uint16_t)

}  // extern "C"

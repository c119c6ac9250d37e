// Every layer of a Llama-style model with quantized linears, for one step of a few rows, in one call.
//
// At one sequence a SmolLM2 step is ~400 kernel calls: each a few microseconds of work behind a few
// microseconds of Python, ctypes and torch allocation. This runs the same kernels of this library in the
// same order on the same values (fused_stack.py builds the tables), so its results equal the Python
// path's bit for bit; only the dispatch between them is gone. Buffers are the caller's (with one or two rows, the
// residual stream and the elementwise stages' outputs are each member's own: Flow). The whole step is one
// parallel region: each thread runs the kernels' team forms (team.h), meeting the others at a barrier between
// stages, where each kernel call of the Python path opens and joins a region of its own.
//
// Per layer: h = rms(x) → qkv = h·Wqkv (+ bias) → RoPE on q, k → K/V stored, paged attention → o =
// attn·Wo → x += o, h = rms(x) → gate|up = h·Wgu → silu(gate)·up → down → x += down (into the next
// layer's norm). Linears: a group format (kernels.h's quant_format: values of 4-8 bits in groups of 32, our
// packing) or kInt8Rows (int8 per row, float32 out, rounded to the activations' dtype as torch's .to() does). The token ids' embedding rows are copied in first
// (Step::ids); where the caller asks, the final norm and a quantized LM head follow in the same region (Step::logits),
// then each row's greedy token (Step::tokens): the Python path's logits with QuantLinear's and lm_head's roundings,
// then the argmax of the sampler's fast path: at one sequence the torch calls and Python around those were a
// noticeable share of the step (docs/benchmarks.md, "A decode step against its bound").

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include <unistd.h>

#include "bf16.h"
#include "kernels.h"

namespace {

// The call's tables as llmserve.h declares them (the one statement of their layout: kernel_library.py reads it)
using QLinear = llmserve_qlinear;
using Layer = llmserve_layer;
using Model = llmserve_model;
using Scratch = llmserve_scratch;
using Step = llmserve_step;

// How two members share the weights' matmuls out. Where a VM's two CPUs sit far apart, one of them can stream
// its half markedly slower than the other for minutes at a time (each member's own time in the matmuls, timed
// inside them), and the other waits at every barrier; so the first member's share
// follows the two measured rates, a step behind. Every output is made by one member the same way whoever makes
// it: only who waits changes. Each member's time is on a cache line of its own.
struct alignas(64) MemberTime {
  double us;  // this member's microseconds in the matmuls since the lead last read them
  char pad[64 - sizeof(double)];
};
struct Balance {
  alignas(64) double lead_share;  // 0 before the first step: equal shares
  MemberTime busy[2];
};
static_assert(sizeof(Balance) == LLMSERVE_BALANCE_BYTES, "llmserve.h states the Balance a caller allocates");

// The caller's balance state (Model::balance: opaque to it)
inline Balance* balance_of(const Model& m) { return static_cast<Balance*>(m.balance); }

// What a step's time is split into when the caller asks (Step::stage_us), in this order
enum Stage { kQkv, kRopeKv, kAttention, kO, kNorms, kGateUp, kSiluMul, kDown, kHead, kStages };

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Adds the time since the last mark to a stage; does nothing unless asked (a clock read per kernel otherwise)
class Clock {
 public:
  explicit Clock(double* sums) : sums_(sums), last_(sums ? now_us() : 0.0) {}
  void mark(Stage s) {
    if (sums_ == nullptr) return;
    const double t = now_us();
    sums_[s] += t - last_;
    last_ = t;
  }

 private:
  double* sums_;
  double last_;
};

// The matmuls' team for this step, sharing them out at the lead's share; made by every member after the step's
// first barrier, which orders the lead's rebalance before the others read the share
Team matmul_team(const Team& tm, Balance* b) {
  if (b == nullptr || tm.size != 2) return tm;
  return tm.shared(b->lead_share > 0.0 ? static_cast<float>(b->lead_share) : 0.5f);
}

// The lead (before the step's first barrier) moves its share a quarter of the way to where both members would
// finish together at the rates of their busy times since it last looked, within [0.2, 0.8], and clears the times
void rebalance(const Team& tm, Balance* b) {
  if (b == nullptr || tm.size != 2 || !tm.lead()) return;
  const double t0 = b->busy[0].us, t1 = b->busy[1].us, s0 = b->lead_share > 0.0 ? b->lead_share : 0.5;
  if (t0 > 0.0 && t1 > 0.0) {
    const double r0 = s0 / t0, r1 = (1.0 - s0) / t1;  // each member's share a microsecond
    const double want = r0 / (r0 + r1);
    b->lead_share = std::min(0.8, std::max(0.2, s0 + 0.25 * (want - s0)));
  } else {
    b->lead_share = s0;
  }
  b->busy[0].us = b->busy[1].us = 0.0;  // (the other member adds to its line only after the step's first barrier)
}

// Adds the time of what it wraps to this member's busy time (where a Balance is kept)
class Busy {
 public:
  Busy(const Team& tm, Balance* b) : slot_(b != nullptr && tm.size == 2 ? &b->busy[tm.id].us : nullptr),
                                     t0_(slot_ ? now_us() : 0.0) {}
  ~Busy() {
    if (slot_ != nullptr) *slot_ += now_us() - t0_;
  }

 private:
  double* slot_;
  double t0_;
};

// This member's share of y = x · W^T (+ bias). The int8 kernel's float32 outputs are rounded by the member that
// made them (the same share of N), so only the bias waits for the whole matmul. The matmul's time is this member's
// busy time (Balance).
template <typename T>
void linear(const Team& tm, const QLinear& L, const void* x, int rows, void* y, float* f32, Balance* bal,
            int narrow) {
  const int elem = sizeof(T);
  T* yt = static_cast<T*>(y);
  if (is_group_format(L.kind)) {
    const Busy busy(tm, bal);
    team_quant_matmul(tm, L.kind, x, L.k, rows, static_cast<const uint8_t*>(L.w), y, L.n, L.n, L.k, elem, elem,
                      narrow);
  } else {  // float32 out, then the activations' dtype (torch: y.to(x.dtype))
    const Busy busy(tm, bal);
    team_int8_matmul(tm, x, L.k, rows, static_cast<const int8_t*>(L.w), L.scale, f32, L.n, L.n, L.k, elem);
    const int64_t j0 = tm.share_begin(L.n), j1 = tm.share_end(L.n);  // the matmul's share
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = j0; j < j1; ++j) store(yt + r * L.n + j, f32[r * L.n + j]);
  }
  if (L.bias != nullptr) {  // y += bias, rounded as the in-place torch add rounds
    tm.sync();
    const T* b = static_cast<const T*>(L.bias);
    for (int r = 0; r < rows; ++r)
      for (int j = tm.begin(L.n); j < tm.end(L.n); ++j)
        store(yt + static_cast<int64_t>(r) * L.n + j, load(yt[r * L.n + j]) + load(b[j]));
  }
}

// The first bytes of this member's share of L's weights (at most m.wait_ahead), asked for while it waits at the
// barriers before L (WaitAhead). A wait at a barrier is the other member's lag plus the handoff, which is several
// times longer where the VM's two CPUs sit far apart: there this pays most
void wait_ahead_for(const Team& mt, const Model& m, const QLinear& L) {
  WaitAhead& a = wait_ahead();
  if (m.wait_ahead == 0 || L.kind == 0) {
    a.at = a.end = nullptr;
    return;
  }
  int64_t first, last, unit;  // this member's items and each one's bytes
  if (is_group_format(L.kind)) {
    const int tiles = quant_tiles(L.n);
    first = mt.share_begin(tiles), last = mt.share_end(tiles), unit = quant_tile_bytes(L.kind, L.k);
  } else {
    first = mt.share_begin(L.n), last = mt.share_end(L.n), unit = L.k;
  }
  const char* w = static_cast<const char*>(L.w);
  a.at = w + first * unit;
  a.end = w + std::min(last * unit, first * unit + m.wait_ahead);
}

// With this many rows or fewer, each member keeps its own copy of the residual stream (Flow)
constexpr int kOwnRows = 2;

// Where the elementwise stages' outputs live. With many rows the stages are shared out and the members meet after
// each. With a few rows each member keeps its own copy of the residual stream and makes the norms', SiLU·up's, RoPE's
// (own_rope_and_kv) and (one token's keys shared out) the attention merge's whole outputs itself: the same arithmetic
// on the same values, so the same results, and the next matmul reads this member's copy. A barrier a stage goes (five
// a layer are left at one sequence, six with q|k|v biases), and the wait while one member did a row alone. That
// pays where the VM's two CPUs are far apart (each barrier is then several times dearer) and costs nothing where
// they are near; at four rows the repeated work loses, hence kOwnRows (docs/backend-torch.md, "Quantized weights").
template <typename T>
struct Flow {
  Team ew;        // the team the elementwise stages run on: tm, or this member alone
  T* x;           // the residual stream: the caller's, or this member's copy
  void* h;        // the norms' output, the next matmul's input
  void* act;      // SiLU·up's output, the down matmul's input
  void* attn;     // the attention's output, the o matmul's input
  T* qk;          // with own copies: every row's roped q|k, this member's ([rows, q + kv]: own_rope_and_kv)
  bool own;       // each member its own copies
  bool own_attn;  // and, where the attention shares one token's keys out, its own merge of every head

  Flow(const Team& tm, const Scratch& s, const Step& st, const Model& m)
      : ew(tm), x(static_cast<T*>(st.x)), h(s.h), act(s.act), attn(s.attn), qk(nullptr),
        own(tm.size > 1 && st.rows <= kOwnRows), own_attn(own && token_splits(st.rows, tm.size) > 1) {
    if (!own) return;
    thread_local std::vector<T> buf;  // this member's; grown once
    const int64_t xn = static_cast<int64_t>(st.rows) * m.hidden, an = static_cast<int64_t>(st.rows) * m.inter;
    const int64_t qn = static_cast<int64_t>(st.rows) * m.heads * m.head_dim;
    const int64_t kn = static_cast<int64_t>(st.rows) * (m.heads + m.kv_heads) * m.head_dim;
    if (buf.size() < static_cast<size_t>(2 * xn + an + qn + kn)) buf.resize(2 * xn + an + qn + kn);
    std::memcpy(buf.data(), st.x, xn * sizeof(T));
    ew = Team{0, 1, nullptr};
    x = buf.data(), h = buf.data() + xn, act = buf.data() + 2 * xn;
    if (own_attn) attn = buf.data() + 2 * xn + an;
    qk = buf.data() + 2 * xn + an + qn;
  }
  // After an elementwise stage: the members meet where they share its output
  void sync(const Team& tm) const {
    if (!own) tm.sync();
  }
};

// The final norm, the quantized LM head (float32 out, rounded through T as QuantLinear's y.to(x.dtype) does before
// lm_head's .float()), and where asked each row's token: a greedy row's first largest logit within each member's
// share of the vocabulary, a sampled row's race (Step::temps) over each member's share of its chunks once every
// logit is made (a row that filters, Step::filters, once one member has filtered it); then over the members in
// order (a later share wins only with a larger value: the first maximum, as llmserve_argmax_f32 and
// llmserve_sample_f32 find it). best: [members, rows]; mt: the matmuls' team
template <typename T>
void head(const Team& tm, const Team& mt, const Model& m, const Flow<T>& f, const Step& st, Best* best) {
  const int R = st.rows, H = m.hidden, V = m.head.n;
  team_add_rms_norm(f.ew, f.x, H, nullptr, 0, m.final_norm, f.h, H, R, H, m.eps, sizeof(T));
  f.sync(tm);
  int j0, j1;  // this member's logits: the matmul's share of them
  {
    const Busy busy(mt, balance_of(m));
    if (is_group_format(m.head.kind)) {
      team_quant_matmul(mt, m.head.kind, f.h, H, R, static_cast<const uint8_t*>(m.head.w), st.logits, V, V, H,
                        sizeof(T), 4, st.narrow);
      const int tiles = quant_tiles(V);
      j0 = std::min(V, mt.share_begin(tiles) * quant_tile()), j1 = std::min(V, mt.share_end(tiles) * quant_tile());
    } else {
      team_int8_matmul(mt, f.h, H, R, static_cast<const int8_t*>(m.head.w), m.head.scale, st.logits, V, V, H,
                       sizeof(T));
      j0 = mt.share_begin(V), j1 = mt.share_end(V);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = st.logits + static_cast<int64_t>(r) * V;
    for (int j = j0; j < j1; ++j) y[j] = round_to<T>(y[j]);
    if (st.tokens == nullptr || (st.temps != nullptr && st.temps[r] > 0.f)) continue;
    const int at = j0 + first_max(y + j0, j1 - j0);
    best[mt.id * R + r] = j0 < j1 ? Best{y[at], at} : Best{0.f, -1};
  }
  if (st.tokens == nullptr) return;
  if (st.temps != nullptr) {  // the sampled rows, once every member's logits are made
    tm.sync();
    // a filtered row's x / t with what its filters drop masked, by one member (rows dealt out in turn; each is one
    // pass and a partial sort of the few largest), then raced at t = 1 as llmserve_sample_f32 does
    const auto is_filtered = [&](int r) {
      return st.filters != nullptr && st.temps[r] > 0.f &&
             row_filters(static_cast<int>(st.filters[r]), st.filters[R + r], st.filters[2 * R + r], V);
    };
    if (st.filters != nullptr) {
      thread_local std::vector<int32_t> cand;
      for (int r = tm.id; r < R; r += tm.size)
        if (is_filtered(r))
          filter_row(st.logits + static_cast<int64_t>(r) * V, V, st.temps[r], static_cast<int>(st.filters[r]),
                     st.filters[R + r], st.filters[2 * R + r], st.filtered + static_cast<int64_t>(r) * V, cand);
      tm.sync();
    }
    const int chunks = race_chunk_count(V);
    for (int r = 0; r < R; ++r)
      if (st.temps[r] > 0.f) {
        const bool f = is_filtered(r);
        best[tm.id * R + r] = race_chunks((f ? st.filtered : st.logits) + static_cast<int64_t>(r) * V, V,
                                          tm.begin(chunks), tm.end(chunks), f ? 1.f : st.temps[r], st.keys[r]);
      }
  }
  tm.sync();
  if (!tm.lead()) return;
  for (int r = 0; r < R; ++r) {
    Best b = best[r];
    for (int id = 1; id < tm.size; ++id) {
      const Best& e = best[id * R + r];
      if (e.at >= 0 && (b.at < 0 || e.value > b.value)) b = e;
    }
    st.tokens[r] = b.at < 0 ? 0 : b.at;  // (no logit won: NaNs; torch's argmax over them gives 0 too)
  }
}

// With each member's own copies (Flow: a row or two) RoPE and the K/V store meet no one: each member ropes every
// row's q|k heads itself, in its own copy (the same arithmetic on the same values, so the same results), and stores
// the K and V of the rows whose newest key its own share of the attention reads, so the members meet neither before
// the store nor before the attention: two barriers a layer fewer. (Not where the rows are two tokens of one
// sequence, a prompt's chunk: the second reads the first's key too, so the members meet after the store there.)
// It pays where the VM's CPUs sit far apart (docs/backend-torch.md, "Quantized weights").
template <typename T>
void own_rope_and_kv(const Team& tm, const Model& m, const Layer& L, const Step& st, const void* qkv, T* qk) {
  const int R = st.rows, q = m.heads * m.head_dim, kv = m.kv_heads * m.head_dim;
  const int64_t qkv_w = q + 2 * kv, qk_w = q + kv;
  const T* in = static_cast<const T*>(qkv);
  const Team alone{0, 1, nullptr};
  for (int r = 0; r < R; ++r) std::memcpy(qk + r * qk_w, in + r * qkv_w, qk_w * sizeof(T));
  team_rope(alone, qk, qk_w, R, m.heads + m.kv_heads, m.head_dim, st.cos, st.sin, st.tok_pos, sizeof(T));
  for (int r = 0; r < R; ++r)
    if (newest_key_member(r, R, tm.size) == tm.id)
      team_write_kv(alone, qk + r * qk_w + q, qk_w, in + r * qkv_w + q + kv, qkv_w, L.k_cache, L.v_cache,
                    st.slots + r, 1, kv, sizeof(T));
}

// One member's part of the step; members meet (tm.sync) wherever a kernel reads what the one before wrote
template <typename T>
void run(const Team& tm, const Model& m, const Scratch& s, const Step& st, float* part, Best* best) {
  const int R = st.rows, E = sizeof(T), H = m.hidden;
  const int q = m.heads * m.head_dim, kv = m.kv_heads * m.head_dim, qkv_w = q + 2 * kv;
  rebalance(tm, balance_of(m));  // before the step's first barrier: the others read the share after it
  // x = the ids' embedding rows (llmserve_decode_layers checked them): copied, or dequantized from the head's weight
  if (m.embed_format)
    team_quant_rows(tm, m.embed_format, static_cast<const uint8_t*>(m.embed), H, st.ids, R, st.x, H, E);
  else
    for (int r = tm.begin(R); r < tm.end(R); ++r)
      std::memcpy(static_cast<char*>(st.x) + static_cast<int64_t>(r) * H * E,
                  static_cast<const char*>(m.embed) + st.ids[r] * H * E, static_cast<size_t>(H) * E);
  tm.sync();
  const Team mt = matmul_team(tm, balance_of(m));
  Flow<T> f(tm, s, st, m);
  Clock clock(tm.lead() ? st.stage_us : nullptr);  // the lead's clock: its stage times include its waits
  team_add_rms_norm(f.ew, f.x, H, nullptr, 0, m.layer[0].in_norm, f.h, H, R, H, m.eps, E);
  f.sync(tm);
  clock.mark(kNorms);
  for (int li = 0; li < m.layers; ++li) {
    const Layer& L = m.layer[li];
    linear<T>(mt, L.qkv, f.h, R, s.qkv, s.f32, balance_of(m), st.narrow);
    wait_ahead_for(mt, m, L.o);
    tm.sync();
    clock.mark(kQkv);
    const void* qs = s.qkv;  // the attention's queries, and their row stride
    int64_t q_stride = qkv_w;
    if (f.own) {  // no barrier: own_rope_and_kv (but two rows of one sequence read each other's keys)
      own_rope_and_kv<T>(tm, m, L, st, s.qkv, f.qk);
      static_assert(kOwnRows <= 2, "with more rows, any two of one sequence read each other's keys");
      if (R > 1 && st.tok_req[0] == st.tok_req[1]) tm.sync();
      qs = f.qk, q_stride = q + kv;
    } else {
      team_rope(tm, s.qkv, qkv_w, R, m.heads + m.kv_heads, m.head_dim, st.cos, st.sin, st.tok_pos, E);
      tm.sync();  // K roped before it is stored
      T* k = static_cast<T*>(s.qkv) + q;
      team_write_kv(tm, k, qkv_w, k + kv, qkv_w, L.k_cache, L.v_cache, st.slots, R, kv, E);
      tm.sync();
    }
    clock.mark(kRopeKv);
    team_paged_attention(tm, qs, q_stride, L.k_cache, L.v_cache, st.block_tables, st.max_blocks, st.tok_req,
                         st.tok_pos, f.attn, q, R, m.heads, m.kv_heads, m.head_dim, m.block_size, m.attn_scale, part, E,
                         f.own_attn);
    if (!f.own_attn) tm.sync();
    clock.mark(kAttention);
    linear<T>(mt, L.o, f.attn, R, s.o, s.f32, balance_of(m), st.narrow);
    wait_ahead_for(mt, m, L.gate_up);
    tm.sync();
    clock.mark(kO);
    team_add_rms_norm(f.ew, f.x, H, s.o, H, L.post_norm, f.h, H, R, H, m.eps, E);
    f.sync(tm);
    clock.mark(kNorms);
    linear<T>(mt, L.gate_up, f.h, R, s.gu, s.f32, balance_of(m), st.narrow);
    wait_ahead_for(mt, m, L.down);
    tm.sync();
    clock.mark(kGateUp);
    team_silu_mul(f.ew, s.gu, 2 * m.inter, f.act, m.inter, R, m.inter, E);
    f.sync(tm);
    clock.mark(kSiluMul);
    linear<T>(mt, L.down, f.act, R, s.down, s.f32, balance_of(m), st.narrow);
    wait_ahead_for(mt, m, li + 1 < m.layers ? m.layer[li + 1].qkv : st.logits != nullptr ? m.head : QLinear{});
    tm.sync();
    clock.mark(kDown);
    if (li + 1 < m.layers) {
      team_add_rms_norm(f.ew, f.x, H, s.down, H, m.layer[li + 1].in_norm, f.h, H, R, H, m.eps, E);
    } else {  // x += down
      const T* d = static_cast<const T*>(s.down);
      for (int64_t i = f.ew.begin(R * H); i < f.ew.end(R * H); ++i) store(f.x + i, load(f.x[i]) + load(d[i]));
      if (f.own && tm.lead()) std::memcpy(st.x, f.x, static_cast<size_t>(R) * H * sizeof(T));
    }
    f.sync(tm);
    clock.mark(kNorms);
  }
  if (st.logits != nullptr) head<T>(tm, mt, m, f, st, best);
  wait_ahead() = WaitAhead{};
  clock.mark(kHead);
}

// Step `f` of a batch of decodes moved on to the next forward: its ids the forward before's tokens, each row a
// position further on and its K/V slot there (row r is request r: one token each)
void next_forward(Step& f, const Model& m, std::vector<int64_t>& slots, std::vector<int32_t>& pos) {
  slots.resize(f.rows), pos.resize(f.rows);
  for (int r = 0; r < f.rows; ++r) {
    const int p = f.tok_pos[r] + 1;
    pos[r] = p;
    slots[r] = static_cast<int64_t>(f.block_tables[static_cast<int64_t>(r) * f.max_blocks + p / m.block_size]) *
                   m.block_size + p % m.block_size;
  }
  f.ids = f.tokens;
  f.tokens += f.rows;
  if (f.keys != nullptr) f.keys += f.rows;
  f.slots = slots.data(), f.tok_pos = pos.data();
}

// Where the caller asks (Step::progress): the forwards whose tokens are written so far, and a byte on
// Step::notify_fd to wake whoever hands them on (the lead, once its tokens of a forward are written)
void tell_progress(const Step& st, int done) {
  if (st.progress == nullptr) return;
  __atomic_store_n(st.progress, done, __ATOMIC_RELEASE);
  if (st.notify_fd >= 0) {
    const char b = 0;
    const ssize_t n = write(st.notify_fd, &b, 1);  // non-blocking: a full pipe already holds a wake-up
    (void)n;
  }
}

}  // namespace

extern "C" {

// 0, or -1 (nothing run) where an id is not a row of the embedding, as torch's embedding raises then. Later forwards'
// ids are the head's argmax: the caller runs more than one only where the head's rows are the embedding's
int llmserve_decode_layers(const llmserve_model* m, const llmserve_scratch* s, const llmserve_step* st) {
  for (int r = 0; r < st->rows; ++r)
    if (st->ids[r] < 0 || st->ids[r] >= m->vocab) return -1;
  float* part = attention_part(st->rows, m->heads, m->head_dim, st->threads);
  // each member's best logits: the calling thread's, shared with its region's members by pointer (a thread_local
  // named inside the region would be each member's own); grown once
  thread_local std::vector<Best> best_of;
  const size_t n_best = static_cast<size_t>(st->threads) * st->rows;
  if (best_of.size() < n_best) best_of.resize(n_best);
  Best* best = best_of.data();
  on_team(st->threads, true, [&](const Team& tm) {
    Step f = *st;
    thread_local std::vector<int64_t> slots;  // each member's positions and slots of the forward after the first
    thread_local std::vector<int32_t> pos;
    for (int i = 0; i < st->forwards; ++i) {
      if (i > 0) {  // the lead wrote the tokens of the forward before: this forward's ids
        next_forward(f, *m, slots, pos);
        tm.sync();
      }
      if (m->elem_size == 4)
        run<float>(tm, *m, *s, f, part, best);
      else
        run<uint16_t>(tm, *m, *s, f, part, best);
      if (tm.lead()) tell_progress(*st, i + 1);
    }
  });
  return 0;
}

}  // extern "C"

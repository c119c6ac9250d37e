// The threads of one OpenMP parallel region sharing a kernel's work: each member takes a fixed share, and
// members meet at a spin barrier where one stage needs another's results.
//
// Every kernel of this library has a team form (each member does its share, no parallel region of its own), so
// the fused decode step (decode_layers.cpp) runs all its layers in one parallel region: a libgomp fork/join costs
// several times this barrier, and a step made ~150 of them (docs/benchmarks.md, "The kernels' choices"). The C
// entry points run the same team forms on a region of their own (on_team).
#pragma once

// Without OpenMP (Apple clang has none) on_team runs every call on the calling thread: a team of one member
#ifdef _OPENMP
#include <omp.h>
#else
#include <thread>
#endif
#include <sched.h>

#include <atomic>
#include <cstdint>

// Lines a member asks for while it waits at a barrier, [at, end): the fused call points it at the first bytes of
// this member's share of the next matmul's weights (decode_layers.cpp), so a wait fetches what comes next instead
// of spinning idle; empty elsewhere
struct WaitAhead {
  const char* at = nullptr;
  const char* end = nullptr;
};
inline WaitAhead& wait_ahead() {
  static thread_local WaitAhead w;
  return w;
}

class SpinBarrier {
 public:
  // Returns when `members` threads have called it (every member passes the same count)
  void wait(int members) {
    const int phase = phase_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == members - 1) {
      count_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    // spin, then yield: a member the OS took off its core must not be starved by the one waiting for it. With more
    // members than CPUs someone is always off its core: yield at once (spinning there ran several times slower than
    // libgomp's own regions). 1024 pauses are a few microseconds: more ran no faster and held a core longer from the
    // process's other threads, the server's event loop among them
    const int spin = members > cpus() ? 0 : 1024;
    WaitAhead& ahead = wait_ahead();
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (ahead.at < ahead.end) {  // four lines a turn: one a turn fetched too little while the other member lagged
        for (int i = 0; i < 4 * 64; i += 64) __builtin_prefetch(ahead.at + i, 0, 3);  // prefetcht0, built on ARM too
        ahead.at += 4 * 64;
      } else if (spins < spin) {
        pause();
      } else {
        sched_yield();
      }
    }
  }

 private:
  static int cpus() {  // the CPUs this process may run on (libgomp reads the affinity mask)
#ifdef _OPENMP
    static const int n = omp_get_num_procs();
#else
    static const int n = static_cast<int>(std::thread::hardware_concurrency());
#endif
    return n;
  }
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> phase_{0};
};

struct Team {
  int id, size;
  SpinBarrier* barrier;  // null when the team has one member
  float lead_share = 0.f;  // with two members: the first's share of a matmul's outputs (shared); 0: equal shares

  void sync() const {
    if (size > 1) barrier->wait(size);
  }
  // This member's share [begin, end) of n items: contiguous, in member order
  int begin(int n) const { return static_cast<int>(static_cast<int64_t>(n) * id / size); }
  int end(int n) const { return static_cast<int>(static_cast<int64_t>(n) * (id + 1) / size); }
  bool lead() const { return id == 0; }
  // This member's share of a matmul's n outputs (the weights it streams): begin/end's, or in a team shared() out,
  // the first of two members takes lead_share of them. The matmuls read these once, into locals: a bound with a
  // branch in a loop's condition (every stage's, when begin/end carried it) is not hoisted past the loop's stores,
  // which slowed the fused call measurably
  int share_begin(int n) const { return lead_share > 0.f ? (id == 0 ? 0 : lead_cut(n)) : begin(n); }
  int share_end(int n) const { return lead_share > 0.f ? (id == 0 ? lead_cut(n) : n) : end(n); }
  // This team with the first of two members taking `share` of a matmul's outputs (more members: equal shares)
  Team shared(float share) const {
    Team t = *this;
    t.lead_share = size == 2 ? share : 0.f;
    return t;
  }

 private:
  int lead_cut(int n) const { return static_cast<int>(static_cast<double>(n) * lead_share + 0.5); }
};

// fn(team) on `threads` threads of one parallel region; on the calling thread alone when `parallel` is false
template <typename F>
void on_team(int threads, bool parallel, F&& fn) {
  if (threads <= 1 || !parallel) {
    fn(Team{0, 1, nullptr});
    return;
  }
#ifdef _OPENMP
  SpinBarrier barrier;
#pragma omp parallel num_threads(threads)
  fn(Team{omp_get_thread_num(), omp_get_num_threads(), &barrier});
#else
  fn(Team{0, 1, nullptr});
#endif
}

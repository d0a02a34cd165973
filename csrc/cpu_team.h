// One parallel region for a whole multi-stage call (csrc/layers_cpu.h: every layer of a forward): its
// threads, the *workers*, each run their static share of every stage and meet at a spin barrier between stages.
//
// Why: a forward of the default models is ~5 stages per layer (4 matmuls, attention), each of which was its own
// at::parallel_for: handing the second thread its half costs a region about 3x an OpenMP barrier and 20x this
// spinning barrier (2 threads, AMD EPYC Zen 3; bench/RESULTS-log.md), times 11 regions per draft forward and 41 per
// target forward, plus the waits of each region's master on a slower worker.
//
// Shares are static and depend only on the item count and the number of workers, never on timing: which thread
// computes an item changes no value (every caller splits work whose result does not depend on the split).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>

#include "cpu_simd.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace specdec {

// A reusable barrier for a fixed set of threads that spin (then yield: a descheduled peer on a loaded machine must
// not cost a whole time slice per stage). Generation-counted: the last thread to arrive resets the count, then
// publishes the next generation; the others leave once they see it.
class SpinBarrier {
 public:
  void wait(int64_t num_threads) {
    if (num_threads <= 1) return;
    const int64_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == num_threads - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < kSpins) {
        pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int64_t kSpins = 1 << 14;  // ~0.3 ms of pauses: far longer than any stage of one forward
  static void pause() {
#if SPECDEC_CPU_X86
    _mm_pause();
#endif
  }
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
};

// One thread's view of the team: its index, the team's size, its shares and the barrier.
class Worker {
 public:
  Worker(int64_t id, int64_t size, SpinBarrier* barrier) : id_(id), size_(size), barrier_(barrier) {}

  int64_t id() const { return id_; }
  int64_t size() const { return size_; }

  // This worker's contiguous share [begin, end) of `count` items: the first count % size workers take one more.
  std::pair<int64_t, int64_t> share(int64_t count) const {
    const int64_t per = count / size_, extra = count % size_;
    const int64_t begin = id_ * per + std::min(id_, extra);
    return {begin, begin + per + (id_ < extra ? 1 : 0)};
  }

  // Every worker's writes before the call are visible to every worker after it.
  void sync() const { barrier_->wait(size_); }

 private:
  int64_t id_, size_;
  SpinBarrier* barrier_;
};

// The number of workers run_team starts from this thread: at::get_num_threads(), or one (the caller) inside another
// parallel region or without OpenMP. An upper bound: OpenMP may start fewer, and Worker::size() says how many.
inline int64_t team_size() {
#ifdef _OPENMP
  if (!at::in_parallel_region()) return std::max<int64_t>(at::get_num_threads(), 1);
#endif
  return 1;
}

// Runs f(const Worker&) on every thread of one parallel region (team_size() of them). f must not throw: an
// exception cannot leave an OpenMP region, and a worker that left early would strand the others at the barrier. So
// callers check and allocate first.
template <typename F>
void run_team(F&& f) {
  SpinBarrier barrier;
#ifdef _OPENMP
  if (team_size() > 1) {
#pragma omp parallel
    {
      const Worker w(omp_get_thread_num(), omp_get_num_threads(), &barrier);
      f(w);
    }
    return;
  }
#endif
  f(Worker(0, 1, &barrier));
}

}  // namespace specdec

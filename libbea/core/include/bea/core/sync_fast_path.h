// The estimate's fast path for sync scheduling: decoding requests are advanced as one group.
//
// In a sync step every plain decode gets exactly one token whenever the running requests' total
// demand fits the budget and their new blocks fit the free pool — then list order cannot matter.
// Such decoders are kept "lazy": C and O are derived from a shared step counter D, their block
// allocations are counted per residue of D modulo the block size, and their finishes sit in a
// min-heap. A step then costs O(prefilling requests + admissions + events) instead of O(running).
// When a step's demand does not fit (budget or KV pressure: order matters, preemption may
// happen) every request is materialised and the exact Scheduler takes the step.
#pragma once

#include <cstdint>
#include <vector>

#include "bea/core/batch_time.h"
#include "bea/core/scheduler.h"

namespace bea {

class SyncFastPath {
 public:
  enum class Result { Continue, WatchSampled, Unschedulable };

  explicit SyncFastPath(Scheduler& s);
  // One engine step (or a folded stretch of decode-only steps); `steps` gets how many.
  Result step(double& now, const Coeffs& beta, int32_t watch, int64_t max_steps, int64_t& steps);
  void materialize_all();
  int64_t last_tokens() const { return last_tokens_; }  // tokens of the last single step

 private:
  struct Lazy {
    int64_t cbase, obase, blocks0, excl0, finish_d;
    int32_t bucket;
  };
  bool eligible(int32_t k, int32_t watch) const;
  void lazify(int32_t k, bool push = true);
  void materialize(int32_t k);
  void finish_lazy(int32_t k);
  int64_t demand_over(int64_t k) const;  // lazy block allocations in steps [D, D+k)
  void rebuild(int32_t watch);
  Result exact_step(double& now, const Coeffs& beta, int32_t watch, int64_t& steps);
  bool try_fold(double& now, const Coeffs& beta, int64_t max_steps, int64_t& steps);
  bool finishes_later(int32_t a, int32_t b) const;  // heap order: earliest finish on top
  void heap_push(int32_t k);
  void heap_pop();

  Scheduler& s_;
  int64_t B_;
  int64_t D_ = 0;
  std::vector<Lazy> lz_;            // per request (valid when is_lazy_)
  std::vector<uint8_t> is_lazy_;
  std::vector<int64_t> bucket_;     // lazy decoders per residue of D mod B
  std::vector<int32_t> eager_;      // running requests handled one by one, in running order
  std::vector<int32_t> heap_;       // lazy requests, min-heap on finish_d
  int64_t n_lazy_ = 0;
  int64_t sum_cbase_ = 0;
  int64_t cooldown_ = 0;            // exact steps to take before trying to lazify again
  std::vector<Scheduler::Item> batch_;
  int64_t last_tokens_ = 0;
};

}  // namespace bea

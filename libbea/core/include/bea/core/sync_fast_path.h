// The estimate's fast path for sync scheduling: decoding requests are advanced as one group.
//
// In a sync step every plain decode gets exactly one token whenever the running requests' total
// demand fits the budget and their new blocks fit the free pool — then list order cannot matter.
// Such decoders are kept "lazy": their scheduler records are frozen at the step D0 they joined,
// their C and O are derived from a shared step counter D (C = C0 + D − D0), their block
// allocations are counted per residue of D modulo the block size, and their finishes wait in a
// queue ordered by step. A step then costs O(prefilling requests + admissions + events) instead
// of O(running). When a step's demand does not fit (budget or KV pressure: order matters,
// preemption may happen) every request is materialised and the exact Scheduler takes the step.
// docs/libbea.md ("Speed") says why each shortcut is exact.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "bea/core/batch_time.h"
#include "bea/core/finish_queue.h"
#include "bea/core/kv_cache.h"
#include "bea/core/request.h"
#include "bea/core/scheduler.h"
#include "bea/core/snapshot.h"

namespace bea {

// The decode group a snapshot's residents start with, computed once per snapshot (Prepared) so
// that an estimate does not rebuild it from the running list.
struct DecodeGroupStart {
  bool valid = false;
  std::vector<int32_t> lazy;    // running residents in the group
  std::vector<int32_t> eager;   // the other running residents, in running order
  std::vector<int64_t> bucket;  // group members per residue (−C) mod B: who needs a block at step D
  std::vector<std::pair<int64_t, int32_t>> finishes;  // (step of the last token, request), sorted
  int64_t sum_c = 0;            // Σ C over the group
};

// The start of a scheduler holding residents `reqs` (the first n_running running) in sync mode.
DecodeGroupStart decode_group_start(const std::vector<SchedRequest>& reqs, size_t n_running, const Config& cfg);

class SyncFastPath {
 public:
  enum class Result { Continue, WatchSampled, Unschedulable };

  // The group built from the scheduler's running list as it stands.
  explicit SyncFastPath(Scheduler& s);
  // The group of a freshly loaded snapshot (plus arrivals queued behind its residents), taken
  // from its precomputed start: `s` must hold exactly the state Scheduler::load() gave it.
  SyncFastPath(Scheduler& s, const DecodeGroupStart& start);

  // One engine step (or a folded stretch of decode-only steps); `steps` gets how many.
  Result step(double& now, const Coeffs& beta, int32_t watch, int64_t max_steps, int64_t& steps) {
    return take_step(now, beta, watch, max_steps, true, steps);
  }
  // Exactly one engine step (snapshot ageing needs every step boundary).
  Result step_once(double& now, const Coeffs& beta, int32_t watch) {
    int64_t steps = 0;
    return take_step(now, beta, watch, 1, false, steps);
  }
  int64_t last_tokens() const { return last_tokens_; }  // tokens of the last single step

 private:
  // Request k joins the group as of step d if it is a plain decode (and not the watched query).
  bool join_group(int32_t k, int32_t watch, int64_t d);
  void materialize(int32_t k, int64_t d);  // its record as of step d
  void finish_lazy(int32_t k);
  void materialize_all();  // the group dissolves: every record as of now, all running one by one
  int64_t demand_over(int64_t k) const;  // lazy block allocations in steps [D, D+k)
  void rebuild(int32_t watch);
  void size_tables();
  Result take_step(double& now, const Coeffs& beta, int32_t watch, int64_t max_steps, bool fold, int64_t& steps);
  Result exact_step(double& now, const Coeffs& beta, int32_t watch, bool fold, int64_t& steps);
  // Decode-only steps ahead before the group's next finish (a fold needs at least 2).
  int64_t fold_room(int64_t max_steps) const {
    if (n_lazy_ == 0 || finishes_.next_step() == FinishQueue::kNone) return 0;
    return std::min(finishes_.next_step() - D_, max_steps);
  }
  bool try_fold(double& now, const Coeffs& beta, int64_t k, int64_t& steps);
  void advance_d(int64_t k) {
    D_ += k;
    d_mod_ = blocks_.residue(d_mod_ + k);
    finishes_.advance(D_);
  }

  Scheduler& s_;
  BlockMath blocks_;
  int64_t B_;
  int64_t D_ = 0;
  int64_t d_mod_ = 0;               // D mod B
  std::vector<int64_t> since_;      // per request: the step it joined the group, −1 when not in it
  std::vector<int64_t> bucket_;     // lazy decoders per residue (−C0 + D0) mod B
  std::vector<int32_t> eager_;      // running requests handled one by one, in running order
  std::vector<int32_t> still_eager_;  // scratch: next step's eager_
  FinishQueue finishes_;            // the group's requests by the step of their last token
  int64_t n_lazy_ = 0;
  int64_t sum_cbase_ = 0;           // Σ (C0 − D0) over the group: its contexts sum to this + n·D
  int64_t cooldown_ = 0;            // exact steps to take before trying to lazify again
  std::vector<Scheduler::Item> batch_;
  int64_t last_tokens_ = 0;
};

}  // namespace bea

// Snapshot ageing (staleness compensation): a sync-mode snapshot's residents run alone, with
// eq. 12 batch times, through every step that starts before `age_s` (a query arriving then cannot
// join a step already running). The estimate then inserts the query into the aged state.
#pragma once

#include <cstdint>
#include <memory>

#include "bea/core/batch_time.h"
#include "bea/core/replay.h"
#include "bea/core/scheduler.h"
#include "bea/core/sync_fast_path.h"
#include "bea/core/tracked_ledger.h"

namespace bea {

// When the query joins (seconds after the snapshot) and which ages lead to the same state: any
// age in (valid_from_s, valid_to_s].
struct AgeWindow {
  double join_s = 0.0;
  double valid_from_s = 0.0;
  double valid_to_s = 0.0;
  int64_t steps = 0;  // steps the residents ran
};

// The aged state, stepped by the exact scheduler (request indices as in Prepared).
struct Advanced : AgeWindow {
  Scheduler sched;
  std::unique_ptr<TrackedLedger> ledger;  // the snapshot's tracked blocks (set on sched), or null
  explicit Advanced(const Config& cfg) : sched(cfg) {}
};

Advanced advance(const Prepared& p, const Coeffs& beta, double age_s, int64_t max_steps = 100000);

// The same ageing on the fast path: `fast` drives a scheduler freshly loaded from the snapshot,
// one engine step at a time, and both stay usable for the estimate that follows. The same steps
// as advance(); batch times are summed as the fast path sums them (equal to ~1e-15).
AgeWindow advance_fast(SyncFastPath& fast, const Coeffs& beta, double age_s, int64_t max_steps = 100000);

}  // namespace bea

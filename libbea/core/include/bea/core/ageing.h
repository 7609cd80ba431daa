// Snapshot ageing (staleness compensation): a sync-mode snapshot's residents run alone, with
// eq. 12 batch times, through every step that starts before `age_s` (a query arriving then cannot
// join a step already running). The estimate then inserts the query into the aged state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bea/core/batch_time.h"
#include "bea/core/replay.h"
#include "bea/core/scheduler.h"

namespace bea {

// The aged state. The query joins at `join_s` (seconds after the snapshot); any age in
// (valid_from_s, valid_to_s] advances to the same state.
struct Advanced {
  Scheduler sched;
  std::vector<std::string> names;  // by request index, as in Prepared
  double join_s = 0.0;
  double valid_from_s = 0.0;
  double valid_to_s = 0.0;
  int64_t steps = 0;
  explicit Advanced(const Config& cfg) : sched(cfg) {}
};

Advanced advance(const Prepared& p, const Coeffs& beta, double age_s, int64_t max_steps = 100000);

}  // namespace bea

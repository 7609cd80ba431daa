#include "bea/core/ageing.h"

#include <cmath>
#include <limits>
#include <stdexcept>

namespace bea {
namespace {

void check_age(double age_s) {
  if (!std::isfinite(age_s) || age_s < 0.0) throw std::invalid_argument("age_s must be finite and >= 0");
}

// `t`: when the last step run ended; `last_start`: when it started; `idle`: the residents ran out
// of work (nothing to schedule) before the age was reached.
AgeWindow window(double age_s, double t, double last_start, bool idle, int64_t steps) {
  AgeWindow w;
  w.steps = steps;
  if (idle || steps == 0) {
    w.join_s = age_s;  // nothing runs (or the age is 0): the query enters as soon as it arrives
    w.valid_from_s = idle ? t : 0.0;
    w.valid_to_s = idle ? std::numeric_limits<double>::infinity() : 0.0;
  } else {
    w.join_s = t;
    w.valid_from_s = last_start;
    w.valid_to_s = t;
  }
  return w;
}

}  // namespace

Advanced advance(const Prepared& p, const Coeffs& beta, double age_s, int64_t max_steps) {
  if (p.cfg.async_scheduling) throw std::invalid_argument("staleness compensation needs a sync-mode snapshot");
  check_age(age_s);
  Advanced a(p.cfg);
  a.sched.load(p.reqs, p.n_running, p.free_blocks);
  if (p.tracked) {
    a.ledger = std::make_unique<TrackedLedger>(p);
    a.sched.set_ledger(a.ledger.get());
  }
  std::vector<Scheduler::Item> batch;
  double t = 0.0;
  double last_start = 0.0;
  bool idle = false;
  int64_t steps = 0;
  while (t < age_s && steps < max_steps) {
    a.sched.schedule(batch);
    if (batch.empty()) {
      idle = true;
      break;
    }
    last_start = t;
    t += a.sched.last_features().time(beta);
    a.sched.apply(batch, -1);
    ++steps;
  }
  static_cast<AgeWindow&>(a) = window(age_s, t, last_start, idle, steps);
  return a;
}

AgeWindow advance_fast(SyncFastPath& fast, const Coeffs& beta, double age_s, int64_t max_steps) {
  check_age(age_s);
  double t = 0.0;
  double last_start = 0.0;
  bool idle = false;
  int64_t steps = 0;
  while (t < age_s && steps < max_steps) {
    const double start = t;
    if (fast.step_once(t, beta, -1) == SyncFastPath::Result::Unschedulable) {
      idle = true;
      break;
    }
    last_start = start;
    ++steps;
  }
  return window(age_s, t, last_start, idle, steps);
}

}  // namespace bea

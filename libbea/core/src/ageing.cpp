#include "bea/core/ageing.h"

#include <cmath>
#include <limits>
#include <stdexcept>

namespace bea {

Advanced advance(const Prepared& p, const Coeffs& beta, double age_s, int64_t max_steps) {
  if (p.cfg.async_scheduling) throw std::invalid_argument("staleness compensation needs a sync-mode snapshot");
  if (!std::isfinite(age_s) || age_s < 0.0) throw std::invalid_argument("age_s must be finite and >= 0");
  Advanced a(p.cfg);
  a.sched.load(p.reqs, p.n_running, p.free_blocks);
  a.names = p.names;
  std::vector<Scheduler::Item> batch;
  double t = 0.0;
  double last_start = 0.0;
  bool idle = false;
  while (t < age_s && a.steps < max_steps) {
    a.sched.schedule(batch);
    if (batch.empty()) {  // nothing runs: the query enters as soon as it arrives
      idle = true;
      break;
    }
    last_start = t;
    t += a.sched.batch_time(batch, beta);
    a.sched.apply(batch, -1);
    ++a.steps;
  }
  if (idle || a.steps == 0) {
    a.join_s = age_s;
    a.valid_from_s = idle ? t : 0.0;
    a.valid_to_s = idle ? std::numeric_limits<double>::infinity() : 0.0;
  } else {
    a.join_s = t;
    a.valid_from_s = last_start;
    a.valid_to_s = t;
  }
  return a;
}

}  // namespace bea

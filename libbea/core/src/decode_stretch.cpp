#include "bea/core/decode_stretch.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace bea {

int64_t fold_decode_stretch(Scheduler& s, double& now, const Coeffs& beta, int64_t max_steps) {
  const Config& cfg = s.cfg_;
  const std::vector<int32_t>& running = s.running_;
  const std::vector<Scheduler::Req>& reqs = s.reqs_;
  const size_t R = running.size();
  if (R < 1 || s.waiting_.empty() || cfg.async_scheduling) return 0;
  if (static_cast<int64_t>(R) > cfg.max_num_scheduled_tokens) return 0;
  // The newest admissions (the list's tail) are the likeliest to still prefill: look there first.
  for (auto it = running.rbegin(); it != running.rend(); ++it) {
    const Scheduler::Req& r = reqs[static_cast<size_t>(*it)];
    if (r.O < 1 || r.C != r.P + r.O - 1) return 0;  // not a plain decode
  }
  int64_t min_rem = INT64_MAX;
  int64_t sum_ctx = 0;
  for (int32_t k : running) {
    const Scheduler::Req& r = reqs[static_cast<size_t>(k)];
    const int64_t stop = std::min(std::min(r.target_out, r.max_tokens), cfg.max_model_len - r.P);
    min_rem = std::min(min_rem, stop - r.O);
    sum_ctx += r.C;
  }
  int64_t steps = std::min<int64_t>(min_rem - 1, max_steps);  // the finishing step runs normally
  if (steps < 2) return 0;
  if (!s.admission_blocked(cfg.max_num_scheduled_tokens - static_cast<int64_t>(R))) return 0;
  const int64_t B = cfg.block_size;
  const int64_t pool_free = s.kv_.free_blocks();
  auto demand = [&](int64_t n) {
    int64_t d = 0;
    for (int32_t k : running) {
      const Scheduler::Req& r = reqs[static_cast<size_t>(k)];
      const int64_t need = ceil_div(r.C + n, B) - r.kv.held;
      if (need > 0) d += need;
    }
    return d;
  };
  if (demand(steps) > pool_free) {  // stop before the step whose allocation would fail
    int64_t lo = 0, hi = steps;  // demand(lo) <= free < demand(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (demand(mid) <= pool_free ? lo : hi) = mid;
    }
    steps = lo;
    if (steps < 2) return 0;
  }
  const auto Rd = static_cast<double>(R);
  const auto sd = static_cast<double>(steps);
  now += decode_steps_time(beta, sd, Rd, static_cast<double>(sum_ctx));
  for (int32_t k : running) {
    Scheduler::Req& r = s.req(k);
    const int64_t need = ceil_div(r.C + steps, B) - r.kv.held;
    if (need > 0) s.kv_.allocate(r.kv, need);
    r.C += steps;
    r.O += steps;
  }
  return steps;
}

}  // namespace bea

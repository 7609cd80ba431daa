#include "bea/core/prepared.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "bea/core/request_fields.h"

namespace bea {

int64_t target_output(const Request& r, const ReplayOptions& opt) {
  int64_t pred = r.predicted_output >= 0 ? r.predicted_output
                 : opt.default_output_tokens >= 0 ? opt.default_output_tokens
                                                  : r.max_tokens;
  pred = std::clamp<int64_t>(pred, 1, r.max_tokens);
  if (r.output_tokens < pred) return pred;
  // Already past its prediction: give it `overrun_fraction` of the prediction again (>= 1 token).
  const double frac = std::isfinite(opt.overrun_fraction) ? std::max(0.0, opt.overrun_fraction) : 0.0;
  const double extra = std::min(std::ceil(frac * static_cast<double>(pred)), 1.0e12);
  const int64_t add = std::max<int64_t>(1, static_cast<int64_t>(extra));
  const int64_t t = std::min(r.max_tokens, r.output_tokens + add);
  return t > r.output_tokens ? t : r.output_tokens + 1;
}

Prepared prepare(const Snapshot& s, const ReplayOptions& opt) {
  Prepared p;
  p.cfg = s.config;
  p.free_blocks = s.free_blocks;
  p.time = s.time;
  p.n_running = s.running.size();
  p.reqs.reserve(s.running.size() + s.waiting.size());
  p.names.reserve(s.running.size() + s.waiting.size());
  std::unordered_map<std::string, int32_t> index;
  for (const auto* list : {&s.running, &s.waiting})
    for (const auto& r : *list) {
      if (s.inflight) index.emplace(r.id, static_cast<int32_t>(p.reqs.size()));
      p.reqs.push_back(sched_request(r, target_output(r, opt), p.cfg.async_scheduling));
      p.names.push_back(r.id);
    }
  p.decode_start = decode_group_start(p.reqs, p.n_running, p.cfg);
  if (s.has_tracked) {
    p.tracked = true;
    p.tracked_pos = s.tracked_blocks;
    p.tracked_keys = s.tracked_keys;
    p.chains.reserve(p.reqs.size());
    p.has_chain.reserve(p.reqs.size());
    p.keys.reserve(p.reqs.size());
    for (const auto* list : {&s.running, &s.waiting})
      for (const auto& r : *list) {
        p.chains.push_back(list == &s.running ? r.tracked : r.hit_blocks.value_or(std::vector<int32_t>{}));
        p.has_chain.push_back(r.hit_blocks.has_value() || !r.block_keys.empty() ? 1 : 0);
        p.keys.push_back(r.block_keys);
      }
  }
  if (s.inflight && p.cfg.async_scheduling) {
    p.has_inflight = true;
    p.inflight_start = s.inflight->started - s.time;
    for (const auto& it : s.inflight->items) {
      auto f = index.find(it.id);
      if (f == index.end()) {  // finished since: it still costs device time
        p.inflight_orphans.emplace_back(it.n, it.context);
        continue;
      }
      const Prepared::Req& r = p.reqs[static_cast<size_t>(f->second)];
      p.inflight.push_back({f->second, it.n, it.context, it.context + it.n >= r.P + r.O});
    }
  }
  return p;
}

}  // namespace bea

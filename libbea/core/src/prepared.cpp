#include "bea/core/prepared.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "bea/core/request_fields.h"

namespace bea {

namespace {

// The standard normal quantile for p in [0.5, 1) (Acklam's rational approximation, relative error
// below 1.2e-9; the upper tail in its own form so that p near 1 keeps its precision).
double normal_quantile_upper(double p) {
  static constexpr double a[] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                                 1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00};
  static constexpr double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                                 6.680131188771972e+01, -1.328068155288572e+01};
  static constexpr double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                                 -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00};
  static constexpr double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                                 3.754408661907416e+00};
  if (p <= 0.97575) {
    const double q = p - 0.5, r = q * q;
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
           (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1.0);
  }
  const double q = std::sqrt(-2.0 * std::log(1.0 - p));
  return -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
         ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1.0);
}

// The median of a log-normal length (median `pred`, spread `sigma`) given that it exceeds `k`:
// its upper tail beyond k is T = 1 − Φ(z), z = ln(k / pred) / σ, and the conditional median is
// where the tail is T / 2. NaN when the tail is too thin to say (the overrun rule then applies).
double conditional_median(double pred, double k, double sigma) {
  const double z = std::log(k / pred) / sigma;
  const double tail = 0.5 * std::erfc(z / std::sqrt(2.0));
  if (!(tail > 1e-12)) return std::nan("");
  return pred * std::exp(sigma * normal_quantile_upper(1.0 - 0.5 * tail));
}

}  // namespace

int64_t target_output(const Request& r, const ReplayOptions& opt) {
  int64_t pred = r.predicted_output >= 0 ? r.predicted_output
                 : opt.default_output_tokens >= 0 ? opt.default_output_tokens
                                                  : r.max_tokens;
  pred = std::clamp<int64_t>(pred, 1, r.max_tokens);
  const double sigma = opt.length_sigma;
  if (r.output_tokens > 0 && std::isfinite(sigma) && sigma > 0.0 && r.output_tokens < r.max_tokens) {
    const double l = conditional_median(static_cast<double>(pred), static_cast<double>(r.output_tokens),
                                        std::min(sigma, 8.0));
    if (std::isfinite(l)) {  // beyond what it generated, within its max_tokens
      const double t = std::min(std::ceil(l), static_cast<double>(r.max_tokens));
      return std::max<int64_t>(r.output_tokens + 1, static_cast<int64_t>(t));
    }
  }
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

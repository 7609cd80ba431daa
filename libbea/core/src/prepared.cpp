#include "bea/core/prepared.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include "bea/core/request_fields.h"
#include "bea/core/tracked_ledger.h"

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

// The table in stable form as the ledger reads it (tracked_ledger.h): the free blocks ranked by
// ticket (a block's rank is its place in the free queue), the free blocks nobody named left out
// (they only take places), the cached ones first in stamp order, then the held ones nobody named;
// each running request's tracked blocks as indices. Once per state (Prepared is kept per state).
void indexed_table(const Snapshot& s, const Prepared& p, TrackedTable& t) {
  const auto nb = static_cast<size_t>(std::max<int64_t>(s.config.num_gpu_blocks, 0));
  std::vector<std::pair<int64_t, int64_t>> free;  // (ticket, id)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> cached;  // (stamp, id, key)
  std::vector<int64_t> held;
  free.reserve(static_cast<size_t>(s.pool_free));
  cached.reserve(s.pool.size());
  for (const auto& [id, e] : s.pool) {
    if (e.ticket >= 0) free.emplace_back(e.ticket, id);
    if (e.key >= 0) cached.emplace_back(e.stamp, id, e.key);
    else if (e.ticket < 0) held.push_back(id);
  }
  std::sort(free.begin(), free.end());
  std::sort(cached.begin(), cached.end());
  std::sort(held.begin(), held.end());
  std::vector<int64_t> pos(nb, -1);
  for (size_t k = 0; k < free.size(); ++k) pos[static_cast<size_t>(free[k].second)] = static_cast<int64_t>(k);
  std::vector<int32_t> index(nb, -1);
  t.pos.reserve(cached.size() + held.size());
  t.keys.reserve(cached.size() + held.size());
  for (const auto& [stamp, id, key] : cached) {
    index[static_cast<size_t>(id)] = static_cast<int32_t>(t.pos.size());
    t.pos.push_back(pos[static_cast<size_t>(id)]);
    t.keys.push_back(key);
  }
  for (int64_t id : held) {
    index[static_cast<size_t>(id)] = static_cast<int32_t>(t.pos.size());
    t.pos.push_back(-1);
    t.keys.push_back(-1);
  }
  t.chains.reserve(p.reqs.size());
  t.has_chain.reserve(p.reqs.size());
  t.req_keys.reserve(p.reqs.size());
  for (const auto* list : {&s.running, &s.waiting})
    for (size_t k = 0; k < list->size(); ++k) {
      const Request& r = (*list)[k];
      std::vector<int32_t> chain;
      if (list == &s.running) {
        const std::string f = "running[" + std::to_string(k) + "].tracked_ids";
        if (static_cast<int64_t>(r.tracked_ids.size()) > r.blocks) throw std::invalid_argument(f + ": more blocks than it holds");
        chain.reserve(r.tracked_ids.size());
        for (int64_t id : r.tracked_ids) {
          const int32_t at = id >= 0 && static_cast<size_t>(id) < nb ? index[static_cast<size_t>(id)] : -1;
          if (at < 0 || t.pos[static_cast<size_t>(at)] >= 0)
            throw std::invalid_argument(f + ": block " + std::to_string(id) + " is not a held block of the table");
          chain.push_back(at);
        }
      }
      t.chains.push_back(std::move(chain));
      t.has_chain.push_back(!r.block_keys.empty() ? 1 : 0);
      t.req_keys.push_back(r.block_keys);
    }
}

}  // namespace

namespace {

// The prediction the replay takes for `r`: its own, else the default, else max_tokens; in [1, max_tokens].
int64_t predicted_length(const Request& r, const ReplayOptions& opt) {
  const int64_t pred = r.predicted_output >= 0 ? r.predicted_output
                       : opt.default_output_tokens >= 0 ? opt.default_output_tokens
                                                        : r.max_tokens;
  return std::clamp<int64_t>(pred, 1, std::max<int64_t>(1, r.max_tokens));
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

// A uniform number in (0, 1) for (request, draw): splitmix64 of the id's hash and the draw number.
double uniform_of(uint64_t id_hash, int64_t draw) {
  uint64_t z = id_hash + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(draw);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return (static_cast<double>(z >> 11) + 0.5) * 0x1.0p-53;
}

// The standard normal quantile on all of (0, 1).
double normal_quantile(double p) { return p >= 0.5 ? normal_quantile_upper(p) : -normal_quantile_upper(1.0 - p); }

// Request `r`'s length in each of `draws` draws (appended to `out`; `point`: its point target,
// kept where nothing can be drawn): a log-normal with mean `pred` (the calibrated prediction is a
// mean: the location is ln(pred) − σ²/2) and spread `sigma`, given that it exceeds the `O`
// tokens generated, within [O + 1, max_tokens].
void draw_targets(const Request& r, int64_t pred, int64_t point, double sigma, int64_t draws, uint64_t id_hash,
                  std::vector<int64_t>& out) {
  const int64_t O = r.output_tokens;
  const double mu = std::log(static_cast<double>(pred)) - 0.5 * sigma * sigma;
  const double below = O > 0 ? 0.5 * std::erfc(-(std::log(static_cast<double>(O)) - mu) / (sigma * std::sqrt(2.0))) : 0.0;
  for (int64_t d = 1; d <= draws; ++d) {
    int64_t t = point;
    const double u = below + uniform_of(id_hash, d) * (1.0 - below);
    if (O < r.max_tokens && u > 0.0 && u < 1.0) {  // else done, or a tail too thin to draw from
      const double l = std::exp(mu + sigma * normal_quantile(u));
      if (std::isfinite(l)) t = std::max<int64_t>(O + 1, static_cast<int64_t>(std::min(std::ceil(l), static_cast<double>(r.max_tokens))));
    }
    out.push_back(t);
  }
}

}  // namespace

int64_t target_output(const Request& r, const ReplayOptions& opt) {
  const int64_t pred = predicted_length(r, opt);
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

std::shared_ptr<const TrackedTable> tracked_table(const Snapshot& s, const Prepared& p) {
  if (!s.has_pool && !s.has_tracked) return nullptr;
  auto t = std::make_shared<TrackedTable>();
  if (s.has_pool) {
    indexed_table(s, p, *t);
  } else {
    t->pos = s.tracked_blocks;
    t->keys = s.tracked_keys;
    t->chains.reserve(p.reqs.size());
    t->has_chain.reserve(p.reqs.size());
    t->req_keys.reserve(p.reqs.size());
    for (const auto* list : {&s.running, &s.waiting})
      for (const auto& r : *list) {
        t->chains.push_back(list == &s.running ? r.tracked : r.hit_blocks.value_or(std::vector<int32_t>{}));
        t->has_chain.push_back(r.hit_blocks.has_value() || !r.block_keys.empty() ? 1 : 0);
        t->req_keys.push_back(r.block_keys);
      }
  }
  TrackedLedger::start(*t, p);  // once per state: every replay against it starts from here
  return t;
}

Prepared prepare(const Snapshot& s, const ReplayOptions& opt, std::shared_ptr<const TrackedTable> table) {
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
  if (opt.length_draws > 0 && opt.length_sigma > 0.0 && std::isfinite(opt.length_sigma)) {
    // draw-major: draw d's lengths are drawn_targets[(d − 1)·n, d·n)
    const size_t n = p.reqs.size();
    const double sigma = std::min(opt.length_sigma, 8.0);
    p.length_draws = opt.length_draws;
    std::vector<int64_t> per;  // one request's draws
    per.reserve(static_cast<size_t>(opt.length_draws));
    p.drawn_targets.assign(n * static_cast<size_t>(opt.length_draws), 0);
    size_t i = 0;
    for (const auto* list : {&s.running, &s.waiting})
      for (const auto& r : *list) {
        per.clear();
        draw_targets(r, predicted_length(r, opt), p.reqs[i].target_out, sigma, opt.length_draws, fnv1a(r.id), per);
        int64_t least = p.reqs[i].target_out;
        for (size_t d = 0; d < per.size(); ++d) {
          p.drawn_targets[d * n + i] = per[d];
          least = std::min(least, per[d]);
        }
        if (r.output_tokens < r.max_tokens) p.draw_margin = std::min(p.draw_margin, least - r.output_tokens);
        ++i;
      }
    // per draw: its margin (point and drawn lengths) and the fast path's group start
    p.drawn_margins.assign(static_cast<size_t>(opt.length_draws), std::numeric_limits<int64_t>::max());
    p.drawn_starts.reserve(static_cast<size_t>(opt.length_draws));
    std::vector<SchedRequest> drawn = p.reqs;
    for (size_t d = 0; d < static_cast<size_t>(opt.length_draws); ++d) {
      int64_t& margin = p.drawn_margins[d];
      for (size_t k = 0; k < n; ++k) {
        const SchedRequest& r = p.reqs[k];
        const int64_t t = p.drawn_targets[d * n + k];
        drawn[k].target_out = t;
        if (r.O < r.max_tokens) margin = std::min(margin, std::min(t, r.target_out) - r.O);
      }
      p.drawn_starts.push_back(decode_group_start(drawn, p.n_running, p.cfg));
    }
  }
  p.tracked = s.has_pool || s.has_tracked;
  if (p.tracked) p.table = table ? std::move(table) : tracked_table(s, p);
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

void use_drawn_lengths(Prepared& d, const Prepared& p, int64_t draw) {
  const size_t n = p.reqs.size();
  const size_t from = static_cast<size_t>(draw - 1) * n;
  for (size_t i = 0; i < n; ++i) d.reqs[i].target_out = p.drawn_targets[from + i];
  d.decode_start = decode_group_start(d.reqs, d.n_running, d.cfg);
}

Prepared draw_form(const Prepared& p) {
  Prepared d;
  d.cfg = p.cfg;
  d.free_blocks = p.free_blocks;
  d.time = p.time;
  d.reqs = p.reqs;
  d.n_running = p.n_running;
  d.has_inflight = p.has_inflight;
  d.inflight_start = p.inflight_start;
  d.inflight = p.inflight;
  d.inflight_orphans = p.inflight_orphans;
  d.tracked = p.tracked;
  d.table = p.table;
  return d;  // decode_start empty: use_draw points start_of_draw at the draw's
}

void use_draw(Prepared& d, const Prepared& p, int64_t draw) {
  const size_t n = p.reqs.size();
  const size_t from = static_cast<size_t>(draw - 1) * n;
  for (size_t i = 0; i < n; ++i) d.reqs[i].target_out = p.drawn_targets[from + i];
  d.start_of_draw = &p.drawn_starts[static_cast<size_t>(draw - 1)];
}

}  // namespace bea

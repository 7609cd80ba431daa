// The batch-time model of paper eq. 12: four calibrated coefficients over a batch's composition.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace bea {

struct Coeffs {
  double b0 = 0.0;  // fixed per-batch overhead (s)
  double b1 = 0.0;  // per scheduled token: dense layers (s/token)
  double b2 = 0.0;  // per decode context token: KV reads of decode attention (s/token)
  double b3 = 0.0;  // per unit of prefill attention work n*ctx + n(n+1)/2 (s/unit)
  // A second eq. 12 line over the same terms (all 0: none). A step then takes the larger of the
  // two: a roofline, memory-bound below its kink and compute-bound above (docs/libbea.md).
  double g0 = 0.0, g1 = 0.0, g2 = 0.0, g3 = 0.0;
  bool roofline() const { return g0 > 0.0 || g1 > 0.0 || g2 > 0.0 || g3 > 0.0; }
};

// Σ_{j=0}^{k-1} of max(u0 + us·j, v0 + vs·j): two lines cross at most once.
inline double sum_max_lines(double k, double u0, double us, double v0, double vs) {
  auto sum = [](double a, double slope, double j0, double j1) {  // Σ_{j=j0}^{j1-1} a + slope·j
    return (j1 - j0) * a + slope * (j1 * (j1 - 1.0) - j0 * (j0 - 1.0)) * 0.5;
  };
  if (vs == us) return u0 >= v0 ? sum(u0, us, 0.0, k) : sum(v0, vs, 0.0, k);
  const double cross = (u0 - v0) / (vs - us);  // where the lines meet
  if (vs > us) {  // v is the larger after the crossing
    const double m = std::isfinite(cross) ? std::clamp(std::floor(cross) + 1.0, 0.0, k) : (cross > 0 ? k : 0.0);
    return sum(u0, us, 0.0, m) + sum(v0, vs, m, k);
  }
  const double m = std::isfinite(cross) ? std::clamp(std::ceil(cross), 0.0, k) : (cross > 0 ? k : 0.0);
  return sum(v0, vs, 0.0, m) + sum(u0, us, m, k);
}

// The time of k consecutive decode-only steps of R requests whose contexts sum to `ctx0` in the
// first and grow by R a step (the closed form of the decode-stretch folds).
inline double decode_steps_time(const Coeffs& c, double k, double R, double ctx0) {
  const double u0 = c.b0 + c.b1 * R + c.b2 * ctx0, us = c.b2 * R;
  if (!c.roofline()) return k * u0 + us * k * (k - 1.0) * 0.5;
  return sum_max_lines(k, u0, us, c.g0 + c.g1 * R + c.g2 * ctx0, c.g2 * R);
}

// The three workload terms of eq. 12, accumulated item by item.
struct BatchFeatures {
  double tokens = 0.0;        // Σ n
  double decode_ctx = 0.0;    // Σ_decode context
  double prefill_work = 0.0;  // Σ_prefill n*context + n(n+1)/2
  int64_t items = 0;

  // One request's share of a step: n tokens on top of `context` computed ones. A decode is a
  // one-token step once the prompt is done (context >= prompt_tokens), as bear.batch/1 defines it.
  void add(int64_t n, int64_t context, bool decode) {
    ++items;
    tokens += static_cast<double>(n);
    if (decode) {
      decode_ctx += static_cast<double>(context);
    } else {
      const double dn = static_cast<double>(n);
      prefill_work += dn * static_cast<double>(context) + dn * (dn + 1.0) * 0.5;
    }
  }
  // `count` one-token decodes whose contexts sum to `ctx_sum` (a group advanced together).
  void add_decodes(int64_t count, int64_t ctx_sum) {
    items += count;
    tokens += static_cast<double>(count);
    decode_ctx += static_cast<double>(ctx_sum);
  }
  double time(const Coeffs& c) const {
    if (items == 0) return 0.0;
    const double t = c.b0 + c.b1 * tokens + c.b2 * decode_ctx + c.b3 * prefill_work;
    if (!c.roofline()) return t;
    return std::max(t, c.g0 + c.g1 * tokens + c.g2 * decode_ctx + c.g3 * prefill_work);
  }
};

inline bool is_decode(int64_t n, int64_t context, int64_t prompt_tokens) {
  return n == 1 && context >= prompt_tokens;
}

}  // namespace bea

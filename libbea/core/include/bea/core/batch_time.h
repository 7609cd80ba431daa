// The batch-time model of paper eq. 12: four calibrated coefficients over a batch's composition.
#pragma once

#include <cstdint>

namespace bea {

struct Coeffs {
  double b0 = 0.0;  // fixed per-batch overhead (s)
  double b1 = 0.0;  // per scheduled token: dense layers (s/token)
  double b2 = 0.0;  // per decode context token: KV reads of decode attention (s/token)
  double b3 = 0.0;  // per unit of prefill attention work n*ctx + n(n+1)/2 (s/unit)
};

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
    return items == 0 ? 0.0 : c.b0 + c.b1 * tokens + c.b2 * decode_ctx + c.b3 * prefill_work;
  }
};

inline bool is_decode(int64_t n, int64_t context, int64_t prompt_tokens) {
  return n == 1 && context >= prompt_tokens;
}

}  // namespace bea

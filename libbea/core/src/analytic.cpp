#include "bea/core/analytic.h"

#include <cmath>
#include <limits>
#include <stdexcept>

namespace bea {
namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

void require_finite_nonneg(double x, const char* name) {
  if (!std::isfinite(x) || x < 0.0) throw std::invalid_argument(std::string(name) + " must be finite and >= 0");
}
}  // namespace

int64_t pending_prefill_tokens(const Snapshot& s) {
  int64_t total = 0;
  for (const auto* list : {&s.running, &s.waiting})
    for (const auto& r : *list) {
      const int64_t num_tokens = r.prompt_tokens + r.output_tokens;
      const bool decoding = r.output_tokens > 0 && r.computed_tokens >= num_tokens - 1;
      if (!decoding && r.computed_tokens < num_tokens) total += num_tokens - r.computed_tokens;
    }
  return total;
}

double prefill_throughput_ttft(double pending_tokens, double query_tokens, double theta) {
  require_finite_nonneg(pending_tokens, "pending_tokens");
  require_finite_nonneg(query_tokens, "query_tokens");
  if (!std::isfinite(theta) || theta <= 0.0) throw std::invalid_argument("theta must be finite and > 0");
  return (pending_tokens + query_tokens) / theta;
}

double lps_wait(double alpha, double mu, double k) {
  require_finite_nonneg(alpha, "alpha");
  require_finite_nonneg(k, "k");
  if (!std::isfinite(mu) || mu <= 0.0) throw std::invalid_argument("mu must be finite and > 0");
  if (alpha >= mu) return kInf;
  return std::pow(alpha / mu, k) / (mu - alpha);
}

double lps_ttft(double alpha, double mu, double k, double query_tokens, double theta) {
  return lps_wait(alpha, mu, k) + prefill_throughput_ttft(0.0, query_tokens, theta);
}

double lps_wait_corrected(double alpha, double mean_service, double k, double ca2, double cs2) {
  require_finite_nonneg(alpha, "alpha");
  require_finite_nonneg(k, "k");
  require_finite_nonneg(ca2, "ca2");
  require_finite_nonneg(cs2, "cs2");
  if (!std::isfinite(mean_service) || mean_service <= 0.0)
    throw std::invalid_argument("mean_service must be finite and > 0");
  const double rho = alpha * mean_service;
  if (rho >= 1.0) return kInf;
  return 0.5 * (ca2 + cs2) * std::pow(rho, k) * mean_service / (1.0 - rho);
}

}  // namespace bea

// Analytic TTFT estimators for when no usable snapshot exists (paper eq. 8, 13-15).
#pragma once

#include <cstdint>

#include "bea/core/snapshot.h"

namespace bea {

// Prompt tokens residents still have to prefill (fresh prompts and preempted recomputes).
int64_t pending_prefill_tokens(const Snapshot& s);

// Eq. 8: (pending prefill tokens + the query's own) / prefill throughput θ (tokens/s).
double prefill_throughput_ttft(double pending_tokens, double query_tokens, double theta);

// Eq. 13: expected LPS queueing delay ρ^k / (μ − α); +inf when ρ >= 1.
double lps_wait(double alpha, double mu, double k);

// Eq. 14: eq. 13 plus the query's prefill at throughput θ.
double lps_ttft(double alpha, double mu, double k, double query_tokens, double theta);

// Eq. 15: variability-corrected wait (c_a² + c_s²)/2 · ρ^k E[Q] / (1 − ρ), ρ = α E[Q].
double lps_wait_corrected(double alpha, double mean_service, double k, double ca2, double cs2);

}  // namespace bea

// Where a scheduler that keeps real KV blocks hooks into the count model: the simulated engine's
// block-level prefix cache (sim/prefix_cache.h) implements it; the replay leaves it unset, and
// its scheduler pays one null check per allocation.
//
// With a ledger the scheduler asks it for a waiting request's prefix hit (instead of the count
// model's reported hit) and tells it every admission, growth, computation and release, in vLLM's
// order within a step (a request's blocks are cached as soon as it is scheduled, so a later
// admission in the same step can hit them); the free-block count is the ledger's.
#pragma once

#include <cstdint>

#include "bea/core/kv_cache.h"

namespace bea {

class BlockLedger {
 public:
  virtual ~BlockLedger() = default;
  // The prefix hit of waiting request `req` with `num_tokens` tokens (at least one recomputed).
  virtual PrefixHit hit(int32_t req, int64_t num_tokens) const = 0;
  // `req` is admitted with its hit (as `hit` returned it) and holds `total_blocks` blocks now.
  virtual void admitted(int32_t req, int64_t num_tokens, int64_t total_blocks) = 0;
  // A running request's block count grew to `held_blocks`.
  virtual void grew(int32_t req, int64_t held_blocks) = 0;
  // `req`'s first `tokens` tokens are (being) computed: its full blocks among them are cached.
  virtual void computed(int32_t req, int64_t tokens) = 0;
  // `req` let go of its blocks: preempted (it will wait again, its cached blocks are its next
  // hit) or finished / aborted.
  virtual void released(int32_t req, bool preempted) = 0;
  virtual int64_t free_blocks() const = 0;
};

}  // namespace bea

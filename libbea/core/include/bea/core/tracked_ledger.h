// The replay's block ledger under KV pressure with prefix caching (docs/estimator.md, "What an
// exact replay under KV pressure needs"): vLLM 0.32's free-queue rules (v1/core/block_pool.py)
// applied to the few blocks some hit can use — the snapshot's *tracked* blocks — and counts for
// everything else. Pops from the front evict cached blocks, a hit's touch takes a free block out
// of the queue, a release prepends a request's uncached blocks and appends its cached ones (its
// blocks in reverse order); a preempted request's computed full blocks become tracked blocks of
// its own chain. Requests without a chain keep the count model's rule (their reported hit is held
// by running requests: no free-block charge, never evicted).
//
// A tracked block's place in the free queue is an ordinal `abs`: its position is abs - base, where
// base grows with every pop and shrinks with every prepend, so that neither touches the table; a
// touch lowers the ordinals behind the touched block by one; it is evicted once popped (abs < base).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bea/core/block_ledger.h"
#include "bea/core/prepared.h"

namespace bea {

class TrackedLedger : public BlockLedger {
 public:
  // The snapshot's table and residents (request indices as in `p`).
  explicit TrackedLedger(const Prepared& p);
  // A request that joined after the snapshot (the query, a dispatch ahead of it): its reported
  // hit tokens and, when given, its hit chain (indices into the snapshot's table; std::invalid_argument
  // naming `field` for one outside it).
  void add_request(int32_t req, int64_t reported_hit_tokens, const std::optional<std::vector<int32_t>>& chain,
                   const std::string& field);

  PrefixHit hit(int32_t req, int64_t num_tokens) const override;
  void admitted(int32_t req, int64_t num_tokens, int64_t total_blocks) override;
  void grew(int32_t req, int64_t held_blocks) override;
  void computed(int32_t req, int64_t tokens) override;
  void released(int32_t req, bool preempted) override;
  int64_t free_blocks() const override { return free_; }

  // For tests and tools: whether tracked block `t` is still cached (not popped) and where it is.
  bool alive(int32_t t) const { return blocks_[static_cast<size_t>(t)].alive; }
  // Its free-queue position now (-1: held, or no longer cached).
  int64_t position(int32_t t) const;
  size_t n_tracked() const { return blocks_.size(); }

 private:
  struct Block {
    int64_t abs = 0;     // ordinal in the free queue (when queued)
    int32_t ref = 0;     // holders
    bool queued = false; // in the free queue
    bool cached = false; // its content is hashed (a hit can use it)
    bool alive = true;   // not evicted
  };
  // One request's blocks, in block order: `phantom` leading hit blocks held by others (the count
  // model's reported hit), its `tracked` blocks, then `own` untracked blocks only it holds.
  struct Holder {
    std::vector<int32_t> chain;  // waiting: its hit chain (tracked blocks, in order)
    bool has_chain = false;
    int64_t reported = 0;        // reported hit tokens (requests without a chain)
    std::vector<int32_t> tracked;
    int64_t phantom = 0, own = 0;
    int64_t held = 0;            // phantom + tracked + own
    int64_t full = 0;            // leading blocks cached (full, computed)
  };
  Holder& at(int32_t req);
  // The hit of `h` with `num_tokens` tokens: blocks (phantom ones first) and how many are free.
  PrefixHit chain_hit(const Holder& h, int64_t num_tokens, int64_t& phantom) const;
  void unqueue(int32_t t);           // touch of a free block
  void pop(int64_t n);               // n blocks from the front
  void prepend(int64_t n);           // n uncached blocks at the front
  int32_t append(int32_t t);         // `t` (or, -1, a new tracked block) at the back

  std::vector<Block> blocks_;
  std::vector<Holder> reqs_;
  size_t table_size_ = 0;            // the snapshot's blocks (later ones come from preemptions)
  int64_t block_size_;
  int64_t free_;
  int64_t base_ = 0;
  int64_t low_;                      // a lower bound on every queued block's abs
};

}  // namespace bea

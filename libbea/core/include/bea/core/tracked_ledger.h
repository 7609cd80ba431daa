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
//
// Hits follow content: a request's `block_keys` name its leading full blocks' tokens, every
// cached tracked block with a key is found by it (the first cached one, as vLLM's hash map), and a
// request's own blocks become tracked blocks once computed under a key — so that a hit on blocks
// another request computes during the replay (a shared prefix recomputed after its eviction, a
// conversation's earlier turn) is found. Without keys, a hit walks its `hit_blocks` chain.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "bea/core/block_ledger.h"
#include "bea/core/prepared.h"

namespace bea {

class TrackedLedger : public BlockLedger {
 public:
  // The snapshot's table and residents (request indices as in `p`).
  explicit TrackedLedger(const Prepared& p);
  // A request that joined after the snapshot (the query, a dispatch ahead of it): its reported
  // hit tokens, its hit chain when given (indices into the snapshot's table; std::invalid_argument
  // naming `field` for one outside it) and its block keys.
  void add_request(int32_t req, int64_t reported_hit_tokens, const std::optional<std::vector<int32_t>>& chain,
                   const std::vector<int64_t>& keys, const std::string& field);

  PrefixHit hit(int32_t req, int64_t num_tokens) const override;
  void admitted(int32_t req, int64_t num_tokens, int64_t total_blocks) override;
  void grew(int32_t req, int64_t held_blocks) override;
  void computed(int32_t req, int64_t tokens) override;
  void released(int32_t req, bool preempted) override;
  int64_t free_blocks() const override { return free_; }

 private:
  struct Block {
    int64_t abs = 0;      // ordinal in the free queue (when queued)
    int64_t key = -1;     // its content (block keys), -1: unknown
    int32_t ref = 0;      // holders
    bool queued = false;  // in the free queue
    bool cached = false;  // its content is hashed (a hit can use it)
    bool alive = true;    // not evicted
  };
  // One request's blocks, in block order: `phantom` leading hit blocks held by others (the count
  // model's reported hit), its `tracked` blocks, then `own` untracked blocks only it holds.
  struct Holder {
    std::vector<int32_t> chain;  // waiting: its hit chain (tracked blocks, after the phantom ones)
    bool has_chain = false;      // chain or keys given: the ledger finds its hit (else: reported)
    int64_t reported = 0;        // reported hit tokens (requests without a chain)
    std::vector<int64_t> keys;
    std::vector<int32_t> tracked;
    int64_t phantom = 0, own = 0;
    int64_t held = 0;            // phantom + tracked + own
    int64_t full = 0;            // leading blocks cached (full, computed)
  };
  Holder& at(int32_t req);
  // The hit of `h` with `num_tokens` tokens: its tracked blocks into `blocks` (when given), the
  // count (phantom ones first), how many are free; `phantom` receives the phantom count.
  PrefixHit walk(const Holder& h, int64_t num_tokens, int64_t& phantom, std::vector<int32_t>* blocks) const;
  int32_t lookup(int64_t key) const;
  void cache(int32_t t, int64_t key);  // `t`'s content is hashed (under `key` when it had none)
  void forget(int32_t t);              // `t` is evicted
  void unqueue(int32_t t);             // touch of a free block
  void pop(int64_t n);                 // n blocks from the front
  void prepend(int64_t n);             // n uncached blocks at the front
  int32_t add_block();                 // a new tracked block (not queued, no holder)
  void append(int32_t t);              // `t` at the back

  std::vector<Block> blocks_;
  std::vector<Holder> reqs_;
  std::unordered_map<int64_t, std::vector<int32_t>> by_key_;  // cached blocks per key, first cached first
  size_t table_size_ = 0;            // the snapshot's blocks (later ones come from the replay)
  int64_t block_size_;
  int64_t free_;
  int64_t base_ = 0;
  int64_t low_;                      // a lower bound on every queued block's abs
};

}  // namespace bea

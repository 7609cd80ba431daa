// The replay's block ledger under KV pressure with prefix caching (docs/estimator.md, "What an
// exact replay under KV pressure needs"): vLLM 0.32's free-queue rules (v1/core/block_pool.py)
// applied to the few blocks some hit can use — the snapshot's *tracked* blocks — and counts for
// everything else. Pops from the front evict cached blocks, a hit's touch takes a free block out
// of the queue, a release prepends a request's uncached blocks and appends its cached ones (its
// blocks in reverse order); a preempted request's computed full blocks become tracked blocks of
// its own chain. Requests without a chain keep the count model's rule (their reported hit is held
// by running requests: no free-block charge, never evicted).
//
// A tracked block's place in the free queue is an ordinal `abs`: ordinals run from `base` (the
// front) to `end` (after the back), less the holes touches leave (a touched block's ordinal stays
// taken, by nobody), so that no pop, prepend or touch renumbers the table: a pop moves base past
// n ordinals that are not holes and evicts the tracked blocks it passed (the queue's tracked
// blocks are kept in ordinal order, so it finds them without a scan), a prepend lowers base, an
// append takes end. A replay starts from the state's TrackedTable (built once, in prepare) and
// keeps only the blocks it changes: an estimate costs what its replay touches, not the pool's size.
//
// Hits follow content: a request's `block_keys` name its leading full blocks' tokens, every
// cached tracked block with a key is found by it (the first cached one, as vLLM's hash map), and a
// request's own blocks become tracked blocks once computed under a key — so that a hit on blocks
// another request computes during the replay (a shared prefix recomputed after its eviction, a
// conversation's earlier turn) is found. Without keys, a hit walks its `hit_blocks` chain.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bea/core/block_ledger.h"
#include "bea/core/prepared.h"
#include "bea/core/tracked_table.h"

namespace bea {

class TrackedLedger : public BlockLedger {
 public:
  // The snapshot's table and residents (request indices as in `p`), from p.table's start.
  explicit TrackedLedger(const Prepared& p);
  // Build `t`'s start from its inputs and `p`'s requests (prepare(), once per state).
  static void start(TrackedTable& t, const Prepared& p);
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
  using Block = TrackedBlock;
  using Holder = TrackedHolder;
  using Entry = std::pair<int64_t, int32_t>;  // (ordinal, block) or (key, block)
  // From scratch: every block of its own (the start, or a replay whose lengths change what the
  // start counted computed).
  TrackedLedger(const Prepared& p, const TrackedTable& in);

  const Block& blk(int32_t t) const;
  Block& mut(int32_t t);  // copied from the start on its first change
  Holder& at(int32_t req);
  // The hit of `h` with `num_tokens` tokens: its tracked blocks into `blocks` (when given), the
  // count (phantom ones first), how many are free; `phantom` receives the phantom count.
  PrefixHit walk(const Holder& h, int64_t num_tokens, int64_t& phantom, std::vector<int32_t>* blocks) const;
  int32_t lookup(int64_t key) const;
  void cache(int32_t t, int64_t key);  // `t`'s content is hashed (under `key` when it had none)
  void forget(int32_t t);              // `t` is evicted
  void unqueue(int32_t t);             // touch of a free block
  void pop(int64_t n);                 // n blocks from the front
  void evict_before(const std::vector<Entry>& queue, size_t& head);  // its blocks passed by the front
  void prepend(int64_t n);             // n uncached blocks at the front
  int32_t add_block();                 // a new tracked block (not queued, no holder)
  void append(int32_t t);              // `t` at the back

  std::shared_ptr<const TrackedTable> table_;  // the start (null: from scratch)
  size_t n_start_ = 0;                         // blocks of the start (read through changed_)
  std::vector<int32_t> slot_;                  // per start block: its copy in changed_, or -1
  std::vector<Block> changed_;                 // the start's blocks this replay changed
  std::vector<Block> extra_;                   // blocks n_start_ … (the replay's own)
  std::vector<Holder> reqs_;
  std::vector<Entry> index_;                   // from scratch: the keyed cached blocks at the snapshot, as the start's by_key
  bool building_ = false;                      // constructing from scratch: cached blocks go to index_
  std::unordered_map<int64_t, std::vector<int32_t>> by_key_;  // cached since the start, first cached first
  size_t head_ = 0;                            // the start's queue entries passed by the front
  std::vector<Entry> tail_;                    // blocks queued since the start, by ordinal
  size_t tail_head_ = 0;
  std::set<int64_t> holes_;                    // touched ordinals at or behind base
  size_t table_size_ = 0;                      // the snapshot's blocks (later ones come from the replay)
  int64_t block_size_ = 16;
  int64_t free_ = 0;
  int64_t base_ = 0;
  int64_t end_ = 0;
};

}  // namespace bea

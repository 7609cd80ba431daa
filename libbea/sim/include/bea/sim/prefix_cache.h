// The simulated engine's prefix cache: a BlockPool (block_pool.h) that the scheduler's count
// model drives through the BlockLedger hooks. Each request brings the hashes of its full blocks
// (vLLM's block hashes of its token ids, prompt and answer alike: the workload knows the answer's
// ids); a request without hashes neither hits nor leaves anything cached.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "bea/core/block_ledger.h"
#include "bea/sim/block_pool.h"

namespace bea {

// The pool described for a replay's tracked-block ledger (bear.snapshot/1 `tracked_blocks`,
// core/tracked_ledger.h): every block on a waiting request's (or the query's) hit chain, every
// block more than one running request holds, and each running request's blocks ahead of those.
struct BlockTable {
  std::vector<int64_t> positions;  // per tracked block: its free-queue position, -1: held
  std::unordered_map<int32_t, std::vector<int32_t>> tracked;  // running request -> its tracked blocks
  std::unordered_map<int32_t, std::vector<int32_t>> chains;   // waiting request -> its hit chain
  std::unordered_map<int32_t, int64_t> hit_tokens;            // waiting request -> its hit now
  std::vector<int32_t> query_chain;
  int64_t query_hit_tokens = 0;
  // Block keys (a hash renamed to a small int) of every request's leading blocks whose hashes are
  // cached now or shared with another of these requests (or the query): where a hit can form.
  std::unordered_map<int32_t, std::vector<int64_t>> keys;
  std::vector<int64_t> query_keys;
};

class PrefixCache : public BlockLedger {
 public:
  PrefixCache(int64_t num_blocks, int64_t block_size) : pool_(num_blocks + 1, block_size) {}

  // Request index `req` (the scheduler's) is new, with the hashes of its full blocks.
  void add(int32_t req, std::vector<uint64_t> hashes);

  PrefixHit hit(int32_t req, int64_t num_tokens) const override;
  void admitted(int32_t req, int64_t num_tokens, int64_t total_blocks) override;
  void grew(int32_t req, int64_t held_blocks) override;
  void computed(int32_t req, int64_t tokens) override;
  void released(int32_t req, bool preempted) override;
  int64_t free_blocks() const override { return pool_.num_free(); }
  // A request that will not be scheduled again (finished, aborted): its hashes are dropped.
  void forget(int32_t req);

  // The hit request `req` had at its first admission (vLLM's num_cached_tokens; -1: not yet).
  int64_t first_hit_tokens(int32_t req) const;
  std::vector<KvEvent> take_events() { return pool_.take_events(); }
  std::vector<uint64_t> cached_hashes() const { return pool_.cached_hashes(); }
  // The tracked-block table of the pool now, for these running and waiting requests and a query
  // with `query_hashes` (its full blocks' hashes).
  BlockTable table(const std::vector<int32_t>& running, const std::vector<int32_t>& waiting,
                   const std::vector<uint64_t>& query_hashes) const;

 private:
  struct Held {
    std::vector<uint64_t> hashes;
    std::vector<int32_t> blocks;
    int64_t cached = 0;  // leading blocks already named in the cache
    int64_t first_hit = -1;
  };
  Held& at(int32_t req);

  BlockPool pool_;
  std::vector<Held> reqs_;
  std::vector<int32_t> scratch_;
};

}  // namespace bea

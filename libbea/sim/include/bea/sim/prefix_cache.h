// The simulated engine's prefix cache: a BlockPool (block_pool.h) that the scheduler's count
// model drives through the BlockLedger hooks. Each request brings the hashes of its full blocks
// (vLLM's block hashes of its token ids, prompt and answer alike: the workload knows the answer's
// ids); a request without hashes neither hits nor leaves anything cached.
#pragma once

#include <cstdint>
#include <vector>

#include "bea/core/block_ledger.h"
#include "bea/sim/block_pool.h"

namespace bea {

class PrefixCache : public BlockLedger {
 public:
  PrefixCache(int64_t num_blocks, int64_t block_size) : pool_(num_blocks + 1, block_size) {}

  // Request index `req` (the scheduler's) is new, with the hashes of its full blocks.
  void add(int32_t req, std::vector<uint64_t> hashes);

  PrefixHit hit(int32_t req, int64_t num_tokens) const override;
  void admitted(int32_t req, int64_t num_tokens, int64_t total_blocks) override;
  void grew(int32_t req, int64_t held_blocks) override;
  void computed(int32_t req, int64_t tokens) override;
  void released(int32_t req) override;
  int64_t free_blocks() const override { return pool_.num_free(); }
  // A request that will not be scheduled again (finished, aborted): its hashes are dropped.
  void forget(int32_t req);

  // The hit request `req` had at its first admission (vLLM's num_cached_tokens; -1: not yet).
  int64_t first_hit_tokens(int32_t req) const;
  std::vector<KvEvent> take_events() { return pool_.take_events(); }
  std::vector<uint64_t> cached_hashes() const { return pool_.cached_hashes(); }

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

// The simulated engine's prefix cache, block by block, as vLLM's BlockPool keeps it
// (vllm/v1/core/block_pool.py, kv_cache_manager.py, single_type_kv_cache_manager.py): every
// KV block has an id, a ref count and, once full, the hash that names its content; free blocks
// wait in one queue whose front is taken first (uncached blocks are put back at the front,
// cached ones at the back, so cached blocks are evicted least recently freed first); a new
// request's prefix hit is the longest run of its block hashes found in the cache. Every change
// to the cache is an event (stored / removed), the engine's KV events.
//
// The scheduler (its count model, core/kv_cache.h) decides how many blocks a request takes and
// when; this pool executes those decisions on real blocks so that hits happen, and are evicted,
// as in vLLM. Block 0 is vLLM's null block and never free.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace bea {

struct KvEvent {
  enum Kind : uint8_t { Stored, Removed, Cleared } kind;
  std::vector<uint64_t> hashes;
};

class BlockPool {
 public:
  BlockPool(int64_t num_blocks, int64_t block_size);

  int64_t num_free() const { return free_count_; }
  int64_t block_size() const { return block_size_; }

  // The longest run of `hashes` (a request's block hashes, in order) cached now, at most
  // `max_blocks` long: the blocks it names, appended to `out`. Returns how many of them sit in
  // the free queue (taking them costs free blocks).
  int64_t find_hit(const std::vector<uint64_t>& hashes, int64_t max_blocks, std::vector<int32_t>& out) const;
  // A request adopts cached blocks: each gains a holder (and leaves the free queue if it had none).
  void touch(const std::vector<int32_t>& blocks);
  // `n` blocks from the front of the free queue, each evicted from the cache if it was cached.
  void take_new(int64_t n, std::vector<int32_t>& out);
  // Name the full blocks `first .. last-1` of a request's block list by its hashes (blocks
  // already named keep their name).
  void cache(const std::vector<int32_t>& blocks, const std::vector<uint64_t>& hashes, int64_t first, int64_t last);
  // A request lets go of its blocks: freed in reverse order, so its last blocks are evicted first.
  void release(const std::vector<int32_t>& blocks);

  // What a tracked-block table reads (tracked_ledger.h): the free queue front first, a block's
  // holders, whether it is cached, the block a hit on `h` would use (-1: none).
  std::vector<int32_t> free_queue() const;
  int32_t ref(int32_t b) const { return ref_[static_cast<size_t>(b)]; }
  bool is_cached(int32_t b) const { return hash_of_.count(b) != 0; }
  int32_t lookup(uint64_t h) const {
    auto it = by_hash_.find(h);
    return it == by_hash_.end() ? -1 : it->second;
  }

  std::vector<KvEvent> take_events();
  // Every cached block's hash (one entry per cached block).
  std::vector<uint64_t> cached_hashes() const;
  size_t cached_count() const { return hash_of_.size(); }

 private:
  void unlink(int32_t b);
  void push_back(int32_t b);
  void push_front(int32_t b);
  void evict(int32_t b);
  void emit(KvEvent::Kind kind, uint64_t h);

  int64_t block_size_;
  std::vector<int32_t> ref_;
  std::vector<int32_t> prev_, next_;  // the free queue: a doubly linked list over block ids
  std::vector<uint8_t> in_queue_;
  int32_t head_ = -1, tail_ = -1;
  int64_t free_count_ = 0;
  std::unordered_map<int32_t, uint64_t> hash_of_;  // cached block -> its hash
  std::unordered_multimap<uint64_t, int32_t> by_hash_;  // hash -> cached blocks (vLLM may hold duplicates)
  std::vector<KvEvent> events_;
};

}  // namespace bea

// KV block accounting for one KV-cache group, as a count model of vLLM's KVCacheManager and
// BlockPool (v1/core/kv_cache_manager.py, block_pool.py; vllm-scheduler-replay.md §7): the free
// pool, the blocks each request holds, and the prefix-cache bookkeeping of blocks a freed
// request leaves cached at the back of the free queue. The scheduler decides who runs; this
// piece only answers "do the blocks fit" and keeps the counts.
#pragma once

#include <algorithm>
#include <cstdint>

#include "bea/core/snapshot.h"

namespace bea {

inline int64_t ceil_div(int64_t a, int64_t b) { return a <= 0 ? 0 : (a + b - 1) / b; }

// Token ↔ block arithmetic for one block size; shifts and masks when it is a power of two (the
// usual case), divisions otherwise. Same results either way.
class BlockMath {
 public:
  explicit BlockMath(int64_t block_size) : B_(block_size) {
    if (B_ > 0 && (B_ & (B_ - 1)) == 0) {
      shift_ = 0;
      while ((int64_t{1} << shift_) < B_) ++shift_;
    }
  }
  int64_t size() const { return B_; }
  // Blocks that hold `tokens` tokens (0 for none).
  int64_t ceil(int64_t tokens) const {
    if (tokens <= 0) return 0;
    return shift_ >= 0 ? (tokens + B_ - 1) >> shift_ : (tokens + B_ - 1) / B_;
  }
  // Full blocks among `tokens` >= 0 tokens.
  int64_t floor(int64_t tokens) const { return shift_ >= 0 ? tokens >> shift_ : tokens / B_; }
  // `x` mod B in [0, B), for any sign of x.
  int64_t residue(int64_t x) const { return shift_ >= 0 ? x & (B_ - 1) : ((x % B_) + B_) % B_; }

 private:
  int64_t B_;
  int shift_ = -1;  // log2(B) when B is a power of two
};

// The blocks one request holds (vLLM: req_to_blocks and the blocks' ref counts).
struct RequestBlocks {  // trivial, like the request record that holds it (request.h)
  int64_t held;       // KV blocks held
  int64_t exclusive;  // blocks whose ref count is 1: returned to the pool when freed
  // A request freed during the replay (preempted) leaves its full blocks cached in the free
  // queue; blocks taken from the queue's front afterwards evict them tail first.
  int64_t cached;       // full blocks left cached when freed
  int64_t cache_ahead;  // free blocks ahead of them at that time
  int64_t cache_mark;   // the pool's allocation count at that time
};

// Where a waiting request's prefill starts (get_computed_blocks, §7.3).
struct PrefixHit {
  int64_t tokens = 0;     // block-aligned tokens found in the cache
  int64_t blocks = 0;     // their blocks (tokens / block size)
  int64_t evictable = 0;  // of those, blocks sitting in the free queue (taking them costs free blocks)
};

class KvCache {
 public:
  explicit KvCache(const Config& cfg)
      : blocks_(cfg.block_size),
        block_size_(cfg.block_size),
        max_model_len_(cfg.max_model_len),
        prefix_caching_(cfg.enable_prefix_caching) {}

  void reset(int64_t free_blocks) {
    free_ = free_blocks;
    allocated_ = 0;
  }
  int64_t free_blocks() const { return free_; }
  // The free count of a block-level ledger that keeps the real blocks (block_ledger.h).
  void set_free(int64_t free_blocks) { free_ = free_blocks; }
  int64_t block_size() const { return block_size_; }
  int64_t blocks_for(int64_t tokens) const { return blocks_.ceil(tokens); }
  const BlockMath& block_math() const { return blocks_; }

  // allocate_slots for a running request with `computed` tokens that schedules `n` more: the
  // blocks its new tokens need (slots capped at max_model_len). False, nothing taken, when the
  // free pool is short.
  bool allocate_slots(RequestBlocks& b, int64_t computed, int64_t n) {
    if (computed + n <= b.held * block_size_) return true;  // fits the blocks it holds (no division)
    const int64_t need = blocks_for(std::min(computed + n, max_model_len_)) - b.held;
    if (need <= 0) return true;
    if (need > free_) return false;
    allocate(b, need);
    return true;
  }
  // Take `k` blocks from the free pool for `b` (the caller checked that they are free).
  void allocate(RequestBlocks& b, int64_t k) {
    free_ -= k;
    b.held += k;
    b.exclusive += k;
    allocated_ += k;
  }
  // Take `k` blocks for holders that keep their own counts (the fast path's decode group).
  void allocate_untracked(int64_t k) {
    free_ -= k;
    allocated_ += k;
  }
  // A waiting request is admitted: `fresh` blocks from the pool, `total` held in all (the
  // prefix hit's blocks, shared with their other holders, included).
  void allocate_admitted(RequestBlocks& b, int64_t fresh, int64_t total) {
    b.held = 0;
    b.exclusive = 0;
    allocate(b, fresh);
    b.held = std::max(total, b.held);
    b.cached = 0;
  }

  // A preempted request returns its exclusive blocks. With prefix caching its hashed (full,
  // final-token) blocks among the first `computed` of `num_tokens` stay cached (§7.6).
  void free_preempted(RequestBlocks& b, int64_t computed, int64_t num_tokens) {
    if (prefix_caching_) {
      b.cached = std::min(b.held, blocks_.floor(std::min(computed, num_tokens)));
      b.cache_ahead = free_;
      b.cache_mark = allocated_;
    }
    release(b);
  }
  // A finished (or aborted) request returns its exclusive blocks. It never waits again, so the
  // prefix-cache model records nothing for it (a running request has nothing cached anyway:
  // admission clears it).
  void free_finished(RequestBlocks& b) { release(b); }

  // The prefix-cache hit of a waiting request with `num_tokens` tokens (at least one is
  // recomputed): its own blocks left cached when this replay preempted it, minus those evicted
  // since; else the hit the snapshot reported (`reported_tokens`, held by running requests).
  PrefixHit computed_blocks(const RequestBlocks& b, int64_t num_tokens, int64_t reported_tokens) const {
    PrefixHit h;
    if (!prefix_caching_) return h;
    const int64_t cap_blocks = blocks_.floor(num_tokens - 1);
    if (b.cached > 0) {
      const int64_t evicted = std::max<int64_t>(0, (allocated_ - b.cache_mark) - b.cache_ahead);
      const int64_t hb = std::min(std::max<int64_t>(0, b.cached - evicted), cap_blocks);
      h.blocks = hb;
      h.tokens = hb * block_size_;
      h.evictable = hb;
      return h;
    }
    h.blocks = std::min(blocks_.floor(reported_tokens), cap_blocks);
    h.tokens = h.blocks * block_size_;
    return h;
  }

 private:
  void release(RequestBlocks& b) {
    free_ += b.exclusive;
    b.held = 0;
    b.exclusive = 0;
  }

  BlockMath blocks_;
  int64_t block_size_;
  int64_t max_model_len_;
  bool prefix_caching_;
  int64_t free_ = 0;
  int64_t allocated_ = 0;  // blocks taken from the pool so far: the eviction clock of cached blocks
};

}  // namespace bea

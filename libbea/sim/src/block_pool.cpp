#include "bea/sim/block_pool.h"

#include <stdexcept>

namespace bea {

BlockPool::BlockPool(int64_t num_blocks, int64_t block_size)
    : block_size_(block_size),
      ref_(static_cast<size_t>(num_blocks), 0),
      prev_(static_cast<size_t>(num_blocks), -1),
      next_(static_cast<size_t>(num_blocks), -1),
      in_queue_(static_cast<size_t>(num_blocks), 0) {
  if (num_blocks < 1 || block_size < 1) throw std::invalid_argument("block pool: num_blocks and block_size must be >= 1");
  for (int32_t b = 1; b < static_cast<int32_t>(num_blocks); ++b) push_back(b);  // block 0: the null block
}

void BlockPool::unlink(int32_t b) {
  const int32_t p = prev_[b], n = next_[b];
  (p >= 0 ? next_[p] : head_) = n;
  (n >= 0 ? prev_[n] : tail_) = p;
  prev_[b] = next_[b] = -1;
  in_queue_[b] = 0;
  --free_count_;
}

void BlockPool::push_back(int32_t b) {
  prev_[b] = tail_;
  next_[b] = -1;
  (tail_ >= 0 ? next_[tail_] : head_) = b;
  tail_ = b;
  in_queue_[b] = 1;
  ++free_count_;
}

void BlockPool::push_front(int32_t b) {
  next_[b] = head_;
  prev_[b] = -1;
  (head_ >= 0 ? prev_[head_] : tail_) = b;
  head_ = b;
  in_queue_[b] = 1;
  ++free_count_;
}

void BlockPool::emit(KvEvent::Kind kind, uint64_t h) {
  if (!events_.empty() && events_.back().kind == kind) {
    events_.back().hashes.push_back(h);
    return;
  }
  events_.push_back(KvEvent{kind, {h}});
}

void BlockPool::evict(int32_t b) {
  auto it = hash_of_.find(b);
  if (it == hash_of_.end()) return;
  const uint64_t h = it->second;
  auto range = by_hash_.equal_range(h);
  for (auto r = range.first; r != range.second; ++r)
    if (r->second == b) {
      by_hash_.erase(r);
      break;
    }
  hash_of_.erase(it);
  emit(KvEvent::Removed, h);
}

int64_t BlockPool::find_hit(const std::vector<uint64_t>& hashes, int64_t max_blocks, std::vector<int32_t>& out) const {
  int64_t evictable = 0;
  const int64_t n = std::min<int64_t>(max_blocks, static_cast<int64_t>(hashes.size()));
  for (int64_t k = 0; k < n; ++k) {
    auto it = by_hash_.find(hashes[static_cast<size_t>(k)]);  // vLLM: the first block cached under the hash
    if (it == by_hash_.end()) break;
    out.push_back(it->second);
    if (ref_[it->second] == 0) ++evictable;
  }
  return evictable;
}

void BlockPool::touch(const std::vector<int32_t>& blocks) {
  for (int32_t b : blocks) {
    if (ref_[b] == 0 && in_queue_[b]) unlink(b);
    ++ref_[b];
  }
}

void BlockPool::take_new(int64_t n, std::vector<int32_t>& out) {
  if (n > free_count_) throw std::logic_error("block pool: more blocks taken than are free");
  for (int64_t k = 0; k < n; ++k) {
    const int32_t b = head_;
    unlink(b);
    evict(b);
    ref_[b] = 1;
    out.push_back(b);
  }
}

void BlockPool::cache(const std::vector<int32_t>& blocks, const std::vector<uint64_t>& hashes, int64_t first,
                      int64_t last) {
  last = std::min<int64_t>(last, std::min<int64_t>(static_cast<int64_t>(blocks.size()),
                                                   static_cast<int64_t>(hashes.size())));
  for (int64_t k = std::max<int64_t>(first, 0); k < last; ++k) {
    const int32_t b = blocks[static_cast<size_t>(k)];
    if (b == 0 || hash_of_.count(b)) continue;
    const uint64_t h = hashes[static_cast<size_t>(k)];
    hash_of_.emplace(b, h);
    by_hash_.emplace(h, b);
    emit(KvEvent::Stored, h);
  }
}

void BlockPool::release(const std::vector<int32_t>& blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t b = *it;
    if (b == 0) continue;
    if (--ref_[b] > 0) continue;
    if (hash_of_.count(b)) {
      push_back(b);  // cached: evicted after everything freed before it
    } else {
      push_front(b);  // nothing to keep: reused first
    }
  }
}

std::vector<int32_t> BlockPool::free_queue() const {
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(free_count_));
  for (int32_t b = head_; b >= 0; b = next_[static_cast<size_t>(b)]) out.push_back(b);
  return out;
}

std::vector<KvEvent> BlockPool::take_events() {
  std::vector<KvEvent> out;
  out.swap(events_);
  return out;
}

std::vector<uint64_t> BlockPool::cached_hashes() const {
  std::vector<uint64_t> out;
  out.reserve(hash_of_.size());
  for (const auto& [b, h] : hash_of_) out.push_back(h);
  return out;
}

}  // namespace bea

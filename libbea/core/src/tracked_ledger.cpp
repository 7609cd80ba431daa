#include "bea/core/tracked_ledger.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace bea {
namespace {
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
}

TrackedLedger::TrackedLedger(const Prepared& p)
    : table_size_(p.tracked_pos.size()), block_size_(p.cfg.block_size), free_(p.free_blocks), low_(kNone) {
  blocks_.resize(p.tracked_pos.size());
  for (size_t t = 0; t < p.tracked_pos.size(); ++t) {
    Block& b = blocks_[t];
    if (p.tracked_pos[t] >= 0) {  // a free block is a cached one (else no hit could name it)
      b.abs = p.tracked_pos[t];
      b.queued = b.cached = true;
      low_ = std::min(low_, b.abs);
    }
    if (t < p.tracked_keys.size()) b.key = p.tracked_keys[t];  // found by any hit that names it
  }
  reqs_.resize(p.reqs.size());
  for (size_t k = 0; k < p.reqs.size(); ++k) {  // blocks learn their keys from whoever lists them
    const auto& keys = p.keys[k];
    const auto& list = p.chains[k];
    for (size_t j = 0; j < list.size() && j < keys.size(); ++j) {
      Block& b = blocks_[static_cast<size_t>(list[j])];
      if (b.key < 0) b.key = keys[j];
    }
  }
  for (size_t t = 0; t < blocks_.size(); ++t)
    if (blocks_[t].cached && blocks_[t].key >= 0) by_key_[blocks_[t].key].push_back(static_cast<int32_t>(t));
  for (size_t k = 0; k < p.reqs.size(); ++k) {
    const Prepared::Req& r = p.reqs[k];
    Holder& h = reqs_[k];
    h.reported = r.hit;
    h.keys = p.keys[k];
    h.has_chain = p.has_chain[k] != 0;
    if (k >= p.n_running) {
      if (h.has_chain) h.chain = p.chains[k];
      continue;
    }
    h.tracked = p.chains[k];
    h.held = r.kv.held;
    h.own = h.held - static_cast<int64_t>(h.tracked.size());
    for (int32_t t : h.tracked) ++blocks_[static_cast<size_t>(t)].ref;
    computed(static_cast<int32_t>(k), std::min(r.C, r.P + r.O));
  }
  for (Block& b : blocks_)
    if (!b.queued && b.ref == 0) b.ref = 1;  // held by a request the snapshot does not list: kept
}

TrackedLedger::Holder& TrackedLedger::at(int32_t req) {
  if (req < 0) throw std::logic_error("tracked ledger: bad request index");
  if (static_cast<size_t>(req) >= reqs_.size()) reqs_.resize(static_cast<size_t>(req) + 1);
  return reqs_[static_cast<size_t>(req)];
}

void TrackedLedger::add_request(int32_t req, int64_t reported_hit_tokens,
                                const std::optional<std::vector<int32_t>>& chain, const std::vector<int64_t>& keys,
                                const std::string& field) {
  Holder& h = at(req);
  h.reported = reported_hit_tokens;
  h.keys = keys;
  h.has_chain = chain.has_value() || !keys.empty();
  if (!chain) return;
  for (size_t j = 0; j < chain->size(); ++j)
    if ((*chain)[j] < 0 || static_cast<size_t>((*chain)[j]) >= table_size_)
      throw std::invalid_argument(field + "[" + std::to_string(j) + "]: not an index into the snapshot's tracked_blocks");
  h.chain = *chain;
  for (size_t j = 0; j < h.chain.size() && j < keys.size(); ++j) {
    const int32_t t = h.chain[j];
    if (blocks_[static_cast<size_t>(t)].key >= 0) continue;
    blocks_[static_cast<size_t>(t)].key = keys[j];
    if (blocks_[static_cast<size_t>(t)].cached && blocks_[static_cast<size_t>(t)].alive) by_key_[keys[j]].push_back(t);
  }
}

int32_t TrackedLedger::lookup(int64_t key) const {
  auto it = by_key_.find(key);
  return it == by_key_.end() || it->second.empty() ? -1 : it->second.front();
}

PrefixHit TrackedLedger::walk(const Holder& h, int64_t num_tokens, int64_t& phantom,
                              std::vector<int32_t>* blocks) const {
  PrefixHit out;
  const int64_t cap = num_tokens <= 0 ? 0 : (num_tokens - 1) / block_size_;
  phantom = std::min(h.has_chain ? h.phantom : h.reported / block_size_, cap);
  int64_t n = phantom;
  for (; n < cap; ++n) {
    int32_t t = n < static_cast<int64_t>(h.keys.size()) ? lookup(h.keys[static_cast<size_t>(n)]) : -1;
    const auto j = static_cast<size_t>(n - phantom);
    if (t < 0 && j < h.chain.size()) {
      const Block& c = blocks_[static_cast<size_t>(h.chain[j])];
      if (c.alive && c.cached) t = h.chain[j];
    }
    if (t < 0) break;
    if (blocks_[static_cast<size_t>(t)].ref == 0) ++out.evictable;
    if (blocks != nullptr) blocks->push_back(t);
  }
  out.blocks = n;
  out.tokens = n * block_size_;
  return out;
}

PrefixHit TrackedLedger::hit(int32_t req, int64_t num_tokens) const {
  static const Holder none;
  const Holder& h = req >= 0 && static_cast<size_t>(req) < reqs_.size() ? reqs_[static_cast<size_t>(req)] : none;
  int64_t phantom = 0;
  return walk(h, num_tokens, phantom, nullptr);
}

void TrackedLedger::admitted(int32_t req, int64_t num_tokens, int64_t total_blocks) {
  Holder& h = at(req);
  if (h.held != 0) throw std::logic_error("tracked ledger: admitted while holding blocks");
  int64_t phantom = 0;
  std::vector<int32_t> found;
  const PrefixHit hit = walk(h, num_tokens, phantom, &found);
  for (int32_t t : found) {  // touch: free hit blocks leave the queue
    if (blocks_[static_cast<size_t>(t)].ref == 0) unqueue(t);
    ++blocks_[static_cast<size_t>(t)].ref;
  }
  h.tracked = std::move(found);
  h.chain.clear();
  h.phantom = phantom;
  h.has_chain = true;  // a later hit is the chain its preemption leaves
  h.own = 0;
  h.held = hit.blocks;
  h.full = hit.blocks;
  grew(req, total_blocks);
}

void TrackedLedger::grew(int32_t req, int64_t held_blocks) {
  Holder& h = at(req);
  const int64_t n = held_blocks - h.held;
  if (n <= 0) return;
  pop(n);
  h.own += n;
  h.held = held_blocks;
}

void TrackedLedger::computed(int32_t req, int64_t tokens) {
  Holder& h = at(req);
  const int64_t full = std::min(h.held, std::max<int64_t>(0, tokens) / block_size_);
  if (full <= h.full) return;
  const auto n_keys = static_cast<int64_t>(h.keys.size());
  for (size_t j = 0; j < h.tracked.size(); ++j) {
    const int64_t pos = h.phantom + static_cast<int64_t>(j);
    if (pos >= h.full && pos < full) cache(h.tracked[j], pos < n_keys ? h.keys[static_cast<size_t>(pos)] : -1);
  }
  // Its own blocks computed under a key become tracked blocks: a later hit can name them.
  for (int64_t pos = h.phantom + static_cast<int64_t>(h.tracked.size()); pos < std::min(full, n_keys) && h.own > 0;
       ++pos) {
    const int32_t t = add_block();
    blocks_[static_cast<size_t>(t)].ref = 1;
    cache(t, h.keys[static_cast<size_t>(pos)]);
    h.tracked.push_back(t);
    --h.own;
  }
  h.full = full;
}

void TrackedLedger::released(int32_t req, bool preempted) {
  Holder& h = at(req);
  // vLLM frees a request's blocks last first: uncached ones go to the front, cached ones to the back.
  const int64_t first_own = h.phantom + static_cast<int64_t>(h.tracked.size());
  const int64_t own_cached = std::clamp<int64_t>(h.full - first_own, 0, h.own);
  prepend(h.own - own_cached);
  std::vector<int32_t> fresh;  // a preempted request's cached own blocks, last first
  if (preempted) {
    fresh.reserve(static_cast<size_t>(own_cached));
    for (int64_t k = 0; k < own_cached; ++k) {
      const int32_t t = add_block();
      blocks_[static_cast<size_t>(t)].cached = true;
      append(t);
      fresh.push_back(t);
    }
  } else {
    free_ += own_cached;  // at the back, untracked: nobody's hit
  }
  for (auto it = h.tracked.rbegin(); it != h.tracked.rend(); ++it) {
    Block& b = blocks_[static_cast<size_t>(*it)];
    if (--b.ref > 0) continue;
    if (b.cached) {
      append(*it);
    } else {
      prepend(1);
      b.alive = false;  // uncached: no hit can name it again
    }
  }
  if (preempted) {
    h.chain = h.tracked;
    h.chain.insert(h.chain.end(), fresh.rbegin(), fresh.rend());
    h.has_chain = true;
  } else {
    h.chain.clear();
  }
  h.tracked.clear();
  h.own = h.held = h.full = 0;
}

void TrackedLedger::cache(int32_t t, int64_t key) {
  Block& b = blocks_[static_cast<size_t>(t)];
  if (b.cached || !b.alive) return;
  b.cached = true;
  if (b.key < 0) b.key = key;
  if (b.key >= 0) by_key_[b.key].push_back(t);
}

void TrackedLedger::forget(int32_t t) {
  Block& b = blocks_[static_cast<size_t>(t)];
  b.alive = false;
  b.queued = false;
  if (b.key < 0 || !b.cached) return;
  auto it = by_key_.find(b.key);
  if (it == by_key_.end()) return;
  auto& v = it->second;
  v.erase(std::remove(v.begin(), v.end(), t), v.end());
}

void TrackedLedger::unqueue(int32_t t) {
  Block& b = blocks_[static_cast<size_t>(t)];
  for (Block& u : blocks_)
    if (u.queued && u.abs > b.abs) --u.abs;  // those behind it move up
  b.queued = false;
  --free_;
}

void TrackedLedger::pop(int64_t n) {
  if (n > free_) throw std::logic_error("tracked ledger: more blocks taken than are free");
  free_ -= n;
  base_ += n;
  if (base_ <= low_) return;
  low_ = kNone;
  for (size_t t = 0; t < blocks_.size(); ++t) {
    const Block& b = blocks_[t];
    if (!b.queued) continue;
    if (b.abs < base_) forget(static_cast<int32_t>(t));  // popped: reused, its hash evicted
    else low_ = std::min(low_, b.abs);
  }
}

void TrackedLedger::prepend(int64_t n) {
  base_ -= n;
  free_ += n;
}

int32_t TrackedLedger::add_block() {
  blocks_.emplace_back();
  return static_cast<int32_t>(blocks_.size() - 1);
}

void TrackedLedger::append(int32_t t) {
  Block& b = blocks_[static_cast<size_t>(t)];
  b.abs = base_ + free_;
  b.queued = true;
  low_ = std::min(low_, b.abs);
  ++free_;
}

}  // namespace bea

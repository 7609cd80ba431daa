#include "bea/core/tracked_ledger.h"

#include <algorithm>
#include <stdexcept>

namespace bea {
namespace {
// What the ledger counts computed for running request `r` at the snapshot.
int64_t computed_at_start(const Prepared::Req& r) { return std::min(r.C, r.P + r.O); }
}  // namespace

TrackedLedger::TrackedLedger(const Prepared& p) : block_size_(p.cfg.block_size) {
  const std::shared_ptr<const TrackedTable>& t = p.table;
  if (!t) throw std::logic_error("tracked ledger: the prepared form has no table");
  bool same = t->started && t->computed.size() == p.n_running && t->holders.size() <= p.reqs.size();
  for (size_t k = 0; same && k < p.n_running; ++k) same = t->computed[k] == computed_at_start(p.reqs[k]);
  if (!same) {  // a draw whose lengths cut a running request short of what the start computed
    *this = TrackedLedger(p, *t);
    return;
  }
  table_ = t;
  n_start_ = t->blocks.size();
  slot_.assign(n_start_, -1);
  reqs_ = t->holders;
  reqs_.resize(p.reqs.size());
  table_size_ = t->pos.size();
  free_ = t->free;
  end_ = t->end;
}

TrackedLedger::TrackedLedger(const Prepared& p, const TrackedTable& in)
    : table_size_(in.pos.size()), block_size_(p.cfg.block_size), free_(p.free_blocks), end_(p.free_blocks) {
  extra_.resize(in.pos.size());
  for (size_t t = 0; t < in.pos.size(); ++t) {
    Block& b = extra_[t];
    if (in.pos[t] >= 0) {  // a free block is a cached one (else no hit could name it)
      b.abs = in.pos[t];
      b.queued = b.cached = true;
      tail_.emplace_back(b.abs, static_cast<int32_t>(t));
    }
    if (t < in.keys.size()) b.key = in.keys[t];  // found by any hit that names it
  }
  std::sort(tail_.begin(), tail_.end());
  reqs_.resize(p.reqs.size());
  for (size_t k = 0; k < p.reqs.size(); ++k) {  // blocks learn their keys from whoever lists them
    const auto& keys = in.req_keys[k];
    const auto& list = in.chains[k];
    for (size_t j = 0; j < list.size() && j < keys.size(); ++j) {
      Block& b = extra_[static_cast<size_t>(list[j])];
      if (b.key < 0) b.key = keys[j];
    }
  }
  building_ = true;  // cached blocks go to index_, sorted once at the end
  for (size_t t = 0; t < extra_.size(); ++t)
    if (extra_[t].cached && extra_[t].key >= 0) index_.emplace_back(extra_[t].key, static_cast<int32_t>(t));
  for (size_t k = 0; k < p.reqs.size(); ++k) {
    const Prepared::Req& r = p.reqs[k];
    Holder& h = reqs_[k];
    h.reported = r.hit;
    h.keys = in.req_keys[k];
    h.has_chain = in.has_chain[k] != 0;
    if (k >= p.n_running) {
      if (h.has_chain) h.chain = in.chains[k];
      continue;
    }
    h.tracked = in.chains[k];
    h.held = r.kv.held;
    h.own = h.held - static_cast<int64_t>(h.tracked.size());
    for (int32_t t : h.tracked) ++extra_[static_cast<size_t>(t)].ref;
    computed(static_cast<int32_t>(k), computed_at_start(r));
  }
  for (Block& b : extra_)
    if (!b.queued && b.ref == 0) b.ref = 1;  // held by a request the snapshot does not list: kept
  // By key, first cached first: sorted as (key, place in index_) pairs, which orders exactly as a
  // stable sort by key does, at the cost of a plain sort (half a stable sort's at 40,000 entries).
  std::vector<std::pair<int64_t, int32_t>> order(index_.size());
  for (size_t k = 0; k < index_.size(); ++k) order[k] = {index_[k].first, static_cast<int32_t>(k)};
  std::sort(order.begin(), order.end());
  std::vector<Entry> sorted(index_.size());
  for (size_t k = 0; k < order.size(); ++k) sorted[k] = index_[static_cast<size_t>(order[k].second)];
  index_ = std::move(sorted);
  building_ = false;
}

void TrackedLedger::start(TrackedTable& t, const Prepared& p) {
  TrackedLedger l(p, t);
  if (l.base_ != 0 || l.tail_head_ != 0 || !l.holes_.empty() || !l.by_key_.empty())
    throw std::logic_error("tracked ledger: the start moved the free queue");
  t.computed.clear();
  for (size_t k = 0; k < p.n_running; ++k) t.computed.push_back(computed_at_start(p.reqs[k]));
  t.by_key = std::move(l.index_);
  t.blocks = std::move(l.extra_);
  t.holders = std::move(l.reqs_);
  t.queue = std::move(l.tail_);
  t.free = l.free_;
  t.end = l.end_;
  t.started = true;
}

const TrackedBlock& TrackedLedger::blk(int32_t t) const {
  const auto i = static_cast<size_t>(t);
  if (i >= n_start_) return extra_[i - n_start_];
  const int32_t c = slot_[i];
  return c >= 0 ? changed_[static_cast<size_t>(c)] : table_->blocks[i];
}

TrackedBlock& TrackedLedger::mut(int32_t t) {
  const auto i = static_cast<size_t>(t);
  if (i >= n_start_) return extra_[i - n_start_];
  int32_t& c = slot_[i];
  if (c < 0) {
    c = static_cast<int32_t>(changed_.size());
    changed_.push_back(table_->blocks[i]);
  }
  return changed_[static_cast<size_t>(c)];
}

TrackedHolder& TrackedLedger::at(int32_t req) {
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
    if (blk(t).key >= 0) continue;
    Block& b = mut(t);
    b.key = keys[j];
    if (b.cached && b.alive) by_key_[keys[j]].push_back(t);
  }
}

int32_t TrackedLedger::lookup(int64_t key) const {
  // The first cached block under `key` not evicted since: the start's, then the replay's.
  {
    const auto& v = table_ ? table_->by_key : index_;
    auto it = std::lower_bound(v.begin(), v.end(), key, [](const Entry& e, int64_t k) { return e.first < k; });
    for (; it != v.end() && it->first == key; ++it)
      if (blk(it->second).alive) return it->second;
  }
  const auto it = by_key_.find(key);
  if (it != by_key_.end())
    for (int32_t t : it->second)
      if (blk(t).alive) return t;
  return -1;
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
      const Block& c = blk(h.chain[j]);
      if (c.alive && c.cached) t = h.chain[j];
    }
    if (t < 0) break;
    if (blk(t).ref == 0) ++out.evictable;
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
    if (blk(t).ref == 0) unqueue(t);
    ++mut(t).ref;
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
  const auto n_tracked = static_cast<int64_t>(h.tracked.size());
  // its tracked blocks at positions [h.full, full) (position = phantom + index)
  for (int64_t j = std::max<int64_t>(0, h.full - h.phantom); j < std::min(n_tracked, full - h.phantom); ++j) {
    const int64_t pos = h.phantom + j;
    cache(h.tracked[static_cast<size_t>(j)], pos < n_keys ? h.keys[static_cast<size_t>(pos)] : -1);
  }
  // Its own blocks computed under a key become tracked blocks: a later hit can name them.
  for (int64_t pos = h.phantom + n_tracked; pos < std::min(full, n_keys) && h.own > 0; ++pos) {
    const int32_t t = add_block();
    mut(t).ref = 1;
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
      mut(t).cached = true;
      append(t);
      fresh.push_back(t);
    }
  } else {
    free_ += own_cached;  // at the back, untracked: nobody's hit
    end_ += own_cached;
  }
  for (auto it = h.tracked.rbegin(); it != h.tracked.rend(); ++it) {
    Block& b = mut(*it);
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
  const Block& r = blk(t);
  if (r.cached || !r.alive) return;
  Block& b = mut(t);
  b.cached = true;
  if (b.key < 0) b.key = key;
  if (b.key < 0) return;
  if (building_) index_.emplace_back(b.key, t);
  else by_key_[b.key].push_back(t);
}

void TrackedLedger::forget(int32_t t) {
  Block& b = mut(t);
  b.alive = false;  // lookups pass it by from now on
  b.queued = false;
}

void TrackedLedger::unqueue(int32_t t) {
  Block& b = mut(t);
  holes_.insert(b.abs);  // its ordinal stays taken: nobody behind it is renumbered
  b.queued = false;
  --free_;
}

void TrackedLedger::pop(int64_t n) {
  if (n > free_) throw std::logic_error("tracked ledger: more blocks taken than are free");
  free_ -= n;
  int64_t front = base_ + n;  // past n ordinals that are not holes
  while (!holes_.empty() && *holes_.begin() < front) {
    if (*holes_.begin() >= base_) ++front;
    holes_.erase(holes_.begin());
  }
  base_ = front;
  if (table_) evict_before(table_->queue, head_);
  evict_before(tail_, tail_head_);
}

void TrackedLedger::evict_before(const std::vector<Entry>& queue, size_t& head) {
  while (head < queue.size() && queue[head].first < base_) {
    const auto [abs, t] = queue[head++];
    const Block& b = blk(t);
    if (b.queued && b.abs == abs) forget(t);  // popped: reused, its hash evicted (else: an entry it left)
  }
}

void TrackedLedger::prepend(int64_t n) {
  base_ -= n;
  free_ += n;
}

int32_t TrackedLedger::add_block() {
  extra_.emplace_back();
  return static_cast<int32_t>(n_start_ + extra_.size() - 1);
}

void TrackedLedger::append(int32_t t) {
  Block& b = mut(t);
  b.abs = end_++;
  b.queued = true;
  ++free_;
  tail_.emplace_back(b.abs, t);
}

}  // namespace bea

#include "bea/sim/prefix_cache.h"

#include <algorithm>
#include <stdexcept>

namespace bea {

PrefixCache::Held& PrefixCache::at(int32_t req) {
  if (req < 0) throw std::logic_error("prefix cache: bad request index");
  if (static_cast<size_t>(req) >= reqs_.size()) reqs_.resize(static_cast<size_t>(req) + 1);
  return reqs_[static_cast<size_t>(req)];
}

void PrefixCache::add(int32_t req, std::vector<uint64_t> hashes) { at(req).hashes = std::move(hashes); }

PrefixHit PrefixCache::hit(int32_t req, int64_t num_tokens) const {
  PrefixHit h;
  if (req < 0 || static_cast<size_t>(req) >= reqs_.size()) return h;
  const Held& r = reqs_[static_cast<size_t>(req)];
  std::vector<int32_t> found;
  h.evictable = pool_.find_hit(r.hashes, (num_tokens - 1) / pool_.block_size(), found);
  h.blocks = static_cast<int64_t>(found.size());
  h.tokens = h.blocks * pool_.block_size();
  return h;
}

void PrefixCache::admitted(int32_t req, int64_t num_tokens, int64_t total_blocks) {
  Held& r = at(req);
  if (!r.blocks.empty()) throw std::logic_error("prefix cache: admitted while holding blocks");
  pool_.find_hit(r.hashes, (num_tokens - 1) / pool_.block_size(), r.blocks);
  if (r.first_hit < 0) r.first_hit = static_cast<int64_t>(r.blocks.size()) * pool_.block_size();
  pool_.touch(r.blocks);
  r.cached = static_cast<int64_t>(r.blocks.size());
  grew(req, total_blocks);
}

void PrefixCache::grew(int32_t req, int64_t held_blocks) {
  Held& r = at(req);
  const int64_t need = held_blocks - static_cast<int64_t>(r.blocks.size());
  if (need > 0) pool_.take_new(need, r.blocks);
}

void PrefixCache::computed(int32_t req, int64_t tokens) {
  Held& r = at(req);
  const int64_t full = std::min<int64_t>(tokens / pool_.block_size(), static_cast<int64_t>(r.hashes.size()));
  if (full <= r.cached) return;
  pool_.cache(r.blocks, r.hashes, r.cached, full);
  r.cached = std::max(r.cached, std::min<int64_t>(full, static_cast<int64_t>(r.blocks.size())));
}

void PrefixCache::released(int32_t req) {
  Held& r = at(req);
  pool_.release(r.blocks);
  r.blocks.clear();
  r.cached = 0;
}

void PrefixCache::forget(int32_t req) {
  if (req < 0 || static_cast<size_t>(req) >= reqs_.size()) return;
  Held& r = reqs_[static_cast<size_t>(req)];
  std::vector<uint64_t>().swap(r.hashes);
  std::vector<int32_t>().swap(r.blocks);
}

int64_t PrefixCache::first_hit_tokens(int32_t req) const {
  if (req < 0 || static_cast<size_t>(req) >= reqs_.size()) return -1;
  return reqs_[static_cast<size_t>(req)].first_hit;
}

}  // namespace bea

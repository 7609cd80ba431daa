#include "bea/sim/prefix_cache.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

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

void PrefixCache::released(int32_t req, bool /*preempted*/) {
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

BlockTable PrefixCache::table(const std::vector<int32_t>& running, const std::vector<int32_t>& waiting,
                              const std::vector<uint64_t>& query_hashes) const {
  BlockTable out;
  static const Held none;
  auto held = [&](int32_t k) -> const Held& {
    return k >= 0 && static_cast<size_t>(k) < reqs_.size() ? reqs_[static_cast<size_t>(k)] : none;
  };
  std::unordered_map<int32_t, int32_t> index;  // block id -> tracked index
  std::vector<int32_t> ids;                    // tracked index -> block id
  auto mark = [&](int32_t b) {
    auto [it, fresh] = index.emplace(b, static_cast<int32_t>(ids.size()));
    if (fresh) ids.push_back(b);
    return it->second;
  };
  // A hit chain: the cached blocks of the leading hashes, continued by blocks running requests
  // hold but have not computed yet at the same place of the same content (cached once computed).
  auto chain = [&](const std::vector<uint64_t>& hashes, int64_t& hit_blocks) {
    std::vector<int32_t> blocks;
    hit_blocks = 0;
    bool cached_run = true;
    for (size_t k = 0; k < hashes.size(); ++k) {
      int32_t b = pool_.lookup(hashes[k]);
      if (b < 0) {
        cached_run = false;
        for (int32_t r : running) {
          const Held& h = held(r);
          if (h.hashes.size() > k && h.hashes[k] == hashes[k] && h.blocks.size() > k &&
              h.cached <= static_cast<int64_t>(k)) {
            b = h.blocks[k];
            break;
          }
        }
        if (b < 0) break;
      }
      if (cached_run) ++hit_blocks;
      blocks.push_back(b);
    }
    return blocks;
  };
  std::unordered_map<int32_t, std::vector<int32_t>> chain_blocks;
  for (int32_t w : waiting) {
    int64_t hb = 0;
    chain_blocks[w] = chain(held(w).hashes, hb);
    out.hit_tokens[w] = hb * pool_.block_size();
    for (int32_t b : chain_blocks[w]) mark(b);
  }
  int64_t qhb = 0;
  const std::vector<int32_t> qblocks = chain(query_hashes, qhb);
  out.query_hit_tokens = qhb * pool_.block_size();
  for (int32_t b : qblocks) mark(b);
  for (int32_t r : running)
    for (int32_t b : held(r).blocks)
      if (pool_.ref(b) > 1) mark(b);
  // Closed under "a running request's blocks ahead of a tracked one" (a holder's tracked blocks
  // are its leading blocks).
  for (bool grew = true; grew;) {
    grew = false;
    for (int32_t r : running) {
      const auto& blocks = held(r).blocks;
      size_t last = 0;
      for (size_t j = 0; j < blocks.size(); ++j)
        if (index.count(blocks[j])) last = j + 1;
      for (size_t j = 0; j < last; ++j)
        if (!index.count(blocks[j])) {
          mark(blocks[j]);
          grew = true;
        }
    }
  }
  std::unordered_map<int32_t, int64_t> position;
  const std::vector<int32_t> queue = pool_.free_queue();
  for (size_t k = 0; k < queue.size(); ++k) position.emplace(queue[k], static_cast<int64_t>(k));
  out.positions.reserve(ids.size());
  for (int32_t b : ids) {
    auto it = position.find(b);
    out.positions.push_back(it == position.end() ? -1 : it->second);
  }
  for (int32_t r : running) {
    const auto& blocks = held(r).blocks;
    std::vector<int32_t> t;
    for (int32_t b : blocks) {
      auto it = index.find(b);
      if (it == index.end()) break;
      t.push_back(it->second);
    }
    out.tracked[r] = std::move(t);
  }
  for (const auto& [w, blocks] : chain_blocks) {
    std::vector<int32_t> c;
    c.reserve(blocks.size());
    for (int32_t b : blocks) c.push_back(index.at(b));
    out.chains[w] = std::move(c);
  }
  for (int32_t b : qblocks) out.query_chain.push_back(index.at(b));
  // Keys: hashes cached now or in more than one request's list.
  std::unordered_map<uint64_t, int32_t> users;
  auto count = [&](const std::vector<uint64_t>& hs) {
    for (uint64_t h : hs) ++users[h];
  };
  for (int32_t r : running) count(held(r).hashes);
  for (int32_t w : waiting) count(held(w).hashes);
  count(query_hashes);
  std::unordered_map<uint64_t, int64_t> key_of;
  auto keys = [&](const std::vector<uint64_t>& hs) {
    std::vector<int64_t> ks;
    for (uint64_t h : hs) {
      if (users[h] < 2 && pool_.lookup(h) < 0) break;
      ks.push_back(key_of.emplace(h, static_cast<int64_t>(key_of.size())).first->second);
    }
    return ks;
  };
  for (int32_t r : running) out.keys[r] = keys(held(r).hashes);
  for (int32_t w : waiting) out.keys[w] = keys(held(w).hashes);
  out.query_keys = keys(query_hashes);
  return out;
}

int64_t PrefixCache::first_hit_tokens(int32_t req) const {
  if (req < 0 || static_cast<size_t>(req) >= reqs_.size()) return -1;
  return reqs_[static_cast<size_t>(req)].first_hit;
}

}  // namespace bea

// vLLM's prefix-cache block hashes (vllm/v1/core/kv_cache_utils.py: hash_block_tokens), computed
// from token ids: block k's digest is H((parent, tuple(block_k_tokens), None)), the parent of
// block 0 being NONE_HASH. H is SHA-256 over the object's pickle (protocol 5, as CPython's
// pickle writes it) or over its canonical CBOR; both serialisations are written here byte for
// byte (bear.prefix.hashing holds the Python reference and the golden tests compare the two).
// A block's name in KV events is the digest's low 64 bits, big-endian.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "bea/prefix/sha256.h"

namespace bea::prefix {

enum class Algo { kSha256Pickle, kSha256Cbor };

Algo algo_from_name(const std::string& name);  // "sha256" | "sha256_cbor"; std::invalid_argument otherwise
uint64_t external_name(const Digest& d);

// The largest block size whose pickle fits one pickle frame (CPython splits frames at 64 KiB).
constexpr int kMaxBlockSize = 8192;

// The serialisation of (parent, tuple(tokens), None) that H hashes, appended to `out`.
void serialize_block(Algo algo, const Digest& parent, const uint32_t* tokens, size_t n, std::vector<uint8_t>& out);
Digest hash_block(Algo algo, const Digest& parent, const uint32_t* tokens, size_t n);

// The block-hash chain under one (algo, block size, NONE_HASH), with a bounded memo of links
// already computed (keyed by the parent digest and the block's tokens: exact, nothing guessed).
// Thread-safe: the memo is guarded by a mutex.
class BlockHasher {
 public:
  BlockHasher(Algo algo, int block_size, const Digest& none_hash, size_t memo_capacity);

  // Digests and names of blocks [first, first + count) of `tokens` (only full blocks: count is
  // cut to what `n_tokens` holds), block `first`'s parent being `parent`. Returns how many.
  size_t chain(const uint32_t* tokens, size_t n_tokens, size_t first, size_t count, const Digest& parent,
               std::vector<Digest>* digests, std::vector<uint64_t>* names);

  // The chain of `tokens` from NONE_HASH, block by block, for at most `max_blocks` blocks, until
  // `more(name)` returns false (that block counted): how many blocks were visited. The blocks a
  // recent walk shared are copied from it (the longest common run of token ids with one of the
  // kRecentWalks last prompts, compared directly), the rest come from the memo or are hashed;
  // the walk is then kept as a recent one. `more` runs with the hasher's mutex held.
  template <class More>
  size_t walk(const uint32_t* tokens, size_t n_tokens, size_t max_blocks, More&& more);
  static constexpr size_t kRecentWalks = 8;
  int block_size() const { return block_size_; }
  const Digest& none_hash() const { return none_hash_; }
  size_t memo_size() const;
  uint64_t memo_hits() const { return memo_hits_; }

 private:
  struct Link {
    Digest digest;
    uint64_t name;
  };
  struct Recent {  // a walk: its prompt's leading token ids, one link per block visited
    std::vector<uint32_t> tokens;
    std::vector<Link> links;
  };
  Link link_of(const Digest& parent, const uint32_t* block, std::string& key, std::vector<uint8_t>& buf);  // mu_ held
  size_t shared_blocks(const uint32_t* tokens, size_t blocks, size_t* which) const;  // mu_ held
  void keep_recent(const uint32_t* tokens, size_t blocks, std::vector<Link>&& links, size_t from, size_t shared);
  std::vector<Recent> recent_;  // newest first
  Algo algo_;
  int block_size_;
  Digest none_hash_;
  size_t capacity_;
  mutable std::mutex mu_;
  // key: parent digest ++ block tokens (little-endian bytes)
  std::unordered_map<std::string, Link> memo_;
  uint64_t memo_hits_ = 0;
};

template <class More>
size_t BlockHasher::walk(const uint32_t* tokens, size_t n_tokens, size_t max_blocks, More&& more) {
  const size_t b = static_cast<size_t>(block_size_);
  const size_t full = std::min(n_tokens / b, max_blocks);
  std::lock_guard<std::mutex> lock(mu_);
  size_t from = 0;
  const size_t shared = shared_blocks(tokens, full, &from);
  std::vector<Link> links;
  links.reserve(full);
  std::string key(32 + 4 * b, '\0');
  std::vector<uint8_t> buf;
  Digest cur = none_hash_;
  size_t k = 0;
  while (k < full) {
    const Link link = k < shared ? recent_[from].links[k] : link_of(cur, tokens + k * b, key, buf);
    links.push_back(link);
    cur = link.digest;
    ++k;
    if (!more(link.name)) break;
  }
  keep_recent(tokens, k, std::move(links), from, std::min(shared, k));
  return k;
}

}  // namespace bea::prefix

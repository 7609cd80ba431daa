// vLLM's prefix-cache block hashes (vllm/v1/core/kv_cache_utils.py: hash_block_tokens), computed
// from token ids: block k's digest is H((parent, tuple(block_k_tokens), None)), the parent of
// block 0 being NONE_HASH. H is SHA-256 over the object's pickle (protocol 5, as CPython's
// pickle writes it) or over its canonical CBOR; both serialisations are written here byte for
// byte (bear.prefix.hashing holds the Python reference and the golden tests compare the two).
// A block's name in KV events is the digest's low 64 bits, big-endian.
#pragma once

#include <cstddef>
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

  int block_size() const { return block_size_; }
  const Digest& none_hash() const { return none_hash_; }
  size_t memo_size() const;
  uint64_t memo_hits() const { return memo_hits_; }

 private:
  struct Link {
    Digest digest;
    uint64_t name;
  };
  Algo algo_;
  int block_size_;
  Digest none_hash_;
  size_t capacity_;
  mutable std::mutex mu_;
  // key: parent digest ++ block tokens (little-endian bytes)
  std::unordered_map<std::string, Link> memo_;
  uint64_t memo_hits_ = 0;
};

}  // namespace bea::prefix

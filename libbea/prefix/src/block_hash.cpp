// The two serialisations vLLM hashes a block as, written byte for byte:
//   pickle (protocol 5, CPython's C pickler): PROTO 5, one FRAME, SHORT_BINBYTES parent MEMOIZE,
//     the token tuple (TUPLE1..3, or MARK … TUPLE past three items) MEMOIZE, NONE, TUPLE3 MEMOIZE,
//     STOP; ints as BININT1 / BININT2 / BININT, or LONG1 of five bytes from 2^31 up;
//   canonical CBOR: array(3) [bytes(32), array(n) of unsigned ints in their shortest form, null].
#include "bea/prefix/block_hash.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace bea::prefix {
namespace {

void put_le(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int k = 0; k < bytes; ++k) out.push_back(static_cast<uint8_t>(v >> (8 * k)));
}

void put_be(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int k = bytes - 1; k >= 0; --k) out.push_back(static_cast<uint8_t>(v >> (8 * k)));
}

void pickle_block(const Digest& parent, const uint32_t* tokens, size_t n, std::vector<uint8_t>& out) {
  const size_t start = out.size();
  out.push_back(0x80);  // PROTO
  out.push_back(5);
  out.push_back(0x95);  // FRAME, length patched below
  put_le(out, 0, 8);
  const size_t body = out.size();
  out.push_back('C');  // SHORT_BINBYTES
  out.push_back(32);
  out.insert(out.end(), parent.begin(), parent.end());
  out.push_back(0x94);  // MEMOIZE
  if (n == 0) {
    out.push_back(')');  // EMPTY_TUPLE (not memoized)
  } else {
    if (n > 3) out.push_back('(');  // MARK
    for (size_t k = 0; k < n; ++k) {
      const uint32_t x = tokens[k];
      if (x < 0x100) {
        out.push_back('K');
        out.push_back(static_cast<uint8_t>(x));
      } else if (x < 0x10000) {
        out.push_back('M');
        put_le(out, x, 2);
      } else if (x <= 0x7fffffffu) {
        out.push_back('J');
        put_le(out, x, 4);
      } else {
        out.push_back(0x8a);  // LONG1: five bytes, little-endian two's complement
        out.push_back(5);
        put_le(out, x, 4);
        out.push_back(0);
      }
    }
    out.push_back(n == 1 ? 0x85 : n == 2 ? 0x86 : n == 3 ? 0x87 : 't');
    out.push_back(0x94);
  }
  out.push_back('N');
  out.push_back(0x87);  // TUPLE3
  out.push_back(0x94);
  out.push_back('.');  // STOP
  const uint64_t frame = out.size() - body;
  for (int k = 0; k < 8; ++k) out[start + 3 + k] = static_cast<uint8_t>(frame >> (8 * k));
}

void cbor_head(std::vector<uint8_t>& out, uint8_t major, uint64_t v) {
  const uint8_t m = static_cast<uint8_t>(major << 5);
  if (v < 24) {
    out.push_back(static_cast<uint8_t>(m | v));
  } else if (v < 0x100) {
    out.push_back(m | 24);
    out.push_back(static_cast<uint8_t>(v));
  } else if (v < 0x10000) {
    out.push_back(m | 25);
    put_be(out, v, 2);
  } else if (v < 0x100000000ull) {
    out.push_back(m | 26);
    put_be(out, v, 4);
  } else {
    out.push_back(m | 27);
    put_be(out, v, 8);
  }
}

void cbor_block(const Digest& parent, const uint32_t* tokens, size_t n, std::vector<uint8_t>& out) {
  cbor_head(out, 4, 3);
  cbor_head(out, 2, parent.size());
  out.insert(out.end(), parent.begin(), parent.end());
  cbor_head(out, 4, n);
  for (size_t k = 0; k < n; ++k) cbor_head(out, 0, tokens[k]);
  out.push_back(0xf6);  // null
}

}  // namespace

Algo algo_from_name(const std::string& name) {
  if (name == "sha256") return Algo::kSha256Pickle;
  if (name == "sha256_cbor") return Algo::kSha256Cbor;
  throw std::invalid_argument("prefix-caching hash algorithm '" + name + "' is not supported (sha256, sha256_cbor)");
}

uint64_t external_name(const Digest& d) {
  uint64_t v = 0;
  for (size_t k = d.size() - 8; k < d.size(); ++k) v = (v << 8) | d[k];
  return v;
}

void serialize_block(Algo algo, const Digest& parent, const uint32_t* tokens, size_t n, std::vector<uint8_t>& out) {
  if (algo == Algo::kSha256Pickle) {
    pickle_block(parent, tokens, n, out);
  } else {
    cbor_block(parent, tokens, n, out);
  }
}

Digest hash_block(Algo algo, const Digest& parent, const uint32_t* tokens, size_t n) {
  std::vector<uint8_t> buf;
  buf.reserve(64 + 7 * n);
  serialize_block(algo, parent, tokens, n, buf);
  return sha256(buf.data(), buf.size());
}

BlockHasher::BlockHasher(Algo algo, int block_size, const Digest& none_hash, size_t memo_capacity)
    : algo_(algo), block_size_(block_size), none_hash_(none_hash), capacity_(memo_capacity) {
  if (block_size < 1 || block_size > kMaxBlockSize) {
    throw std::invalid_argument("block_size must be in 1.." + std::to_string(kMaxBlockSize));
  }
}

size_t BlockHasher::memo_size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return memo_.size();
}

BlockHasher::Link BlockHasher::link_of(const Digest& parent, const uint32_t* block, std::string& key,
                                       std::vector<uint8_t>& buf) {
  const size_t b = static_cast<size_t>(block_size_);
  std::memcpy(key.data(), parent.data(), 32);
  std::memcpy(key.data() + 32, block, 4 * b);  // host order: a key, never compared across hosts
  auto it = memo_.find(key);
  if (it != memo_.end()) {
    ++memo_hits_;
    return it->second;
  }
  buf.clear();
  serialize_block(algo_, parent, block, b, buf);
  Link link;
  link.digest = sha256(buf.data(), buf.size());
  link.name = external_name(link.digest);
  if (capacity_ > 0) {
    if (memo_.size() >= capacity_) memo_.clear();  // bounded; the next prompts fill it again
    memo_.emplace(key, link);
  }
  return link;
}

size_t BlockHasher::chain(const uint32_t* tokens, size_t n_tokens, size_t first, size_t count, const Digest& parent,
                          std::vector<Digest>* digests, std::vector<uint64_t>* names) {
  const size_t b = static_cast<size_t>(block_size_);
  const size_t full = n_tokens / b;
  if (first >= full) return 0;
  count = std::min(count, full - first);
  std::string key(32 + 4 * b, '\0');
  std::vector<uint8_t> buf;
  buf.reserve(64 + 7 * b);
  Digest cur = parent;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t k = first; k < first + count; ++k) {
    const Link link = link_of(cur, tokens + k * b, key, buf);
    if (digests != nullptr) digests->push_back(link.digest);
    if (names != nullptr) names->push_back(link.name);
    cur = link.digest;
  }
  return count;
}

size_t BlockHasher::shared_blocks(const uint32_t* tokens, size_t blocks, size_t* which) const {
  // Every chain starts at NONE_HASH: equal leading token ids give equal leading links.
  const size_t b = static_cast<size_t>(block_size_);
  size_t best = 0;
  for (size_t r = 0; r < recent_.size(); ++r) {
    const Recent& w = recent_[r];
    const size_t n = std::min(blocks, w.links.size()) * b;
    const size_t same = static_cast<size_t>(std::mismatch(tokens, tokens + n, w.tokens.data()).first - tokens) / b;
    if (same > best) {
      best = same;
      *which = r;
    }
  }
  return best;
}

void BlockHasher::keep_recent(const uint32_t* tokens, size_t blocks, std::vector<Link>&& links, size_t from,
                              size_t shared) {
  const size_t b = static_cast<size_t>(block_size_);
  if (capacity_ == 0 || blocks == 0) return;
  if (shared == blocks && shared > 0) {  // nothing new: the recent walk it followed moves to the front
    std::rotate(recent_.begin(), recent_.begin() + static_cast<std::ptrdiff_t>(from),
                recent_.begin() + static_cast<std::ptrdiff_t>(from) + 1);
    return;
  }
  Recent w;
  w.tokens.assign(tokens, tokens + blocks * b);
  w.links = std::move(links);
  recent_.insert(recent_.begin(), std::move(w));
  if (recent_.size() > kRecentWalks) recent_.pop_back();
}

}  // namespace bea::prefix

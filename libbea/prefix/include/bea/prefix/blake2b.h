// BLAKE2b (RFC 7693), unkeyed, streaming, with a copyable state: the digest the router's chunk
// cache names a prompt's leading text by (Python's hashlib.blake2b(digest_size=n) gives the same
// bytes), so that the digests at many cuts of one text come from one pass over it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace bea::prefix {

class Blake2b {
 public:
  explicit Blake2b(size_t out_len = 64);  // 1..64 bytes (std::invalid_argument otherwise)
  void update(const uint8_t* data, size_t n);
  // The digest of everything updated so far, in out[0 .. out_len); the state is unchanged, so
  // updating may go on (a copy is finalised).
  void digest(uint8_t* out) const;
  size_t out_len() const { return out_len_; }

 private:
  void compress(const uint8_t* block, bool last);
  std::array<uint64_t, 8> h_{};
  std::array<uint8_t, 128> buf_{};
  size_t buffered_ = 0;
  uint64_t t0_ = 0, t1_ = 0;  // bytes compressed so far (128-bit counter)
  size_t out_len_;
};

}  // namespace bea::prefix

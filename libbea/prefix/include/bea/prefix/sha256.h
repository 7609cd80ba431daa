// SHA-256 (FIPS 180-4), streaming: the digest vLLM's prefix cache names blocks by.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace bea::prefix {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const uint8_t* data, size_t n);
  Digest finish();  // the object must not be updated after this

 private:
  void compress(const uint8_t* block);
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buf_{};
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

Digest sha256(const uint8_t* data, size_t n);

}  // namespace bea::prefix

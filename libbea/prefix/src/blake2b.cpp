// BLAKE2b per RFC 7693 §3 (compression F, mixing G, the SHA-512 IV, the ten message schedules).
#include "bea/prefix/blake2b.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace bea::prefix {

namespace {

constexpr std::array<uint64_t, 8> kIv = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                                         0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                                         0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

constexpr uint8_t kSigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

inline uint64_t rotr(uint64_t x, unsigned n) { return (x >> n) | (x << (64U - n)); }

inline uint64_t load64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

inline void mix(std::array<uint64_t, 16>& v, size_t a, size_t b, size_t c, size_t d, uint64_t x, uint64_t y) {
  v[a] = v[a] + v[b] + x;
  v[d] = rotr(v[d] ^ v[a], 32);
  v[c] = v[c] + v[d];
  v[b] = rotr(v[b] ^ v[c], 24);
  v[a] = v[a] + v[b] + y;
  v[d] = rotr(v[d] ^ v[a], 16);
  v[c] = v[c] + v[d];
  v[b] = rotr(v[b] ^ v[c], 63);
}

}  // namespace

Blake2b::Blake2b(size_t out_len) : h_(kIv), out_len_(out_len) {
  if (out_len < 1 || out_len > 64) throw std::invalid_argument("BLAKE2b digest length must be 1..64");
  h_[0] ^= 0x01010000ULL ^ static_cast<uint64_t>(out_len);  // parameter block: no key, fanout 1, depth 1
}

void Blake2b::compress(const uint8_t* block, bool last) {
  std::array<uint64_t, 16> m{};
  for (size_t i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
  std::array<uint64_t, 16> v{};
  for (size_t i = 0; i < 8; ++i) {
    v[i] = h_[i];
    v[i + 8] = kIv[i];
  }
  v[12] ^= t0_;
  v[13] ^= t1_;
  if (last) v[14] = ~v[14];
  for (size_t r = 0; r < 12; ++r) {
    const uint8_t* s = kSigma[r % 10];
    mix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    mix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    mix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    mix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    mix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    mix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    mix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    mix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (size_t i = 0; i < 8; ++i) h_[i] ^= v[i] ^ v[i + 8];
}

void Blake2b::update(const uint8_t* data, size_t n) {
  // A full buffer is compressed only once more data follows: the last block is compressed with
  // the final flag, in digest().
  while (n > 0) {
    if (buffered_ == buf_.size()) {
      t0_ += buf_.size();
      if (t0_ < buf_.size()) ++t1_;
      compress(buf_.data(), false);
      buffered_ = 0;
    }
    const size_t take = std::min(n, buf_.size() - buffered_);
    std::memcpy(buf_.data() + buffered_, data, take);
    buffered_ += take;
    data += take;
    n -= take;
  }
}

void Blake2b::digest(uint8_t* out) const {
  Blake2b f = *this;
  f.t0_ += f.buffered_;
  if (f.t0_ < f.buffered_) ++f.t1_;
  std::memset(f.buf_.data() + f.buffered_, 0, f.buf_.size() - f.buffered_);
  f.compress(f.buf_.data(), true);
  for (size_t i = 0; i < out_len_; ++i) out[i] = static_cast<uint8_t>(f.h_[i / 8] >> (8 * (i % 8)));
}

}  // namespace bea::prefix

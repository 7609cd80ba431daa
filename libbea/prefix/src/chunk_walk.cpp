#include "bea/prefix/chunk_walk.h"

#include <stdexcept>

#include "bea/prefix/blake2b.h"

namespace bea::prefix {

namespace {

inline bool letter(uint8_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

}  // namespace

bool safe_cuts(const uint8_t* s, size_t n, size_t stride, std::vector<size_t>& cuts) {
  if (stride < 1) throw std::invalid_argument("stride must be >= 1");
  cuts.clear();
  for (size_t i = 0; i < n; ++i)
    if (s[i] >= 0x80) return false;
  size_t pos = stride;
  while (pos < n) {
    size_t i = pos;
    // a match at i: s[i] is a space with a letter on each side (i >= stride >= 1, so s[i - 1] exists)
    while (i + 1 < n && !(s[i] == ' ' && letter(s[i - 1]) && letter(s[i + 1]))) ++i;
    if (i + 1 >= n) break;
    cuts.push_back(i);
    pos = i + stride;
  }
  return true;
}

void prefix_digests(const uint8_t* s, size_t n, const std::vector<size_t>& cuts, std::vector<uint8_t>& out) {
  size_t done = 0;
  for (size_t c : cuts)
    if (c < done || c > n) throw std::invalid_argument("cuts must be non-decreasing and within the text");
    else done = c;
  Blake2b h(kChunkDigestBytes);
  done = 0;
  out.reserve(out.size() + cuts.size() * kChunkDigestBytes);
  for (size_t c : cuts) {
    h.update(s + done, c - done);
    done = c;
    const size_t at = out.size();
    out.resize(at + kChunkDigestBytes);
    h.digest(out.data() + at);
  }
}

}  // namespace bea::prefix

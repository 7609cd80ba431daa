// The router's chunk walk over a prompt (services/tokenizer/chunks.py) in one pass: the safe
// boundaries of ASCII text — one space between two letters, about every `stride` bytes — and the
// BLAKE2b digest of the text up to each cut, which names the chunk ending there in the cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace bea::prefix {

constexpr size_t kChunkDigestBytes = 16;  // hashlib.blake2b(digest_size=16), as the Python walk

// The cuts of s[0 .. n): the first safe boundary at or after `stride`, then the first at or after
// each cut + stride (exactly what the Python walk's regex search finds on ASCII text). False,
// with `cuts` cleared, when s holds a byte >= 0x80 (not ASCII: the caller's walk applies).
// stride >= 1 (std::invalid_argument otherwise).
bool safe_cuts(const uint8_t* s, size_t n, size_t stride, std::vector<size_t>& cuts);

// kChunkDigestBytes per cut, appended to `out`: the digest of s[0 .. cut). Cuts must be
// non-decreasing and <= n (std::invalid_argument otherwise).
void prefix_digests(const uint8_t* s, size_t n, const std::vector<size_t>& cuts, std::vector<uint8_t>& out);

}  // namespace bea::prefix

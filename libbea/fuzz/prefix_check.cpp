// Standalone driver for sanitizer builds of the prefix-cache block hashing (bea/prefix/*.h):
// every input file (or stdin) is read as [algo byte][block-size byte][split byte][token ids as
// little-endian uint32, any trailing bytes ignored], and checked:
//   - SHA-256 fed in pieces (sizes from the input) equals SHA-256 in one go;
//   - the chain of all blocks equals the chain computed in two parts (the second from the first
//     part's last digest), with a memo and without one, and a second memoised pass;
//   - each block's serialisation is well formed (pickle: its FRAME length, STOP; CBOR: array(3)
//     head, the null at its end) and hashes to the chain's digest;
//   - BLAKE2b fed in pieces equals BLAKE2b in one go, and a digest taken midway leaves the state
//     as it was;
//   - the router's chunk walk over the input mapped to ASCII (letters, spaces, punctuation; the
//     stride from the first byte): every cut is a safe boundary (a space between two letters),
//     the first one at or after its search start, and its name is BLAKE2b-128 of the text before
//     it; the raw input, when it holds a byte >= 0x80, is refused.
// Known-answer SHA-256 (FIPS 180-4) and BLAKE2b-512 (RFC 7693 appendix A) vectors are checked first. Any mismatch aborts; any
// memory error or undefined behaviour aborts under -fsanitize=address,undefined.
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "driver.h"
#include "bea/prefix/blake2b.h"
#include "bea/prefix/block_hash.h"
#include "bea/prefix/chunk_walk.h"

namespace {

using bea::prefix::Algo;
using bea::prefix::BlockHasher;
using bea::prefix::Digest;

long g_blocks = 0;
long g_cuts = 0;  // reported, so a test can see that blocks were hashed

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "prefix_check: %s\n", what);
    std::abort();
  }
}

template <class Bytes>
std::string hex(const Bytes& d) {
  static const char* k = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) {
    s.push_back(k[b >> 4]);
    s.push_back(k[b & 15]);
  }
  return s;
}

void known_answers() {
  const std::string abc = "abc";
  require(hex(bea::prefix::sha256(reinterpret_cast<const uint8_t*>(abc.data()), abc.size())) ==
              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
          "sha256(abc)");
  const std::string two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  require(hex(bea::prefix::sha256(reinterpret_cast<const uint8_t*>(two.data()), two.size())) ==
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
          "sha256(two-block message)");
  require(hex(bea::prefix::sha256(nullptr, 0)) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
          "sha256(empty)");
  std::array<uint8_t, 64> b{};
  bea::prefix::Blake2b h(64);
  h.update(reinterpret_cast<const uint8_t*>(abc.data()), abc.size());
  h.digest(b.data());
  require(hex(b) == "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d17d87c5392aab792dc252d5de4533cc95"
                    "18d38aa8dbf1925ab92386edd4009923",
          "blake2b-512(abc)");
  bea::prefix::Blake2b e(64);
  e.digest(b.data());
  require(hex(b) == "786a02f742015903c6c6fd852552d272912f4740e15847618a86e217f71f5419d25e1031afee585313896444934eb04b90"
                    "3a685b1448b755d56f701afe9be2ce",
          "blake2b-512(empty)");
}

bool letter(uint8_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

void check_chunk_walk(const std::vector<uint8_t>& buf) {
  using bea::prefix::kChunkDigestBytes;
  // BLAKE2b in pieces (with digests taken midway) == in one go
  std::array<uint8_t, kChunkDigestBytes> whole{}, got{}, mid{};
  bea::prefix::Blake2b one(kChunkDigestBytes), parts(kChunkDigestBytes);
  one.update(buf.data(), buf.size());
  one.digest(whole.data());
  size_t at = 0, k = 0;
  while (at < buf.size()) {
    const size_t piece = std::min<size_t>(buf.size() - at, 1 + buf[k++ % buf.size()] % 300);
    parts.update(buf.data() + at, piece);
    parts.digest(mid.data());
    at += piece;
  }
  parts.digest(got.data());
  require(got == whole, "blake2b in pieces differs");

  std::vector<size_t> cuts;
  bool high = false;
  for (uint8_t c : buf) high = high || c >= 0x80;
  const size_t stride = buf.empty() ? 1 : 1 + buf[0] % 40;
  require(bea::prefix::safe_cuts(buf.data(), buf.size(), stride, cuts) != high, "non-ASCII input not refused");
  static const char kAlphabet[] = "abcXYZ  ,9_\n-";
  std::vector<uint8_t> text(buf.size());
  for (size_t i = 0; i < buf.size(); ++i) text[i] = static_cast<uint8_t>(kAlphabet[buf[i] % (sizeof(kAlphabet) - 1)]);
  require(bea::prefix::safe_cuts(text.data(), text.size(), stride, cuts), "ASCII text refused");
  auto safe = [&](size_t i) { return i >= 1 && i + 1 < text.size() && text[i] == ' ' && letter(text[i - 1]) && letter(text[i + 1]); };
  size_t pos = stride;
  for (size_t c : cuts) {
    require(c >= pos && safe(c), "a cut that is not a safe boundary at or after its search start");
    for (size_t i = pos; i < c; ++i) require(!safe(i), "a safe boundary skipped");
    pos = c + stride;
  }
  for (size_t i = pos; i < text.size(); ++i) require(!safe(i), "a safe boundary missed after the last cut");
  std::vector<uint8_t> names;
  bea::prefix::prefix_digests(text.data(), text.size(), cuts, names);
  require(names.size() == cuts.size() * kChunkDigestBytes, "one name per cut");
  for (size_t j = 0; j < cuts.size(); ++j) {
    bea::prefix::Blake2b h(kChunkDigestBytes);
    h.update(text.data(), cuts[j]);
    h.digest(got.data());
    require(std::memcmp(got.data(), names.data() + j * kChunkDigestBytes, kChunkDigestBytes) == 0,
            "a cut's name is not the digest of the text before it");
    ++g_cuts;
  }
}

int run_one(const std::vector<uint8_t>& buf) {
  // SHA-256 in pieces == in one go
  const Digest whole = bea::prefix::sha256(buf.data(), buf.size());
  bea::prefix::Sha256 s;
  size_t at = 0, k = 0;
  while (at < buf.size()) {
    const size_t piece = std::min<size_t>(buf.size() - at, 1 + buf[k++ % buf.size()] % 97);
    s.update(buf.data() + at, piece);
    at += piece;
  }
  require(s.finish() == whole, "sha256 in pieces differs");
  check_chunk_walk(buf);
  if (buf.size() < 3) return 0;

  const Algo algo = (buf[0] & 1) ? Algo::kSha256Cbor : Algo::kSha256Pickle;
  const int bs = (buf[1] & 0x80) ? 1 + buf[1] % 4 : 1 + buf[1] % 64;
  std::vector<uint32_t> toks((buf.size() - 3) / 4);
  for (size_t i = 0; i < toks.size(); ++i) {
    const uint8_t* p = buf.data() + 3 + 4 * i;
    toks[i] = uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
  }
  const Digest none = bea::prefix::sha256(buf.data(), 2);
  BlockHasher memo(algo, bs, none, 64), plain(algo, bs, none, 0);
  const size_t full = toks.size() / bs;
  std::vector<Digest> d_all, d_parts, d_plain, d_again;
  std::vector<uint64_t> n_all, n_parts;
  require(memo.chain(toks.data(), toks.size(), 0, full + 5, none, &d_all, &n_all) == full, "block count");
  const size_t split = full ? buf[2] % (full + 1) : 0;
  memo.chain(toks.data(), toks.size(), 0, split, none, &d_parts, &n_parts);
  memo.chain(toks.data(), toks.size(), split, full, split ? d_parts.back() : none, &d_parts, &n_parts);
  plain.chain(toks.data(), toks.size(), 0, full, none, &d_plain, nullptr);
  memo.chain(toks.data(), toks.size(), 0, full, none, &d_again, nullptr);
  require(d_all == d_parts && n_all == n_parts, "chain in two parts differs");
  require(d_all == d_plain, "memoised chain differs from the plain one");
  require(d_all == d_again, "second memoised pass differs");
  require(memo.chain(toks.data(), toks.size(), full, 3, none, nullptr, nullptr) == 0, "blocks past the end");

  std::vector<uint8_t> ser;
  Digest parent = none;
  for (size_t b = 0; b < full; ++b) {
    ser.clear();
    bea::prefix::serialize_block(algo, parent, toks.data() + b * bs, static_cast<size_t>(bs), ser);
    if (algo == Algo::kSha256Pickle) {
      uint64_t frame = 0;
      for (int i = 7; i >= 0; --i) frame = (frame << 8) | ser[3 + static_cast<size_t>(i)];
      require(ser[0] == 0x80 && ser[1] == 5 && ser[2] == 0x95 && frame == ser.size() - 11 && ser.back() == '.',
              "pickle layout");
    } else {
      require(ser[0] == 0x83 && ser[1] == 0x58 && ser[2] == 32 && ser.back() == 0xf6, "cbor layout");
    }
    require(bea::prefix::sha256(ser.data(), ser.size()) == d_all[b], "serialisation does not hash to the chain");
    require(n_all[b] == bea::prefix::external_name(d_all[b]), "name is not the digest's low 64 bits");
    parent = d_all[b];
    ++g_blocks;
  }
  return 0;
}

}  // namespace

BEA_FUZZ_ENTRY(run_one)

#ifndef BEA_LIBFUZZER
int main(int argc, char** argv) {
  known_answers();
  const int n = bea_fuzz::run_inputs(argc, argv, run_one);
  std::printf("checked %d inputs, %ld blocks, %ld chunk cuts\n", n, g_blocks, g_cuts);
  return 0;
}
#endif

// Standalone driver for sanitizer builds of the prefix-cache block hashing (bea/prefix/*.h):
// every input file (or stdin) is read as [algo byte][block-size byte][split byte][token ids as
// little-endian uint32, any trailing bytes ignored], and checked:
//   - SHA-256 fed in pieces (sizes from the input) equals SHA-256 in one go;
//   - the chain of all blocks equals the chain computed in two parts (the second from the first
//     part's last digest), with a memo and without one, and a second memoised pass;
//   - the hit walk (BlockHasher::walk, which reuses recent walks' links) gives the chain's names
//     for the prompt, a stopped walk, variants changed at one block, and the prompt again;
//   - each block's serialisation is well formed (pickle: its FRAME length, STOP; CBOR: array(3)
//     head, the null at its end) and hashes to the chain's digest.
// Known-answer SHA-256 vectors (FIPS 180-4 examples) are checked first. Any mismatch aborts; any
// memory error or undefined behaviour aborts under -fsanitize=address,undefined.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "driver.h"
#include "bea/prefix/block_hash.h"

namespace {

using bea::prefix::Algo;
using bea::prefix::BlockHasher;
using bea::prefix::Digest;

long g_blocks = 0;  // reported, so a test can see that blocks were hashed

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "prefix_check: %s\n", what);
    std::abort();
  }
}

std::string hex(const Digest& d) {
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
}

// BlockHasher::walk: the whole chain; a stop after `stop` blocks; then more variants of the
// prompt (each changed at one block) than the recent walks kept, and the prompt again — every
// walk's names equal the plain chain's.
void check_walks(BlockHasher& memo, BlockHasher& plain, const std::vector<uint32_t>& toks, int bs, size_t full,
                 uint8_t seed) {
  auto names_of = [&](const std::vector<uint32_t>& t) {
    std::vector<uint64_t> n;
    plain.chain(t.data(), t.size(), 0, full, plain.none_hash(), nullptr, &n);
    return n;
  };
  auto walked = [&](const std::vector<uint32_t>& t, size_t stop) {
    std::vector<uint64_t> n;
    const size_t k = memo.walk(t.data(), t.size(), full + 3, [&](uint64_t name) {
      n.push_back(name);
      return n.size() < stop;
    });
    require(k == n.size(), "walk count");
    return n;
  };
  const std::vector<uint64_t> want = names_of(toks);
  require(walked(toks, full + 3) == want, "walk differs from the chain");
  const size_t stop = full ? 1 + seed % full : 0;
  const std::vector<uint64_t> part = walked(toks, stop);
  require(part.size() == stop && std::equal(part.begin(), part.end(), want.begin()), "stopped walk");
  const size_t b = static_cast<size_t>(bs);
  for (size_t v = 0; full && v < BlockHasher::kRecentWalks + 3; ++v) {
    std::vector<uint32_t> alt = toks;
    alt[((seed + 7 * v) % full) * b] ^= static_cast<uint32_t>(1 + v);
    require(walked(alt, full + 3) == names_of(alt), "walk of a variant differs from its chain");
  }
  require(walked(toks, full + 3) == want, "walk after the variants differs");
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
  check_walks(memo, plain, toks, bs, full, buf[2]);
  return 0;
}

}  // namespace

BEA_FUZZ_ENTRY(run_one)

#ifndef BEA_LIBFUZZER
int main(int argc, char** argv) {
  known_answers();
  const int n = bea_fuzz::run_inputs(argc, argv, run_one);
  std::printf("checked %d inputs, %ld blocks\n", n, g_blocks);
  return 0;
}
#endif

// Prompt features of the predictor (services/predictor/text.py, features.py) in C++: the piece
// tokenisation, the 64-bit piece hashes, the signed hashed vector and the keyword indicators.
// Every function is total: any byte string (invalid UTF-8, NUL bytes, empty) gives a defined
// result, and the results are bit-identical to the Python reference implementation.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace bea {
namespace prompt {

constexpr size_t kHashDim = 512;
constexpr size_t kHashHead = 6144;  // bytes hashed from the start of a long prompt
constexpr size_t kHashTail = 2048;  // ... and from its end

struct PieceCounts {
  int64_t n_pieces = 0;     // pieces of the whole text
  int64_t n_sentences = 0;  // sentences of the whole text
  int64_t n_hashed = 0;     // pieces of the hashed window (head + tail)
};

// The 64-bit hash of one piece (bytes lower-cased as ASCII).
uint64_t piece_hash(const uint8_t* p, size_t len);

// Appends the hashes of the pieces of data[0, n) in order (the Python ``_hash_window``).
void hash_window(const uint8_t* data, size_t n, std::vector<uint64_t>& out);

// (pieces, sentences) of the whole text (the Python ``count_pieces``); SSE2 where available.
PieceCounts count_pieces(const uint8_t* data, size_t n);
// The same, one byte at a time (the reference for the vectorised version).
PieceCounts count_pieces_scalar(const uint8_t* data, size_t n);

// The byte ranges hashed for a text of n bytes: [0, head_end) and [tail_start, n) (tail_start
// == n when there is no separate tail). The Python ``pieces`` window with ``_cut``.
void hash_ranges(const uint8_t* data, size_t n, size_t* head_end, size_t* tail_start);

// Counts over the whole text and the normalised signed hashed vector of its window:
// out[kHashDim] is overwritten.
PieceCounts hashed_features(const uint8_t* data, size_t n, double* out);

// One indicator: fires when a word ([a-z]+ run) of the text is in ``words`` or one of
// ``phrases`` is a substring of it. ``question`` marks the special question indicator.
struct IndicatorSpec {
  std::vector<std::string> words;
  std::vector<std::string> phrases;
  bool question = false;
};

// The length-constraint regex of features.py, as data:
//   \b(?:lead1|lead2|...)\s+(\d{1,5})\s+(unit1|unit2|...)s?\b  →  log1p(N * factor[unit])
struct LimitSpec {
  std::vector<std::string> leads;
  std::vector<std::string> units;
  std::vector<double> factors;
};

// Indicator features of lower-cased text (features.py ``analyse``), for ASCII text only: the
// Python regexes have Unicode semantics for \s, \b and \d that this does not reproduce, so
// ``evaluate`` returns false for any byte >= 0x80 and the caller uses the reference code.
class Indicators {
 public:
  Indicators(std::vector<IndicatorSpec> flags, LimitSpec limit, std::vector<std::string> question_words);
  size_t n_flags() const { return flags_.size(); }
  // out[0] = limit, out[1 + k] = flag k (0.0 / 1.0). False (out untouched) if not ASCII.
  bool evaluate(std::string_view low, double* out) const;

 private:
  bool is_question(std::string_view low) const;
  double limit(std::string_view low) const;

  struct Entry {
    std::string text;
    uint64_t bits;  // flags it fires (words, phrases) or its index (leads)
  };
  using Buckets = std::array<std::vector<Entry>, 128>;  // by first byte (all entries are ASCII)

  std::vector<IndicatorSpec> flags_;
  LimitSpec limit_;
  std::vector<std::string> question_words_;
  Buckets words_;    // keyword → flags; one entry per distinct word
  Buckets phrases_;  // phrase → flags
  Buckets leads_;    // limit lead → its index
  uint64_t phrase_flags_ = 0;  // flags that have phrases
};

}  // namespace prompt
}  // namespace bea

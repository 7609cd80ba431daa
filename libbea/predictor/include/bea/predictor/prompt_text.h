// Prompt features of the predictor (services/predictor/features.py): the piece
// tokenisation, the 64-bit piece hashes, the signed hashed vector and the keyword indicators.
// Every function is total: any byte string (invalid UTF-8, NUL bytes, empty) gives a defined
// result. This is the definition of the features (trained models depend on every bit of them);
// tests/predictor/data/prompt_golden.jsonl.gz pins the outputs.
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

// A piece is a run of word bytes (ASCII letters and digits, every byte >= 0x80) or one punctuation
// byte; the six ASCII whitespace bytes (9-13, 32) separate pieces.
// The 64-bit hash of one piece: a polynomial (base 1000003, mod 2^64) of its bytes lower-cased as
// ASCII, mixed with its length.
uint64_t piece_hash(const uint8_t* p, size_t len);

// Appends the hashes of the pieces of data[0, n) in order.
void hash_window(const uint8_t* data, size_t n, std::vector<uint64_t>& out);

// (pieces, sentences) of the whole text; SSE2 where available. A sentence ends at . ! ? followed
// by whitespace or the end of the text; a trailing sentence without one counts too.
PieceCounts count_pieces(const uint8_t* data, size_t n);
// The same, one byte at a time (the reference for the vectorised version).
PieceCounts count_pieces_scalar(const uint8_t* data, size_t n);

// The byte ranges hashed for a text of n bytes: [0, head_end) and [tail_start, n) (tail_start
// == n when there is no separate tail). A text over kHashHead + kHashTail bytes is hashed up to
// the last space/newline/tab at or before byte kHashHead and from just after the first one at or
// after byte n - kHashTail - 1, so that no piece is cut.
void hash_ranges(const uint8_t* data, size_t n, size_t* head_end, size_t* tail_start);

// Counts over the whole text and the normalised signed hashed vector of its window:
// out[kHashDim] is overwritten.
PieceCounts hashed_features(const uint8_t* data, size_t n, double* out);

// The text the indicators read (features.py): the first and the last kIndicatorSpan code points of
// UTF-8 text joined by '\n' (all of it when it has at most 2 * kIndicatorSpan), lower-cased as
// Python's str.lower, as one byte per code point: ASCII as itself, any other code point as its
// class in Python's re (bea/predictor/prompt_unicode.h): kOtherCp, kSpaceCp (\s), kWordCp (\w) or
// kDigitCp + its value (\d, also \w). Surrogates (as Python's "surrogatepass" encodes them) and
// bytes that are not UTF-8 are kOtherCp; a code point is a byte that does not continue a
// sequence with the continuation bytes after it.
constexpr size_t kIndicatorSpan = 600;
enum : uint8_t { kOtherCp = 0x80, kSpaceCp = 0x81, kWordCp = 0x82, kDigitCp = 0x90 };
std::string indicator_text(const uint8_t* data, size_t n);
// Code points of UTF-8 text, counted as indicator_text steps (Python's len for valid UTF-8).
int64_t count_code_points(const uint8_t* data, size_t n);

// One indicator: fires when a word ([a-z]+ run) of the text is in ``words`` or one of
// ``phrases`` is a substring of it. ``question`` marks the special question indicator.
struct IndicatorSpec {
  std::vector<std::string> words;
  std::vector<std::string> phrases;
  bool question = false;
};

// The length-constraint regex of features.py, as data:
//   \b(?:lead1|lead2|...)\s+(\d{1,5})\s+(unit1|unit2|...)s?\b  →  log1p(N * factor[unit])
// with Python's Unicode semantics of \b, \s and \d.
struct LimitSpec {
  std::vector<std::string> leads;
  std::vector<std::string> units;
  std::vector<double> factors;
};

// Indicator features of an ``indicator_text``.
class Indicators {
 public:
  Indicators(std::vector<IndicatorSpec> flags, LimitSpec limit, std::vector<std::string> question_words);
  size_t n_flags() const { return flags_.size(); }
  // out[0] = limit, out[1 + k] = flag k (0.0 / 1.0) of an indicator_text (any bytes are defined).
  void evaluate(std::string_view low, double* out) const;

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

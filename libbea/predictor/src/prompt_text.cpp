// See bea/prompt_text.h. tests/predictor/data/prompt_golden.jsonl.gz holds the outputs these
// functions must give (recorded from the numpy/regex implementation they replaced).
#include "bea/predictor/prompt_text.h"

#include "bea/predictor/prompt_unicode.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <stdexcept>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace bea {
namespace prompt {

namespace {

constexpr uint64_t kP = 1000003ULL;
constexpr uint64_t kMix = 0x9E3779B97F4A7C15ULL;

// Byte classes of the pieces: word = ASCII letters/digits and every byte >= 0x80; space = the six
// ASCII whitespace bytes 9-13 and 32; punct = everything else (one piece per byte).
enum : uint8_t { kSpace = 1, kWord = 2, kEnd = 4 };

constexpr std::array<uint8_t, 256> make_classes() {
  std::array<uint8_t, 256> t{};
  for (int b = 0; b < 256; ++b) {
    uint8_t c = 0;
    if ((b >= '0' && b <= '9') || (b >= 'A' && b <= 'Z') || (b >= 'a' && b <= 'z') || b >= 128) c = kWord;
    if (b == 9 || b == 10 || b == 11 || b == 12 || b == 13 || b == 32) c = kSpace;
    if (b == '.' || b == '!' || b == '?') c = static_cast<uint8_t>(c | kEnd);
    t[static_cast<size_t>(b)] = c;
  }
  return t;
}
constexpr std::array<uint8_t, 256> kClass = make_classes();

inline uint8_t cls(uint8_t b) { return kClass[b]; }
inline uint8_t lower_ascii(uint8_t b) { return (b >= 'A' && b <= 'Z') ? static_cast<uint8_t>(b + 32) : b; }

// Classes of an indicator_text byte (one code point). Python's \s (str.isspace) on ASCII: 9-13,
// 28-31, 32.
inline bool py_space(char c) {
  const auto b = static_cast<unsigned char>(c);
  return (b >= 9 && b <= 13) || (b >= 28 && b <= 32) || b == kSpaceCp;
}
// \d: a decimal digit of any script; its value.
inline bool is_digit(char c) {
  const auto b = static_cast<unsigned char>(c);
  return (b >= '0' && b <= '9') || (b >= kDigitCp && b < kDigitCp + 10);
}
inline int digit_value(char c) {
  const auto b = static_cast<unsigned char>(c);
  return b >= kDigitCp ? b - kDigitCp : b - '0';
}
// \w: letters, digits and numbers of any script, underscore.
inline bool py_word(char c) {
  const auto b = static_cast<unsigned char>(c);
  return (b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') || b == '_' || b == kWordCp || is_digit(c);
}
inline bool lower_letter(char c) { return c >= 'a' && c <= 'z'; }

// The whitespace bytes the hash window is cut at: space, newline, tab.
inline bool cut_space(uint8_t b) { return b == ' ' || b == '\n' || b == '\t'; }

}  // namespace

uint64_t piece_hash(const uint8_t* p, size_t len) {
  uint64_t h = 0;
  for (size_t k = len; k-- > 0;) h = h * kP + lower_ascii(p[k]);  // unsigned: wraps mod 2^64
  h = (h ^ static_cast<uint64_t>(len)) * kMix;
  return h ^ (h >> 29);
}

void hash_window(const uint8_t* data, size_t n, std::vector<uint64_t>& out) {
  size_t i = 0;
  while (i < n) {
    const uint8_t c = cls(data[i]);
    if (c & kWord) {
      size_t j = i + 1;
      while (j < n && (cls(data[j]) & kWord)) ++j;
      out.push_back(piece_hash(data + i, j - i));
      i = j;
    } else {
      if (!(c & kSpace)) out.push_back(piece_hash(data + i, 1));
      ++i;
    }
  }
}

namespace {

// Sentences closed by the text's end: a final . ! ?, or a trailing unterminated sentence.
int64_t closing_sentences(const uint8_t* data, size_t n) {
  if (n == 0) return 0;
  int64_t s = (cls(data[n - 1]) & kEnd) ? 1 : 0;
  size_t i = n;
  while (i > 0 && (cls(data[i - 1]) & kSpace)) --i;
  if (i > 0 && !(cls(data[i - 1]) & kEnd)) ++s;
  return s;
}

#if defined(__SSE2__)
// Bitmasks (bit k = byte k) of the word, space and sentence-end bytes of 64 bytes.
struct Masks64 {
  uint64_t word, space, end;
};

inline uint64_t mask16(__m128i m) { return static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(m))); }

inline __m128i below(__m128i x, char k) {  // unsigned x < k, per byte
  return _mm_cmpeq_epi8(_mm_min_epu8(x, _mm_set1_epi8(static_cast<char>(k - 1))), x);
}

inline Masks64 classify64(const uint8_t* p) {
  Masks64 m{0, 0, 0};
  for (int k = 0; k < 4; ++k) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k));
    const __m128i digit = below(_mm_sub_epi8(b, _mm_set1_epi8('0')), 10);
    const __m128i alpha = below(_mm_sub_epi8(_mm_or_si128(b, _mm_set1_epi8(0x20)), _mm_set1_epi8('a')), 26);
    const uint64_t word = mask16(_mm_or_si128(digit, alpha)) | mask16(b);  // | high bit set
    const __m128i space = _mm_or_si128(below(_mm_sub_epi8(b, _mm_set1_epi8(9)), 5), _mm_cmpeq_epi8(b, _mm_set1_epi8(' ')));
    const __m128i end = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(b, _mm_set1_epi8('.')), _mm_cmpeq_epi8(b, _mm_set1_epi8('!'))),
                                     _mm_cmpeq_epi8(b, _mm_set1_epi8('?')));
    m.word |= word << (16 * k);
    m.space |= mask16(space) << (16 * k);
    m.end |= mask16(end) << (16 * k);
  }
  return m;
}

inline int64_t popcount64(uint64_t x) { return static_cast<int64_t>(__builtin_popcountll(x)); }
#endif

}  // namespace

PieceCounts count_pieces_scalar(const uint8_t* data, size_t n) {
  PieceCounts r;
  if (n == 0) return r;
  int64_t words = 0, word_bytes = 0, space_bytes = 0, sentences = 0;
  bool prev_word = false;
  bool prev_end = false;
  size_t last_non_space = n;  // n: none
  for (size_t i = 0; i < n; ++i) {
    const uint8_t c = cls(data[i]);
    const bool w = (c & kWord) != 0;
    const bool s = (c & kSpace) != 0;
    words += (w && !prev_word) ? 1 : 0;
    word_bytes += w ? 1 : 0;
    space_bytes += s ? 1 : 0;
    sentences += (prev_end && s) ? 1 : 0;  // . ! ? followed by whitespace
    if (!s) last_non_space = i;
    prev_word = w;
    prev_end = (c & kEnd) != 0;
  }
  if (prev_end) ++sentences;  // ends the text
  if (last_non_space < n && !(cls(data[last_non_space]) & kEnd)) ++sentences;  // trailing, unterminated
  r.n_pieces = words + (static_cast<int64_t>(n) - word_bytes - space_bytes);
  r.n_sentences = sentences;
  return r;
}

PieceCounts count_pieces(const uint8_t* data, size_t n) {
#if defined(__SSE2__)
  // 64 bytes at a time: words start where a word byte follows a non-word byte, sentences end
  // where whitespace follows . ! ?; the carries link the blocks.
  int64_t words = 0, word_bytes = 0, space_bytes = 0, sentences = 0;
  uint64_t prev_word = 0, prev_end = 0;  // bit 0: the last byte of the previous block
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const Masks64 m = classify64(data + i);
    words += popcount64(m.word & ~((m.word << 1) | prev_word));
    sentences += popcount64(m.space & ((m.end << 1) | prev_end));
    word_bytes += popcount64(m.word);
    space_bytes += popcount64(m.space);
    prev_word = m.word >> 63;
    prev_end = m.end >> 63;
  }
  for (; i < n; ++i) {
    const uint8_t c = cls(data[i]);
    const uint64_t w = (c & kWord) ? 1 : 0;
    const uint64_t sp = (c & kSpace) ? 1 : 0;
    words += static_cast<int64_t>(w & ~prev_word);
    sentences += static_cast<int64_t>(sp & prev_end);
    word_bytes += static_cast<int64_t>(w);
    space_bytes += static_cast<int64_t>(sp);
    prev_word = w;
    prev_end = (c & kEnd) ? 1 : 0;
  }
  PieceCounts r;
  r.n_pieces = words + (static_cast<int64_t>(n) - word_bytes - space_bytes);
  r.n_sentences = sentences + closing_sentences(data, n);
  return r;
#else
  return count_pieces_scalar(data, n);
#endif
}

void hash_ranges(const uint8_t* data, size_t n, size_t* head_end, size_t* tail_start) {
  if (n <= kHashHead + kHashTail) {
    *head_end = n;
    *tail_start = n;
    return;
  }
  // _cut(data, 0, HASH_HEAD): move the end back to just after whitespace (or to 0).
  size_t hi = kHashHead;
  while (hi < n && !cut_space(data[hi]) && hi > 0) --hi;
  // _cut(data, n - HASH_TAIL, n): move the start forward to just after whitespace (or to n).
  size_t lo = n - kHashTail;
  while (lo > 0 && !cut_space(data[lo - 1])) {
    ++lo;
    if (lo >= n) break;
  }
  *head_end = hi;
  *tail_start = lo;
}

PieceCounts hashed_features(const uint8_t* data, size_t n, double* out) {
  PieceCounts r = count_pieces(data, n);
  std::fill(out, out + kHashDim, 0.0);
  size_t head_end = n, tail_start = n;
  hash_ranges(data, n, &head_end, &tail_start);
  // Signed counts per bucket: integers, so the sum order does not matter and the result equals
  // numpy's bincount of ±1.0 weights exactly.
  std::array<int64_t, kHashDim> acc{};
  int64_t hashed = 0;
  auto add_range = [&](size_t lo, size_t hi) {
    size_t i = lo;
    while (i < hi) {
      const uint8_t c = cls(data[i]);
      size_t j = i + 1;
      if (c & kWord) {
        while (j < hi && (cls(data[j]) & kWord)) ++j;
      } else if (c & kSpace) {
        i = j;
        continue;
      }
      const uint64_t h = piece_hash(data + i, j - i);
      const size_t bucket = static_cast<size_t>((h >> 32) % kHashDim);
      acc[bucket] += ((h >> 7) & 1U) ? 1 : -1;
      ++hashed;
      i = j;
    }
  };
  add_range(0, head_end);
  if (tail_start < n) add_range(tail_start, n);
  r.n_hashed = hashed;
  if (hashed > 0) {
    const double denom = static_cast<double>(hashed);
    for (size_t b = 0; b < kHashDim; ++b) out[b] = static_cast<double>(acc[b]) / denom;
  }
  return r;
}

// ---- indicator text --------------------------------------------------------------------------

namespace {

inline bool continuation(uint8_t b) { return (b & 0xC0) == 0x80; }

// The byte after the code point that starts at i (the next byte that is not a continuation).
inline size_t next_cp(const uint8_t* data, size_t n, size_t i) {
  ++i;
  while (i < n && continuation(data[i])) ++i;
  return i;
}

// The code point of the bytes [i, j) if they are its UTF-8 encoding (shortest form, at most
// U+10FFFF, surrogates allowed), else -1.
int32_t decode(const uint8_t* p, size_t len) {
  const uint8_t b = p[0];
  int32_t cp;
  size_t want;
  int32_t min;
  if (b >= 0xC0 && b < 0xE0) {
    cp = b & 0x1F, want = 2, min = 0x80;
  } else if (b >= 0xE0 && b < 0xF0) {
    cp = b & 0x0F, want = 3, min = 0x800;
  } else if (b >= 0xF0 && b < 0xF8) {
    cp = b & 0x07, want = 4, min = 0x10000;
  } else {
    return -1;
  }
  if (len != want) return -1;
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (p[k] & 0x3F);
  return (cp < min || cp > 0x10FFFF) ? -1 : cp;
}

template <size_t N>
bool in_list(const uint32_t (&list)[N], uint32_t cp) {
  return std::binary_search(list, list + N, cp);
}

// Python's re class of a non-ASCII code point (cp < 0: not UTF-8).
uint8_t cp_class(int32_t cp) {
  namespace u = unicode;
  if (cp < 0) return kOtherCp;
  const auto c = static_cast<uint32_t>(cp);
  if (in_list(u::kSpaces, c)) return kSpaceCp;
  const uint32_t* z = std::upper_bound(std::begin(u::kDigitZeros), std::end(u::kDigitZeros), c);
  if (z != std::begin(u::kDigitZeros) && c - z[-1] < 10) return static_cast<uint8_t>(kDigitCp + (c - z[-1]));
  const auto* r = std::upper_bound(std::begin(u::kWordRanges), std::end(u::kWordRanges), c,
                                   [](uint32_t v, const uint32_t(&range)[2]) { return v < range[0]; });
  if (r != std::begin(u::kWordRanges) && c <= r[-1][1]) return kWordCp;
  return kOtherCp;
}

// Appends the lower-cased classes of the code points of data[lo, hi). Python's str.lower keeps
// the class of every non-ASCII code point except two that lower-case to ASCII: U+0130 (to 'i' and
// U+0307 COMBINING DOT ABOVE, not \w) and U+212A KELVIN SIGN (to 'k'). (Its other context rule,
// the final sigma, maps a letter to a letter.)
void append_lowered(const uint8_t* data, size_t lo, size_t hi, std::string& out) {
  for (size_t i = lo; i < hi;) {
    const uint8_t b = data[i];
    if (b < 0x80) {
      out.push_back(static_cast<char>(lower_ascii(b)));
      ++i;
      continue;
    }
    const size_t j = next_cp(data, hi, i);
    const int32_t cp = decode(data + i, j - i);
    if (cp == 0x130) {
      out.push_back('i');
      out.push_back(static_cast<char>(kOtherCp));
    } else if (cp == 0x212A) {
      out.push_back('k');
    } else {
      out.push_back(static_cast<char>(cp_class(cp)));
    }
    i = j;
  }
}

}  // namespace

int64_t count_code_points(const uint8_t* data, size_t n) {
  int64_t c = (n > 0 && continuation(data[0])) ? 1 : 0;  // leading continuation bytes: one
  for (size_t i = 0; i < n; ++i) c += continuation(data[i]) ? 0 : 1;
  return c;
}

std::string indicator_text(const uint8_t* data, size_t n) {
  // End of the first kIndicatorSpan code points and start of the last kIndicatorSpan.
  size_t head = 0;
  for (size_t k = 0; k < kIndicatorSpan && head < n; ++k) head = next_cp(data, n, head);
  size_t tail = n;
  for (size_t k = 0; k < kIndicatorSpan && tail > 0; ++k) {
    --tail;
    while (tail > 0 && continuation(data[tail])) --tail;
  }
  std::string out;
  out.reserve(2 * kIndicatorSpan + 2);
  if (tail <= head) {  // at most 2 * kIndicatorSpan code points: all of them
    append_lowered(data, 0, n, out);
  } else {
    append_lowered(data, 0, head, out);
    out.push_back('\n');
    append_lowered(data, tail, n, out);
  }
  return out;
}

// ---- indicators -------------------------------------------------------------------------------

Indicators::Indicators(std::vector<IndicatorSpec> flags, LimitSpec limit, std::vector<std::string> question_words)
    : flags_(std::move(flags)), limit_(std::move(limit)), question_words_(std::move(question_words)) {
  if (flags_.size() > 64) throw std::invalid_argument("at most 64 indicator flags");
  if (limit_.units.size() != limit_.factors.size()) throw std::invalid_argument("one factor per limit unit");
  auto check_text = [](const std::string& s, bool word) {
    if (s.empty()) throw std::invalid_argument("empty indicator word or phrase");
    for (char c : s) {
      if (static_cast<unsigned char>(c) >= 128) throw std::invalid_argument("indicator words and phrases must be ASCII");
      if (word && !lower_letter(c)) throw std::invalid_argument("indicator words must be [a-z]+: " + s);
    }
  };
  auto add = [](Buckets& b, const std::string& text, uint64_t bits, bool merge) {
    auto& bucket = b[static_cast<unsigned char>(text.front())];
    if (merge) {
      for (Entry& e : bucket) {
        if (e.text == text) {
          e.bits |= bits;
          return;
        }
      }
    }
    bucket.push_back(Entry{text, bits});
  };
  for (size_t k = 0; k < flags_.size(); ++k) {
    const uint64_t bit = uint64_t{1} << k;
    for (const auto& w : flags_[k].words) {
      check_text(w, true);
      add(words_, w, bit, true);
    }
    for (const auto& p : flags_[k].phrases) {
      check_text(p, false);
      add(phrases_, p, bit, true);
      phrase_flags_ |= bit;
    }
  }
  for (const auto& w : question_words_) check_text(w, true);
  // The regex structure assumed by ``limit``: leads start with a letter (so \b before them is a
  // plain word/non-word test), units are [a-z]+. Leads keep their order (alternation order).
  for (size_t i = 0; i < limit_.leads.size(); ++i) {
    const std::string& l = limit_.leads[i];
    check_text(l, false);
    if (!lower_letter(l.front())) throw std::invalid_argument("limit leads must start with [a-z]");
    add(leads_, l, i, false);
  }
  for (const auto& u : limit_.units) check_text(u, true);
}

bool Indicators::is_question(std::string_view low) const {
  // tail = low.rstrip(); a final '?' → question.
  size_t end = low.size();
  while (end > 0 && py_space(low[end - 1])) --end;
  const std::string_view tail = low.substr(0, end);
  if (!tail.empty() && tail.back() == '?') return true;
  const size_t nl = tail.rfind('\n');
  const std::string_view last_line = nl == std::string_view::npos ? tail : tail.substr(nl + 1);
  for (std::string_view line : {low.substr(0, 80), last_line.substr(0, 80)}) {
    size_t i = 0;
    while (i < line.size() && py_space(line[i])) ++i;  // lstrip
    size_t j = i;
    while (j < line.size() && lower_letter(line[j])) ++j;  // _WORD.match: [a-z]+
    if (j == i) continue;
    const std::string_view first = line.substr(i, j - i);
    for (const auto& q : question_words_) {
      if (first == q) return true;
    }
  }
  return false;
}

double Indicators::limit(std::string_view low) const {
  const size_t n = low.size();
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(low[i]);
    if (c >= 128 || leads_[c].empty()) continue;
    if (i > 0 && py_word(low[i - 1])) continue;  // \b before a lead (leads start with a letter)
    // At one position at most one lead can be followed by whitespace and digits (none is a
    // prefix of another plus whitespace), but try them in the regex's alternation order anyway.
    for (const Entry& e : leads_[c]) {
      const std::string& lead = e.text;
      if (low.compare(i, lead.size(), lead) != 0) continue;
      size_t k = i + lead.size();
      const size_t s1 = k;
      while (k < n && py_space(low[k])) ++k;
      if (k == s1) continue;  // \s+
      const size_t d0 = k;
      while (k < n && is_digit(low[k])) ++k;
      const size_t ndig = k - d0;
      // \d{1,5} then \s+: the whole digit run must be 1..5 long (a shorter prefix is followed by
      // a digit, never by whitespace).
      if (ndig < 1 || ndig > 5) continue;
      const size_t s2 = k;
      while (k < n && py_space(low[k])) ++k;
      if (k == s2) continue;  // \s+
      for (size_t u = 0; u < limit_.units.size(); ++u) {
        const std::string& unit = limit_.units[u];
        if (low.compare(k, unit.size(), unit) != 0) continue;
        const size_t e2 = k + unit.size();
        // s?\b: greedy 's' first, then without it.
        const bool with_s = e2 < n && low[e2] == 's' && (e2 + 1 == n || !py_word(low[e2 + 1]));
        const bool without_s = e2 == n || !py_word(low[e2]);
        if (!with_s && !without_s) continue;
        double number = 0.0;
        for (size_t d = d0; d < d0 + ndig; ++d) number = number * 10.0 + static_cast<double>(digit_value(low[d]));
        return std::log1p(number * limit_.factors[u]);
      }
    }
  }
  return 0.0;
}

void Indicators::evaluate(std::string_view low, double* out) const {
  const size_t n = low.size();
  uint64_t bits = 0;
  // Words: [a-z]+ runs looked up among the keywords with the same first letter.
  for (size_t i = 0; i < n;) {
    if (!lower_letter(low[i])) {
      ++i;
      continue;
    }
    size_t j = i + 1;
    while (j < n && lower_letter(low[j])) ++j;
    const std::string_view w = low.substr(i, j - i);
    for (const Entry& e : words_[static_cast<unsigned char>(low[i])]) {
      if (e.text.size() == w.size() && w == e.text) {
        bits |= e.bits;
        break;
      }
    }
    i = j;
  }
  // Phrases: substring tests, one pass over the start positions.
  if (phrase_flags_ & ~bits) {
    for (size_t i = 0; i < n; ++i) {
      const auto c = static_cast<unsigned char>(low[i]);
      if (c >= 128) continue;  // a non-ASCII class: phrases are ASCII
      for (const Entry& e : phrases_[c]) {
        if ((e.bits & ~bits) && low.compare(i, e.text.size(), e.text) == 0) bits |= e.bits;
      }
    }
  }
  out[0] = limit(low);
  for (size_t k = 0; k < flags_.size(); ++k) {
    const bool on = flags_[k].question ? is_question(low) : ((bits >> k) & 1U) != 0;
    out[1 + k] = on ? 1.0 : 0.0;
  }
}

}  // namespace prompt
}  // namespace bea

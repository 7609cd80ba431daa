// Standalone driver for sanitizer builds of the predictor's native parts (bea/prompt_text.h,
// bea/forest.h): every input file (or stdin) is used
//   - as prompt bytes: counts (vectorised == scalar, else abort), hashed features, the indicator
//     text and its evaluation, at every suffix length around the block boundaries;
//   - as a recipe for a forest: node arrays read from the bytes (mostly invalid), which must be
//     rejected with std::invalid_argument or evaluated on rows made from the bytes (NaN, inf,
//     negative and huge categories included).
// Any memory error or undefined behaviour aborts under -fsanitize=address,undefined.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "driver.h"
#include "bea/predictor/forest.h"
#include "bea/predictor/prompt_text.h"

namespace {

using bea::prompt::IndicatorSpec;

long g_trees_accepted = 0;  // reported, so a test can see that valid forests were evaluated

const bea::prompt::Indicators& indicators() {
  static const bea::prompt::Indicators ind = [] {
    std::vector<IndicatorSpec> flags(3);
    flags[0].words = {"briefly", "short"};
    flags[0].phrases = {"one sentence", "tl;dr"};
    flags[1].words = {"list", "bullet"};
    flags[1].phrases = {"top 10"};
    flags[2].question = true;
    bea::prompt::LimitSpec lim;
    lim.leads = {"in", "at most", "no more than"};
    lim.units = {"word", "page", "character"};
    lim.factors = {1.0, 500.0, 0.2};
    return bea::prompt::Indicators(std::move(flags), std::move(lim), {"who", "what", "is"});
  }();
  return ind;
}

void check_text(const uint8_t* p, size_t n) {
  const bea::prompt::PieceCounts a = bea::prompt::count_pieces(p, n);
  const bea::prompt::PieceCounts b = bea::prompt::count_pieces_scalar(p, n);
  if (a.n_pieces != b.n_pieces || a.n_sentences != b.n_sentences) {
    std::fprintf(stderr, "count mismatch at n=%zu: %lld/%lld vs %lld/%lld\n", n, static_cast<long long>(a.n_pieces),
                 static_cast<long long>(a.n_sentences), static_cast<long long>(b.n_pieces),
                 static_cast<long long>(b.n_sentences));
    std::abort();
  }
  std::vector<double> vec(bea::prompt::kHashDim);
  const bea::prompt::PieceCounts c = bea::prompt::hashed_features(p, n, vec.data());
  if (c.n_pieces != a.n_pieces) std::abort();
  std::vector<uint64_t> h;
  size_t head_end = 0, tail_start = 0;
  bea::prompt::hash_ranges(p, n, &head_end, &tail_start);
  if (head_end > n || tail_start > n || (tail_start < n && tail_start < head_end)) std::abort();
  bea::prompt::hash_window(p, head_end, h);
  if (tail_start < n) bea::prompt::hash_window(p + tail_start, n - tail_start, h);
  if (static_cast<int64_t>(h.size()) != c.n_hashed) std::abort();
  // The indicator text has one byte per code point, at most 2 * kIndicatorSpan + 1 of them.
  const std::string low = bea::prompt::indicator_text(p, n);
  const auto n_cp = static_cast<size_t>(bea::prompt::count_code_points(p, n));
  if (low.size() > 2 * 2 * bea::prompt::kIndicatorSpan + 1 || (n_cp <= 2 * bea::prompt::kIndicatorSpan && low.size() < n_cp))
    std::abort();
  double out[16];
  indicators().evaluate(low, out);
  indicators().evaluate(std::string_view(reinterpret_cast<const char*>(p), n), out);  // any bytes
}

// Reads little values from the input, wrapping around; never past its end.
struct Reader {
  const std::vector<uint8_t>& buf;
  size_t pos = 0;
  uint8_t byte() {
    if (buf.empty()) return 0;
    const uint8_t b = buf[pos % buf.size()];
    ++pos;
    return b;
  }
  int32_t small(int32_t lo, int32_t hi) {  // in [lo, hi]
    const auto span = static_cast<uint32_t>(hi - lo + 1);
    return lo + static_cast<int32_t>(byte() % span);
  }
  double value() {
    switch (byte() % 10) {
      case 0: return std::numeric_limits<double>::quiet_NaN();
      case 1: return std::numeric_limits<double>::infinity();
      case 2: return -std::numeric_limits<double>::infinity();
      case 3: return 1e-40;
      case 4: return 3e9;
      case 5: return -0.5;
      default: return static_cast<double>(small(-40, 40)) / 4.0;
    }
  }
};

void check_forest(const std::vector<uint8_t>& buf) {
  Reader r{buf};
  const int32_t nf = r.small(1, 6);
  bea::Forest f(nf);
  const int n_heads = r.small(1, 3);
  for (int hd = 0; hd < n_heads; ++hd) {
    f.add_head();
    const int n_trees = r.small(0, 4);
    for (int k = 0; k < n_trees; ++k) {
      bea::TreeArrays t;
      const int n_leaves = r.small(0, 9);
      const int n_internal = n_leaves > 0 ? n_leaves - 1 : 0;
      const bool sloppy = r.byte() < 40;  // wrong array lengths now and then
      const bool wellformed = !sloppy && r.byte() < 160;  // else random (mostly rejected) links
      int next_leaf = 0;
      for (int i = 0; i < n_internal + (sloppy ? r.small(-1, 1) : 0); ++i) {
        if (wellformed) {  // a chain: node i → node i + 1 or a leaf, and a leaf
          t.split_feature.push_back(r.small(0, nf - 1));
          const bool cat = r.byte() < 60;
          t.threshold.push_back(cat ? static_cast<double>(r.small(0, 2)) : r.value());
          t.decision_type.push_back(static_cast<int8_t>((cat ? 1 : 0) | (r.small(0, 1) << 1) | (r.small(0, 2) << 2)));
          int32_t a = i + 1 < n_internal ? i + 1 : ~next_leaf++;
          int32_t b = ~next_leaf++;
          if (r.byte() & 1) std::swap(a, b);
          t.left_child.push_back(a);
          t.right_child.push_back(b);
        } else {
          t.split_feature.push_back(r.small(-1, nf));
          t.threshold.push_back(r.value());
          t.decision_type.push_back(static_cast<int8_t>(r.byte()));
          t.left_child.push_back(r.small(-n_leaves - 1, n_internal));
          t.right_child.push_back(r.small(-n_leaves - 1, n_internal));
        }
      }
      if (sloppy) t.left_child.push_back(r.small(-3, 3));
      for (int i = 0; i < n_leaves; ++i) {
        const double v = r.value();
        t.leaf_value.push_back(wellformed && !std::isfinite(v) ? 0.5 : v);
      }
      const int n_cat = wellformed ? 3 : r.small(0, 3);
      if (n_cat > 0) {
        t.cat_boundaries.push_back(wellformed ? 0 : r.small(-1, 1));
        for (int i = 0; i < n_cat; ++i) t.cat_boundaries.push_back(t.cat_boundaries.back() + r.small(wellformed ? 0 : -1, 3));
        const int n_words = wellformed ? t.cat_boundaries.back() : r.small(0, 8);
        for (int i = 0; i < n_words; ++i) t.cat_threshold.push_back(static_cast<uint32_t>(r.byte()) * 16777619U);
      }
      try {
        f.add_tree(t);
        ++g_trees_accepted;
      } catch (const std::invalid_argument&) {
      }
    }
  }
  const size_t n_rows = static_cast<size_t>(r.small(0, 5));
  std::vector<double> rows(n_rows * static_cast<size_t>(nf));
  for (double& v : rows) v = r.value();
  std::vector<double> out(f.n_heads() * n_rows);
  f.predict(rows.data(), n_rows, out.data());
}

int run_one(const std::vector<uint8_t>& buf) {
  const uint8_t* p = buf.data();
  const size_t n = buf.size();
  check_text(p, n);
  for (size_t cut : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{127}}) {
    if (cut < n) check_text(p + cut, n - cut);
  }
  check_forest(buf);
  return 0;
}

}  // namespace

BEA_FUZZ_ENTRY(run_one)

#ifndef BEA_LIBFUZZER
int main(int argc, char** argv) {
  const int n = bea_fuzz::run_inputs(argc, argv, run_one);
  std::printf("checked %d inputs, %ld trees accepted\n", n, g_trees_accepted);
  return 0;
}
#endif

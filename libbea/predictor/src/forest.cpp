// See bea/forest.h.
#include "bea/predictor/forest.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace bea {

namespace {

// LightGBM's kZeroThreshold is the float literal 1e-35f used as a double.
const double kZeroThreshold = static_cast<double>(1e-35f);

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("forest: " + what); }

}  // namespace

size_t Forest::n_trees() const { return trees_.size(); }

size_t Forest::add_head() {
  Head h;
  h.first_tree = trees_.size();
  heads_.push_back(h);
  return heads_.size() - 1;
}

void Forest::add_tree(const TreeArrays& t) {
  if (heads_.empty()) bad("add_head before add_tree");
  const size_t n_leaves = t.leaf_value.size();
  if (n_leaves < 1) bad("a tree needs at least one leaf");
  const size_t n_internal = n_leaves - 1;
  if (t.split_feature.size() != n_internal || t.threshold.size() != n_internal ||
      t.decision_type.size() != n_internal || t.left_child.size() != n_internal ||
      t.right_child.size() != n_internal)
    bad("node arrays must have num_leaves - 1 entries");
  const size_t int_max = static_cast<size_t>(std::numeric_limits<int32_t>::max());
  if (nodes_.size() + n_internal + n_leaves > int_max / 2 || cats_.size() + t.cat_threshold.size() > int_max / 2)
    bad("forest too large");
  size_t n_cat = 0;
  if (!t.cat_boundaries.empty()) {
    n_cat = t.cat_boundaries.size() - 1;
    if (t.cat_boundaries[0] != 0) bad("cat_boundaries must start at 0");
    for (size_t k = 0; k < n_cat; ++k) {
      if (t.cat_boundaries[k + 1] < t.cat_boundaries[k]) bad("cat_boundaries must not decrease");
    }
    if (static_cast<size_t>(t.cat_boundaries[n_cat]) != t.cat_threshold.size())
      bad("cat_boundaries must end at the size of cat_threshold");
  } else if (!t.cat_threshold.empty()) {
    bad("cat_threshold without cat_boundaries");
  }
  for (double v : t.leaf_value) {
    if (!std::isfinite(v)) bad("non-finite leaf value");
  }
  const auto base = static_cast<int32_t>(nodes_.size());
  const auto leaf_base = base + static_cast<int32_t>(n_internal);
  const auto cat_base = static_cast<int32_t>(cats_.size());
  auto child = [&](int32_t c, size_t parent) -> int32_t {
    if (c >= 0) {
      // Internal children come after their parent: every walk ends on a leaf.
      if (static_cast<size_t>(c) <= parent || static_cast<size_t>(c) >= n_internal) bad("bad internal child index");
      return base + c;
    }
    const int64_t leaf = ~static_cast<int64_t>(c);
    if (leaf < 0 || static_cast<size_t>(leaf) >= n_leaves) bad("bad leaf child index");
    return leaf_base + static_cast<int32_t>(leaf);
  };
  std::vector<Node> add;
  add.reserve(n_internal + n_leaves);
  for (size_t i = 0; i < n_internal; ++i) {
    Node nd{};
    if (t.split_feature[i] < 0 || t.split_feature[i] >= n_features_) bad("split feature out of range");
    nd.feature = t.split_feature[i];
    const auto dt = static_cast<uint8_t>(t.decision_type[i]);
    nd.default_left = (dt & 2U) ? 1 : 0;
    nd.missing = static_cast<uint8_t>((dt >> 2) & 3U);
    if (nd.missing > 2) bad("unknown missing type");
    nd.left = child(t.left_child[i], i);
    nd.right = child(t.right_child[i], i);
    if (dt & 1U) {
      const double th = t.threshold[i];
      if (!(th >= 0.0) || th >= static_cast<double>(n_cat) || th != std::floor(th)) bad("bad categorical split index");
      const auto ci = static_cast<size_t>(th);
      nd.kind = kCategorical;
      nd.cat.begin = cat_base + t.cat_boundaries[ci];
      nd.cat.len = t.cat_boundaries[ci + 1] - t.cat_boundaries[ci];
    } else {
      if (std::isnan(t.threshold[i])) bad("NaN threshold");
      nd.kind = nd.missing == 0 ? kPlain : kNumerical;
      nd.threshold = t.threshold[i];
    }
    add.push_back(nd);
  }
  for (size_t k = 0; k < n_leaves; ++k) {
    Node nd{};
    nd.threshold = t.leaf_value[k];
    nd.left = nd.right = leaf_base + static_cast<int32_t>(k);
    nd.feature = 0;
    nd.kind = kPlain;
    nd.leaf = 1;
    add.push_back(nd);
  }
  nodes_.insert(nodes_.end(), add.begin(), add.end());
  cats_.insert(cats_.end(), t.cat_threshold.begin(), t.cat_threshold.end());
  Tree tr;
  tr.root = n_internal > 0 ? base : leaf_base;
  trees_.push_back(tr);
  heads_.back().n_trees += 1;
}

int32_t Forest::slow_step(const Node& nd, const double* raw) const {
  double fval = raw[nd.feature];
  if (nd.kind == kNumerical) {  // tree.h NumericalDecision
    if (std::isnan(fval) && nd.missing != 2) fval = 0.0;
    const bool is_zero = fval >= -kZeroThreshold && fval <= kZeroThreshold;
    if ((nd.missing == 1 && is_zero) || (nd.missing == 2 && std::isnan(fval))) return nd.default_left ? nd.left : nd.right;
    return fval <= nd.threshold ? nd.left : nd.right;
  }
  // tree.h CategoricalDecision: NaN and negative categories go right. LightGBM's static_cast<int>
  // of a value outside the int range is undefined (INT_MIN on x86, i.e. right): we send those
  // right without the UB.
  if (!(fval > -1.0) || !(fval < 2147483648.0)) return nd.right;
  const auto cat = static_cast<int64_t>(fval);  // truncation; (-1, 0) → 0 as in LightGBM
  const int64_t word = cat / 32;
  if (word >= nd.cat.len) return nd.right;
  const uint32_t bits = cats_[static_cast<size_t>(nd.cat.begin) + static_cast<size_t>(word)];
  return ((bits >> static_cast<uint32_t>(cat % 32)) & 1U) ? nd.left : nd.right;
}

inline int32_t Forest::step(const Node& nd, const double* plain, const double* raw) const {
  // Plain numerical split (missing type none; NaN already read as 0) or a leaf (both sides itself).
  if (nd.kind == kPlain) return plain[nd.feature] <= nd.threshold ? nd.left : nd.right;
  return slow_step(nd, raw);
}

void Forest::predict(const double* rows, size_t n_rows, double* out) const {
  const auto nf = static_cast<size_t>(n_features_);
  // raw: LightGBM's dense-row C API keeps only |x| > kZeroThreshold (and NaN), the rest reads as
  // 0; plain: the same with NaN read as 0 (what NumericalDecision does for missing type none).
  std::vector<double> raw(nf * n_rows), plain(nf * n_rows);
  for (size_t i = 0; i < nf * n_rows; ++i) {
    const double v = rows[i];
    raw[i] = (std::fabs(v) > kZeroThreshold || std::isnan(v)) ? v : 0.0;
    plain[i] = std::isnan(v) ? 0.0 : raw[i];
  }
  // Tree-major (a tree's nodes are read once for all rows; measured faster than row-major and
  // than fixed-depth or interleaved traversals). Each (head, row) sum adds the trees in
  // LightGBM's order from 0.0, so the result is the same to the last bit. A walk ends: every
  // step goes to a later internal node or to a leaf.
  for (size_t h = 0; h < heads_.size(); ++h) {
    const Head& hd = heads_[h];
    double* o = out + h * n_rows;
    for (size_t r = 0; r < n_rows; ++r) o[r] = 0.0;
    for (size_t k = 0; k < hd.n_trees; ++k) {
      const Tree& t = trees_[hd.first_tree + k];
      for (size_t r = 0; r < n_rows; ++r) {
        const double* p = plain.data() + r * nf;
        const double* q = raw.data() + r * nf;
        int32_t nd = t.root;
        while (!nodes_[static_cast<size_t>(nd)].leaf) nd = step(nodes_[static_cast<size_t>(nd)], p, q);
        o[r] += nodes_[static_cast<size_t>(nd)].threshold;
      }
    }
  }
}

}  // namespace bea

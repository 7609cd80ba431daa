// Single-row evaluation of LightGBM regression ensembles (several heads over the same rows) with
// LightGBM's exact decision rules (tree.h NumericalDecision / CategoricalDecision and the
// |x| <= kZeroThreshold → 0 conversion of its dense-row C API), so the raw scores are identical
// to LGBM_BoosterPredictForMatSingleRowFast. The trees are flattened into arrays once; every
// index is validated when a tree is added, so evaluation cannot read out of bounds or loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace bea {

struct TreeArrays {
  // Internal nodes (num_leaves - 1 of them). Children: >= 0 an internal node (must be a later
  // node than its parent, as LightGBM numbers them), < 0 the leaf ~child.
  std::vector<int32_t> split_feature;
  std::vector<double> threshold;  // numerical: the threshold; categorical: index into cat_boundaries
  std::vector<int8_t> decision_type;  // bit 0 categorical, bit 1 default left, bits 2-3 missing type
  std::vector<int32_t> left_child;
  std::vector<int32_t> right_child;
  std::vector<double> leaf_value;  // num_leaves
  std::vector<int32_t> cat_boundaries;  // num_cat + 1 offsets into cat_threshold (empty if none)
  std::vector<uint32_t> cat_threshold;  // bitsets of the categories that go left
};

class Forest {
 public:
  explicit Forest(int32_t n_features) : n_features_(n_features) {}

  int32_t n_features() const { return n_features_; }
  size_t n_heads() const { return heads_.size(); }
  size_t n_trees() const;

  // Starts a new head (output); trees are added to the last head. Returns its index.
  size_t add_head();
  // Validates and appends one tree to the last head; throws std::invalid_argument.
  void add_tree(const TreeArrays& t);

  // out[h * n_rows + r] = raw score of head h for row r (rows: n_rows x n_features, row-major).
  void predict(const double* rows, size_t n_rows, double* out) const;

 private:
  struct CatRef {
    int32_t begin;  // bitset offset into cats_, and its length in 32-bit words
    int32_t len;
  };
  // 24 bytes. A leaf is a node too (``leaf`` set, its value in ``threshold``, both sides itself).
  struct Node {
    union {
      double threshold;  // plain / missing-aware numerical split, or a leaf's value
      CatRef cat;        // categorical split (only the member that was written is read)
    };
    int32_t left;  // absolute node indices
    int32_t right;
    int32_t feature;
    uint8_t kind;  // kPlain, kNumerical, kCategorical
    uint8_t missing;  // 0 none, 1 zero, 2 NaN
    uint8_t default_left;
    uint8_t leaf;
  };
  enum : uint8_t { kPlain = 0, kNumerical = 1, kCategorical = 2 };
  struct Tree {
    int32_t root;
  };
  struct Head {
    size_t first_tree = 0;
    size_t n_trees = 0;
  };

  int32_t step(const Node& nd, const double* plain, const double* raw) const;
  int32_t slow_step(const Node& nd, const double* raw) const;

  int32_t n_features_;
  std::vector<Node> nodes_;
  std::vector<uint32_t> cats_;
  std::vector<Tree> trees_;
  std::vector<Head> heads_;
};

}  // namespace bea

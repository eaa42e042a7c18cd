// drawn.rejection_walk as one call per step on CPU (engine/walk_kernel.py builds and loads it): the same chain, the
// same walk, decision for decision on the same uniforms, without the ~150 tensor operations on tiny tensors the
// PyTorch reference issues per step. Rows are independent and shared by torch's OpenMP threads.
//
// Per node with children (its slot f in the heads' q), the rejection chain over its children in rank order, with p
// the target restricted to the draft vocabulary plus one last bucket for the mass outside it (q is zero there):
//   fixed rank: q_r = point mass at the child;  drawn rank: q_r = q / sum(q)
//   alpha_r = min(1, p(c) / q_r(c)) where q_r(c) > 0, else 0;  then p <- norm(max(p - q_r, 0)) (kept where its mass
//   is ~0: that child is accepted surely) and q(c) <- 0.
// p is kept unnormalised with a scale, so each rank is one pass over the vocabulary.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr double TINY = 1e-30;

struct Shape {
  int64_t size, width, max_depth, ancestor_cols;
  const int64_t *parent, *rank, *depth, *children, *ancestor_at;
};

struct Draft {
  int64_t slots, vq;  // nodes with children; the draft vocabulary's size (the target's when vocab is null)
  const float* q;     // [B, slots, vq]
  const int64_t *slot, *index, *vocab;  // [size], [B, size], [vq] or null
};

// p at `node` over the draft vocabulary plus the outside bucket, into out[vq + 1]
void target_at(const float* probs_row, const Draft& d, float* out) {
  double sum = 0;
  for (int64_t j = 0; j < d.vq; j++) {
    float v = d.vocab ? probs_row[d.vocab[j]] : probs_row[j];
    out[j] = v;
    sum += v;
  }
  out[d.vq] = static_cast<float>(std::max(1.0 - sum, 0.0));
}

// The chain at one node: alpha[width] and, if residual is given, the p left once every child was rejected.
void chain(const Shape& s, const Draft& d, const float* probs_row, const float* q_node, const int64_t* index_row,
           int64_t node, int64_t fixed, float* alpha, std::vector<float>& p, std::vector<float>& q) {
  const int64_t n = d.vq + 1;
  target_at(probs_row, d, p.data());
  std::copy(q_node, q_node + d.vq, q.begin());
  q[d.vq] = 0.0f;
  double q_sum = 0;
  for (int64_t j = 0; j < d.vq; j++) q_sum += q[j];
  double p_scale = 1.0;
  for (int64_t r = 0; r < s.width; r++) {
    const int64_t child = s.children[node * s.width + r];
    alpha[r] = 0.0f;
    if (child < 0) continue;
    const int64_t at = index_row[child];
    const bool point = r < fixed;
    const double q_scale = point ? 0.0 : 1.0 / std::max(q_sum, TINY);
    const double q_c = point ? 1.0 : q[at] * q_scale;
    if (!(q_c > 0)) continue;  // a drawn child of q-mass 0 is no child
    const double p_c = p[at] * p_scale;
    alpha[r] = static_cast<float>(std::min(p_c / std::max(q_c, TINY), 1.0));
    double mass = 0;
    if (point) {
      for (int64_t j = 0; j < n; j++) mass += p[j] * p_scale;
      mass -= std::min(p_c, 1.0);  // max(p - point, 0) takes min(p(c), 1) off at the child alone
    } else {
      for (int64_t j = 0; j < n; j++) mass += std::max(p[j] * p_scale - q[j] * q_scale, 0.0);
    }
    if (mass > 1e-12) {
      if (point) {
        p[at] = static_cast<float>(std::max(p_c - 1.0, 0.0) / p_scale);
      } else {
        for (int64_t j = 0; j < n; j++)
          p[j] = static_cast<float>(std::max(p[j] * p_scale - q[j] * q_scale, 0.0));
        p_scale = 1.0;
      }
      p_scale /= mass;
    }
    q_sum -= q[at];
    q[at] = 0.0f;
  }
  for (int64_t j = 0; j < n; j++) p[j] = static_cast<float>(p[j] * p_scale);
}

// inverse_cdf: the first index whose float64 running sum exceeds u * total (`skip`: indices weighted 0)
int64_t inverse_cdf(const float* w, int64_t n, double u, const std::vector<char>* skip = nullptr) {
  double total = 0;
  for (int64_t j = 0; j < n; j++)
    if (!skip || !(*skip)[j]) total += w[j];
  const double at = u * total;
  double cdf = 0;
  for (int64_t j = 0; j < n; j++) {
    if (!skip || !(*skip)[j]) cdf += w[j];
    if (cdf > at) return j;
  }
  return n - 1;
}

}  // namespace

extern "C" int rejection_walk(
    int64_t size, int64_t width, int64_t max_depth, int64_t ancestor_cols, const int64_t* parent,
    const int64_t* rank, const int64_t* depth, const int64_t* children, const int64_t* ancestor_at,
    int64_t batch, int64_t slots, int64_t vq, const float* q, const int64_t* slot, const int64_t* index,
    const int64_t* vocab, int64_t vocab_size, const float* probs, int64_t fixed, const double* uniforms,
    int64_t uniform_cols, const double* outside_uniforms,
    int64_t* accepted, int64_t* next_root, double* alpha_sum, double* tried, double* reach) {
  if (width < 1 || width > uniform_cols || max_depth < 1 || ancestor_cols < max_depth + 1) return 1;
  const Shape s{size, width, max_depth, ancestor_cols, parent, rank, depth, children, ancestor_at};
  const Draft d{slots, vq, q, slot, index, vocab};
  const int64_t urow = (max_depth + 2) * uniform_cols;
  std::vector<double> partial(static_cast<size_t>(batch) * max_depth * width * 2, 0.0);
  std::vector<char> in_vocab;
  if (vocab) {
    in_vocab.assign(vocab_size, 0);
    for (int64_t j = 0; j < vq; j++) in_vocab[vocab[j]] = 1;
  }

#pragma omp parallel for schedule(static) if (batch > 1)
  for (int64_t b = 0; b < batch; b++) {
    std::vector<float> p(vq + 1), qq(vq + 1), alpha(slots * width, 0.0f);
    const int64_t* index_row = index + b * size;
    const float* probs_b = probs + b * size * vocab_size;
    for (int64_t node = 0; node < size; node++)
      if (children[node * width] >= 0)
        chain(s, d, probs_b + node * vocab_size, q + (b * slots + slot[node]) * vq, index_row, node, fixed,
              alpha.data() + slot[node] * width, p, qq);

    // the walk: at each node, its children in rank order until one is accepted
    const double* u = uniforms + b * urow;
    double* sums = partial.data() + static_cast<size_t>(b) * max_depth * width * 2;
    int64_t stop = 0;
    for (bool moved = true; moved && children[stop * width] >= 0;) {
      moved = false;
      const int64_t at_depth = depth[stop];
      for (int64_t r = 0; r < width && children[stop * width + r] >= 0; r++) {
        const double chance = alpha[slot[stop] * width + r];
        sums[(at_depth * width + r) * 2] += chance;
        sums[(at_depth * width + r) * 2 + 1] += 1.0;
        if (u[at_depth * uniform_cols + r] < chance) {
          stop = children[stop * width + r];
          moved = true;
          break;
        }
      }
    }
    for (int64_t k = 0; k <= max_depth; k++)
      accepted[b * (max_depth + 1) + k] = k <= depth[stop] ? ancestor_at[stop * ancestor_cols + k] : -1;

    // the next root: the chain's residual where the row stopped past its children, p itself at a leaf
    if (children[stop * width] >= 0)
      chain(s, d, probs_b + stop * vocab_size, q + (b * slots + slot[stop]) * vq, index_row, stop, fixed,
            alpha.data() + slot[stop] * width, p, qq);
    else
      target_at(probs_b + stop * vocab_size, d, p.data());
    int64_t root = inverse_cdf(p.data(), vq + 1, u[(max_depth + 1) * uniform_cols]);
    if (vocab) {
      root = root == vq ? inverse_cdf(probs_b + stop * vocab_size, vocab_size, outside_uniforms[b], &in_vocab)
                        : vocab[std::min(root, vq - 1)];
    }
    next_root[b] = root;

    // each node's chance of being accepted given the drawn tokens: the product of its path's edges
    double* reach_b = reach + b * size;
    reach_b[0] = 1.0;
    for (int64_t node = 1; node < size; node++) {
      const float* a = alpha.data() + slot[parent[node]] * width;
      double edge = a[rank[node]];
      for (int64_t r = 0; r < rank[node]; r++) edge *= 1.0 - static_cast<double>(a[r]);
      reach_b[node] = reach_b[parent[node]] * std::max(edge, TINY);
    }
  }

  for (int64_t k = 0; k < max_depth * width; k++) {
    double a = 0, t = 0;
    for (int64_t b = 0; b < batch; b++) {
      a += partial[(static_cast<size_t>(b) * max_depth * width + k) * 2];
      t += partial[(static_cast<size_t>(b) * max_depth * width + k) * 2 + 1];
    }
    alpha_sum[k] = a;
    tried[k] = t;
  }
  return 0;
}

// drawn.rejection_walk as one call per step on CPU (engine/walk_kernel.py builds and loads it): the same chain, the
// same walk, decision for decision on the same uniforms, without the ~150 tensor operations on tiny tensors the
// PyTorch reference issues per step. Each row's and node's chain is independent: torch's OpenMP threads share them.
//
// Per node with children (its slot f in the heads' q), the rejection chain over its children in rank order, with p
// the target restricted to the draft vocabulary plus one last bucket for the mass outside it (q is zero there):
//   fixed rank: q_r = point mass at the child;  drawn rank: q_r = q / sum(q)
//   alpha_r = min(1, p(c) / q_r(c)) where q_r(c) > 0, else 0;  then p <- norm(max(p - q_r, 0)) (kept where its mass
//   is ~0: that child is accepted surely) and q(c) <- 0.
// p is kept unnormalised with a scale, so each rank is one pass over the vocabulary (float32 as the reference's;
// sums in float64).
#include <algorithm>
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
  if (d.vocab) {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < d.vq; j++) {
      out[j] = probs_row[d.vocab[j]];
      sum += out[j];
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < d.vq; j++) {
      out[j] = probs_row[j];
      sum += out[j];
    }
  }
  out[d.vq] = static_cast<float>(std::max(1.0 - sum, 0.0));
}

double total(const float* v, int64_t n) {
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; j++) sum += v[j];
  return sum;
}

// The chain at one node: alpha[width] and, in p, the target left once every child was rejected (normalised only
// where `residual` is asked). p, q and spare hold vq + 1 floats each.
void chain(const Shape& s, const Draft& d, const float* probs_row, const float* q_node, const int64_t* index_row,
           int64_t node, int64_t fixed, bool residual, float* alpha, std::vector<float>& p, std::vector<float>& q,
           std::vector<float>& spare) {
  const int64_t n = d.vq + 1;
  target_at(probs_row, d, p.data());
  std::copy(q_node, q_node + d.vq, q.begin());
  q[d.vq] = 0.0f;
  double p_scale = 1.0;  // the chain's p is p_scale * p
  for (int64_t r = 0; r < s.width; r++) {
    const int64_t child = s.children[node * s.width + r];
    alpha[r] = 0.0f;
    if (child < 0) continue;
    const int64_t at = index_row[child];
    const bool point = r < fixed;
    const double q_sum = point ? 1.0 : total(q.data(), d.vq);  // summed again, as the reference does: no drift
    const double q_c = point ? 1.0 : q[at] / std::max(q_sum, TINY);
    if (!(q_c > 0)) continue;  // a drawn child of q-mass 0 is no child
    const double p_c = p[at] * p_scale;
    alpha[r] = static_cast<float>(std::min(p_c / std::max(q_c, TINY), 1.0));
    if (point) {  // max(p - point mass, 0) differs from p at the child alone
      const double mass = total(p.data(), n) * p_scale - std::min(p_c, 1.0);
      if (mass > 1e-12) {
        p[at] = static_cast<float>(std::max(p_c - 1.0, 0.0) / p_scale);
        p_scale /= mass;
      }
    } else {
      const float ps = static_cast<float>(p_scale), qs = static_cast<float>(1.0 / std::max(q_sum, TINY));
      float* __restrict out = spare.data();
      const float *__restrict pp = p.data(), *__restrict qq = q.data();
      for (int64_t j = 0; j < n; j++) out[j] = std::max(pp[j] * ps - qq[j] * qs, 0.0f);
      const double mass = total(out, n);
      if (mass > 1e-12) {
        p.swap(spare);
        p_scale = 1.0 / mass;
      }
    }
    q[at] = 0.0f;
  }
  if (residual) {
    const float ps = static_cast<float>(p_scale);
    for (int64_t j = 0; j < n; j++) p[j] *= ps;
  }
}

// sum of w[j] * outside[j] (outside: 1 for the ids outside a draft vocabulary, 0 for its own)
double masked_total(const float* w, const float* outside, int64_t n) {
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; j++) sum += w[j] * outside[j];
  return sum;
}

// inverse_cdf: the first index whose float64 running sum exceeds u * total, found a block of sums at a time; with
// `outside`, over the weights outside a draft vocabulary only (the rare root drawn there)
int64_t inverse_cdf(const float* w, int64_t n, double u, const float* outside = nullptr) {
  constexpr int64_t BLOCK = 256;
  auto sum = [&](int64_t from, int64_t count) {
    return outside ? masked_total(w + from, outside + from, count) : total(w + from, count);
  };
  const double at = u * sum(0, n);
  double cdf = 0;
  int64_t j = 0;
  for (; j + BLOCK <= n; j += BLOCK) {
    const double next = cdf + sum(j, BLOCK);
    if (next > at) break;
    cdf = next;
  }
  for (; j < n; j++) {
    cdf += outside ? w[j] * outside[j] : w[j];
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
  std::vector<float> outside;
  if (vocab) {
    outside.assign(vocab_size, 1.0f);
    for (int64_t j = 0; j < vq; j++) outside[vocab[j]] = 0.0f;
  }

  std::vector<int64_t> inner;  // the nodes with children
  for (int64_t node = 0; node < size; node++)
    if (children[node * width] >= 0) inner.push_back(node);
  const int64_t chains = batch * static_cast<int64_t>(inner.size());
  std::vector<float> alpha(static_cast<size_t>(batch) * slots * width, 0.0f);

#pragma omp parallel if (chains > 1)
  {
    std::vector<float> p(vq + 1), qq(vq + 1), spare(vq + 1);
    // every node's chain, each row's and node's apart: the threads share them
#pragma omp for schedule(static)
    for (int64_t k = 0; k < chains; k++) {
      const int64_t b = k / static_cast<int64_t>(inner.size()), node = inner[k % inner.size()];
      chain(s, d, probs + (b * size + node) * vocab_size, q + (b * slots + slot[node]) * vq, index + b * size, node,
            fixed, false, alpha.data() + (b * slots + slot[node]) * width, p, qq, spare);
    }

#pragma omp for schedule(static)
    for (int64_t b = 0; b < batch; b++) {
      const float* alpha_b = alpha.data() + b * slots * width;
      // the walk: at each node, its children in rank order until one is accepted
      const double* u = uniforms + b * urow;
      double* sums = partial.data() + static_cast<size_t>(b) * max_depth * width * 2;
      int64_t stop = 0;
      for (bool moved = true; moved && children[stop * width] >= 0;) {
        moved = false;
        const int64_t at_depth = depth[stop];
        for (int64_t r = 0; r < width && children[stop * width + r] >= 0; r++) {
          const double chance = alpha_b[slot[stop] * width + r];
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

      // the next root: the chain's residual where the row stopped past its children (that one chain run again:
      // keeping every node's residual would move more memory than it saves), p itself at a leaf
      const float* probs_stop = probs + (b * size + stop) * vocab_size;
      if (children[stop * width] >= 0) {
        std::vector<float> unused(width);
        chain(s, d, probs_stop, q + (b * slots + slot[stop]) * vq, index + b * size, stop, fixed, true, unused.data(),
              p, qq, spare);
      } else {
        target_at(probs_stop, d, p.data());
      }
      int64_t root = inverse_cdf(p.data(), vq + 1, u[(max_depth + 1) * uniform_cols]);
      if (vocab) {
        root = root == vq ? inverse_cdf(probs_stop, vocab_size, outside_uniforms[b], outside.data())
                          : vocab[std::min(root, vq - 1)];
      }
      next_root[b] = root;

      // each node's chance of being accepted given the drawn tokens: the product of its path's edges
      double* reach_b = reach + b * size;
      reach_b[0] = 1.0;
      for (int64_t node = 1; node < size; node++) {
        const float* a = alpha_b + slot[parent[node]] * width;
        double edge = a[rank[node]];
        for (int64_t r = 0; r < rank[node]; r++) edge *= 1.0 - static_cast<double>(a[r]);
        reach_b[node] = reach_b[parent[node]] * std::max(edge, TINY);
      }
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

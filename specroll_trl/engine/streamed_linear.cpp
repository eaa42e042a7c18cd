// y[m*N+n] = sum_k x[m*K+k] * W[n*K+k] for 1 to 8 rows of x (engine/streamed.py builds and loads it): each weight
// row is read once, from memory, while the rows of x stay in cache. A BLAS GEMM repacks W on every call over more
// than a few rows and a GEMV reads W once per row of x. Plain C++ with GCC/Clang vector types (the compiler picks the
// machine's widest SIMD); OpenMP threads are torch's own (the library is loaded after torch, whose libgomp it
// shares). Prefetches may point past a weight's end: a prefetch never faults.
constexpr int LANES = 16;
constexpr long PREFETCH = 256;  // floats ahead of the weight being read: the hardware prefetcher alone lags here
typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline vec load(const float* p) { vec v; __builtin_memcpy(&v, p, sizeof v); return v; }

static inline float sum(vec v) {  // in halves: a lane-by-lane loop costs as much as a row's products
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

template <int M, int R>  // M rows of x against R rows of W at a time, every accumulator in a register
static inline void block(const float* x, const float* W, float* y, long N, long K, long n) {
  vec acc[M][R] = {};
  long k = 0;
  for (; k + LANES <= K; k += LANES) {
    vec w[R];
    for (int r = 0; r < R; r++) {
      w[r] = load(W + (n + r) * K + k);
      __builtin_prefetch(W + (n + r) * K + k + PREFETCH);
    }
    for (int m = 0; m < M; m++) {
      vec xv = load(x + m * K + k);
      for (int r = 0; r < R; r++) acc[m][r] += w[r] * xv;
    }
  }
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) {
      float s = sum(acc[m][r]);
      for (long j = k; j < K; j++) s += W[(n + r) * K + j] * x[m * K + j];
      y[m * N + n + r] = s;
    }
}

constexpr int MAX_MATRICES = 16;

// Several weights that read the same x (a layer's query, key and value projections) as one product: their rows are
// one index space shared by the threads, so small matrices keep every core busy.
template <int M, int R>
static void rows(const float* x, const float* const* Ws, float* const* ys, const long* Ns, int count, long K) {
  long starts[MAX_MATRICES + 1];  // each matrix's first block of R rows in the shared index space
  starts[0] = 0;
  for (int i = 0; i < count; i++) starts[i + 1] = starts[i] + (Ns[i] + R - 1) / R;
#pragma omp parallel for schedule(static)
  for (long b = 0; b < starts[count]; b++) {
    int i = 0;
    while (b >= starts[i + 1]) i++;
    long n = (b - starts[i]) * R;
    if (n + R <= Ns[i]) {
      block<M, R>(x, Ws[i], ys[i], Ns[i], K, n);
    } else {
      for (; n < Ns[i]; n++) block<M, 1>(x, Ws[i], ys[i], Ns[i], K, n);
    }
  }
}

// ys[i][m * Ns[i] + n] = x[m] . Ws[i][n] for every matrix i < count <= MAX_MATRICES, M = 1..8 rows of K floats.
// 0 on success, 1 for a row or matrix count it has no code for.
extern "C" int streamed_linear(const float* x, const float* const* Ws, float* const* ys, const long* Ns, int count,
                               long M, long K) {
  if (count < 1 || count > MAX_MATRICES) return 1;
  switch (M) {
    case 1: rows<1, 8>(x, Ws, ys, Ns, count, K); return 0;
    case 2: rows<2, 8>(x, Ws, ys, Ns, count, K); return 0;
    case 3: rows<3, 6>(x, Ws, ys, Ns, count, K); return 0;
    case 4: rows<4, 6>(x, Ws, ys, Ns, count, K); return 0;
    case 5: rows<5, 4>(x, Ws, ys, Ns, count, K); return 0;
    case 6: rows<6, 4>(x, Ws, ys, Ns, count, K); return 0;
    case 7: rows<7, 3>(x, Ws, ys, Ns, count, K); return 0;
    case 8: rows<8, 3>(x, Ws, ys, Ns, count, K); return 0;
  }
  return 1;
}

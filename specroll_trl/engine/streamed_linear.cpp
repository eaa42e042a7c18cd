// y[m*N+n] = sum_k x[m*K+k] * W[n*K+k] for 1 to 8 rows of x (engine/streamed.py builds and loads it): each weight
// row is read once, from memory, while the rows of x stay in cache. A BLAS GEMM repacks W on every call over more
// than a few rows and a GEMV reads W once per row of x; here 5 rows cost little more than one. Plain C++ with
// GCC/Clang vector types (the compiler picks the machine's widest SIMD); OpenMP threads are torch's own (the library
// is loaded after torch, whose libgomp it shares).
constexpr int LANES = 16;
constexpr long PREFETCH = 256;  // floats ahead of the weight being read: the hardware prefetcher alone lags here
typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

static inline vec load(const float* p) { vec v; __builtin_memcpy(&v, p, sizeof v); return v; }

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
      float s = 0;
      for (int l = 0; l < LANES; l++) s += acc[m][r][l];
      for (long j = k; j < K; j++) s += W[(n + r) * K + j] * x[m * K + j];
      y[m * N + n + r] = s;
    }
}

template <int M, int R>
static void rows(const float* x, const float* W, float* y, long N, long K) {
  long full = N / R * R;
#pragma omp parallel for schedule(static)
  for (long n = 0; n < full; n += R) block<M, R>(x, W, y, N, K, n);
  for (long n = full; n < N; n++) block<M, 1>(x, W, y, N, K, n);
}

// 0 on success, 1 for a row count it has no code for.
extern "C" int streamed_linear(const float* x, const float* W, float* y, long M, long N, long K) {
  switch (M) {
    case 1: rows<1, 8>(x, W, y, N, K); return 0;
    case 2: rows<2, 8>(x, W, y, N, K); return 0;
    case 3: rows<3, 6>(x, W, y, N, K); return 0;
    case 4: rows<4, 6>(x, W, y, N, K); return 0;
    case 5: rows<5, 4>(x, W, y, N, K); return 0;
    case 6: rows<6, 4>(x, W, y, N, K); return 0;
    case 7: rows<7, 3>(x, W, y, N, K); return 0;
    case 8: rows<8, 3>(x, W, y, N, K); return 0;
  }
  return 1;
}

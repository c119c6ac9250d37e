// A command-line driver of the group-quantized matmul (quant_matmul.cpp), for checking a build for another CPU
// (tests/torch/test_kernels_cross.py: cross-compiled for aarch64, linked statically, run under qemu-user).
//
//   quant_driver IN OUT [IN OUT ...]
//
// Each IN: int32 fmt, rows, N, K; int64 the packed weights' bytes; those bytes (pack_own's layout for this build's
// tile); rows * K float32 activations. Its OUT: rows * N float32 outputs (llmserve_quant_matmul on one thread,
// float32 in and out). Several pairs in one run: one emulator start for all. Prints "isa tile" on stdout; exits 2
// on a malformed input or a size this build would not read.
//
// Not part of the library (attention.py's _SOURCES lists its sources; this folder is not among them).

#include <cstdint>
#include <cstdio>
#include <vector>

extern "C" {
const char* llmserve_quant_isa();
int llmserve_quant_tile();
int64_t llmserve_quant_bytes(int fmt, int N, int K);
void llmserve_quant_matmul(int fmt, const void* x, int64_t xs, int rows, const uint8_t* w, void* y, int64_t ys, int N,
                           int K, int elem_size, int out_size, int th, int narrow);
}

namespace {

template <typename T>
bool read(FILE* f, T* p, size_t n) {
  return std::fread(p, sizeof(T), n, f) == n;
}

int fail(const char* why) {
  std::fprintf(stderr, "quant_driver: %s\n", why);
  return 2;
}

// One IN -> OUT pair; 0, or 2 with the reason on stderr
int run(const char* in_path, const char* out_path) {
  FILE* in = std::fopen(in_path, "rb");
  if (in == nullptr) return fail("cannot open IN");
  int32_t head[4];
  int64_t nbytes;
  if (!read(in, head, 4) || !read(in, &nbytes, 1)) return fail("short header");
  const int fmt = head[0], rows = head[1], N = head[2], K = head[3];
  if (rows <= 0 || N <= 0 || K <= 0 || K % 32 != 0) return fail("bad rows, N or K");
  const int64_t want = llmserve_quant_bytes(fmt, N, K);
  if (want < 0) return fail("unknown format");
  if (want != nbytes) {
    std::fprintf(stderr, "quant_driver: %lld bytes of weights where this build reads %lld\n",
                 static_cast<long long>(nbytes), static_cast<long long>(want));
    return 2;
  }
  std::vector<uint8_t> w(static_cast<size_t>(nbytes));
  std::vector<float> x(static_cast<size_t>(rows) * K), y(static_cast<size_t>(rows) * N);
  if (!read(in, w.data(), w.size()) || !read(in, x.data(), x.size())) return fail("short weights or activations");
  char extra;
  if (std::fread(&extra, 1, 1, in) != 0) return fail("trailing bytes");
  std::fclose(in);

  llmserve_quant_matmul(fmt, x.data(), K, rows, w.data(), y.data(), N, N, K, 4, 4, 1, 0);

  FILE* out = std::fopen(out_path, "wb");
  if (out == nullptr || std::fwrite(y.data(), sizeof(float), y.size(), out) != y.size() || std::fclose(out) != 0)
    return fail("cannot write OUT");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || argc % 2 == 0) return fail("usage: quant_driver IN OUT [IN OUT ...]");
  for (int i = 1; i < argc; i += 2)
    if (const int rc = run(argv[i], argv[i + 1])) return rc;
  std::printf("%s %d\n", llmserve_quant_isa(), llmserve_quant_tile());
  return 0;
}

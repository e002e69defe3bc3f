// Multi-buffer MD5 of byte ranges of open files (the checks of a dataset sync).
//
// MD5 is a serial chain per message, so one core hashes one message at about 0.8 GB/s. Many
// messages (files, or the parts of a multipart upload) are independent, so they are hashed side
// by side in SIMD lanes: 32 with AVX-512 (two registers), 8 with AVX2, one otherwise. The
// instruction set is chosen when the module loads, from what the CPU has.
#if (defined(__x86_64__) || defined(__i386__)) && !defined(MD5_PORTABLE)
#define MD5_X86 1
#include <immintrin.h>
#endif
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace md5 {

struct Job {
  int fd;
  int64_t offset, length;
  uint32_t init[4];    // the state to start from: MD5's initial one, or where an earlier call stopped
  uint64_t prior;      // bytes of the message hashed before this range
  bool final;          // the range ends the message: pad it and give the digest
};
struct Digest {
  uint8_t bytes[16];
  bool ok = false;
};
struct Stream {   // a message in flight: its job, bytes read, MD5 state and bytes read but not hashed
  long job = -1;
  int64_t pos = 0;
  bool last = false;   // the bytes read end the range (and its padding, if it ends the message)
  uint32_t state[4] = {};
  std::vector<uint8_t> rest;
};
constexpr size_t kChunk = 64 * 1024;       // bytes read at a time per lane
constexpr size_t kStride = kChunk + 128;   // a lane's buffer: a chunk and room for the padding

constexpr uint32_t kSine[64] = {
    0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613, 0xfd469501,
    0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193, 0xa679438e, 0x49b40821,
    0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d, 0x02441453, 0xd8a1e681, 0xe7d3fbc8,
    0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed, 0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a,
    0xfffa3942, 0x8771f681, 0x6d9d6122, 0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70,
    0x289b7ec6, 0xeaa127fa, 0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665,
    0xf4292244, 0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
    0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb, 0xeb86d391,
};
constexpr int kShift[64] = {7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22,
                            5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20,
                            4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23,
                            6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21};

namespace scalar {
struct V {
  static constexpr size_t W = 1;
  using R = uint32_t;
  static R set1(uint32_t x) { return x; }
  static R load(const uint32_t *p) { return *p; }
  static void store(uint32_t *p, R x) { *p = x; }
  static R add(R a, R b) { return a + b; }
  template <int S> static R rol(R x) { return (x << S) | (x >> (32 - S)); }
  static R f(R b, R c, R d) { return d ^ (b & (c ^ d)); }
  static R g(R b, R c, R d) { return c ^ (d & (b ^ c)); }
  static R h(R b, R c, R d) { return b ^ c ^ d; }
  static R i(R b, R c, R d) { return c ^ (b | ~d); }
  static R gather(const uint8_t *base, R offset) {
    uint32_t w;
    std::memcpy(&w, base + offset, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap32(w);            // MD5's words are little-endian
#endif
    return w;
  }
};
#include "md5_lanes.inc"
}  // namespace scalar

#ifdef MD5_X86
#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
struct V {
  static constexpr size_t W = 8;
  using R = __m256i;
  static R set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static R load(const uint32_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }
  static void store(uint32_t *p, R x) { _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), x); }
  static R add(R a, R b) { return _mm256_add_epi32(a, b); }
  template <int S> static R rol(R x) { return _mm256_or_si256(_mm256_slli_epi32(x, S), _mm256_srli_epi32(x, 32 - S)); }
  static R f(R b, R c, R d) { return _mm256_xor_si256(d, _mm256_and_si256(b, _mm256_xor_si256(c, d))); }
  static R g(R b, R c, R d) { return _mm256_xor_si256(c, _mm256_and_si256(d, _mm256_xor_si256(b, c))); }
  static R h(R b, R c, R d) { return _mm256_xor_si256(_mm256_xor_si256(b, c), d); }
  static R i(R b, R c, R d) {
    return _mm256_xor_si256(c, _mm256_or_si256(b, _mm256_xor_si256(d, _mm256_set1_epi32(-1))));
  }
  static R gather(const uint8_t *base, R offsets) {
    return _mm256_i32gather_epi32(reinterpret_cast<const int *>(base), offsets, 1);
  }
};
#include "md5_lanes.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"   // in GCC's own header, for _mm512_rol_epi32
namespace avx512 {
struct V {
  static constexpr size_t W = 16;
  using R = __m512i;
  static R set1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static R load(const uint32_t *p) { return _mm512_loadu_si512(p); }
  static void store(uint32_t *p, R x) { _mm512_storeu_si512(p, x); }
  static R add(R a, R b) { return _mm512_add_epi32(a, b); }
  template <int S> static R rol(R x) { return _mm512_rol_epi32(x, S); }
  // vpternlogd: bit k of the immediate is the result for inputs (b, c, d) = the bits of k
  static R f(R b, R c, R d) { return _mm512_ternarylogic_epi32(b, c, d, 0xca); }
  static R g(R b, R c, R d) { return _mm512_ternarylogic_epi32(b, c, d, 0xe4); }
  static R h(R b, R c, R d) { return _mm512_ternarylogic_epi32(b, c, d, 0x96); }
  static R i(R b, R c, R d) { return _mm512_ternarylogic_epi32(b, c, d, 0x39); }
  static R gather(const uint8_t *base, R offsets) { return _mm512_i32gather_epi32(offsets, base, 1); }
};
#include "md5_lanes.inc"
}  // namespace avx512

// Two registers per word: two independent chains per step keep the vector units busy while each
// waits on its own latency (about 1.4 times the throughput of one register).
namespace avx512x2 {
struct V {
  using H = avx512::V;
  static constexpr size_t W = 2 * H::W;
  struct R {
    H::R x, y;
  };
  static R set1(uint32_t v) { return {H::set1(v), H::set1(v)}; }
  static R load(const uint32_t *p) { return {H::load(p), H::load(p + H::W)}; }
  static void store(uint32_t *p, R a) { H::store(p, a.x), H::store(p + H::W, a.y); }
  static R add(R a, R b) { return {H::add(a.x, b.x), H::add(a.y, b.y)}; }
  template <int S> static R rol(R a) { return {H::rol<S>(a.x), H::rol<S>(a.y)}; }
  static R f(R b, R c, R d) { return {H::f(b.x, c.x, d.x), H::f(b.y, c.y, d.y)}; }
  static R g(R b, R c, R d) { return {H::g(b.x, c.x, d.x), H::g(b.y, c.y, d.y)}; }
  static R h(R b, R c, R d) { return {H::h(b.x, c.x, d.x), H::h(b.y, c.y, d.y)}; }
  static R i(R b, R c, R d) { return {H::i(b.x, c.x, d.x), H::i(b.y, c.y, d.y)}; }
  static R gather(const uint8_t *base, R o) { return {H::gather(base, o.x), H::gather(base, o.y)}; }
};
#include "md5_lanes.inc"
}  // namespace avx512x2
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif  // MD5_X86

using Engine = void (*)(const std::vector<Job> &, size_t &, std::vector<Stream> &, std::vector<Digest> &, size_t);
enum class Isa { kNone, kAvx2, kAvx512 };
struct Width {
  size_t lanes;
  Engine run;
  Isa needs;
};
// Widest first; on CPUs other than x86 (aarch64 head nodes) the portable one-lane engine.
const Width kWidths[] = {
#ifdef MD5_X86
    {32, avx512x2::hash_jobs, Isa::kAvx512},
    {16, avx512::hash_jobs, Isa::kAvx512},
    {8, avx2::hash_jobs, Isa::kAvx2},
#endif
    {1, scalar::hash_jobs, Isa::kNone}};

bool supported(const Width &w) {
#ifdef MD5_X86
  static const bool avx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f")),
                    avx2 = __builtin_cpu_supports("avx2");
  return w.needs == Isa::kAvx512 ? avx512 : w.needs == Isa::kAvx2 ? avx2 : true;
#else
  return w.needs == Isa::kNone;
#endif
}

size_t best_lanes() {
  for (const Width &w : kWidths)
    if (supported(w)) return w.lanes;
  return 1;
}

constexpr uint32_t kInit[4] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476};

Job parse(const py::handle &item) {
  auto t = py::cast<py::tuple>(item);
  if (t.size() != 3 && t.size() != 6)
    throw std::invalid_argument("md5_ranges: give (fd, offset, length) or (fd, offset, length, state, prior, final)");
  Job job{t[0].cast<int>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), {}, 0, true};
  std::copy(std::begin(kInit), std::end(kInit), job.init);
  if (job.offset < 0 || job.length < 0) throw std::invalid_argument("md5_ranges: negative offset or length");
  if (t.size() == 6) {
    std::string state = t[3].cast<std::string>();
    job.prior = t[4].cast<uint64_t>(), job.final = t[5].cast<bool>();
    if (!state.empty() && state.size() != 16) throw std::invalid_argument("md5_ranges: a state is 16 bytes");
    if (job.prior % 64 || (!job.final && job.length % 64))
      throw std::invalid_argument("md5_ranges: a message is continued only after a multiple of 64 bytes");
    if (!state.empty()) std::memcpy(job.init, state.data(), 16);   // the words, little-endian as the digest
  }
  return job;
}

// The widest engine (at most `lanes` wide) runs while it keeps more than half its lanes busy; the
// messages still in flight then go to the next narrower one, down to one lane for the last.
std::vector<py::object> md5_ranges(const py::sequence &ranges, size_t lanes) {
  const size_t best = best_lanes();
  if (lanes == 0) lanes = best;
  const bool known =
      std::any_of(std::begin(kWidths), std::end(kWidths), [&](const Width &w) { return w.lanes == lanes; });
  if (lanes > best || !known)
    throw std::invalid_argument("lanes=" + std::to_string(lanes) + ": this CPU hashes up to " + std::to_string(best) +
                                " messages at once, in 1, 8, 16 or 32 lanes; 0 for the most");
  std::vector<Job> jobs;
  jobs.reserve(ranges.size());
  for (const auto &item : ranges) jobs.push_back(parse(item));
  std::vector<Digest> out(jobs.size());
  {
    py::gil_scoped_release release;
    size_t next = 0;
    std::vector<Stream> carry;
    for (const Width &w : kWidths) {
      if (w.lanes > lanes || !supported(w)) continue;
      const size_t todo = carry.size() + jobs.size() - next, min_active = w.lanes == 1 ? 1 : w.lanes / 2 + 1;
      if (todo >= min_active) w.run(jobs, next, carry, out, min_active);
    }
  }
  std::vector<py::object> result;
  result.reserve(out.size());
  for (const Digest &d : out) {
    if (d.ok) result.push_back(py::bytes(reinterpret_cast<const char *>(d.bytes), 16));
    else result.push_back(py::none());
  }
  return result;
}

}  // namespace md5

PYBIND11_MODULE(_md5, m) {
  m.doc() = "Multi-buffer MD5 of byte ranges of open files (S3 ETags).";
  m.def("md5_ranges", &md5::md5_ranges,
        "MD5 digests (16 bytes) of (fd, offset, length) byte ranges of open files, several hashed at once in SIMD "
        "lanes (lanes=0: as many as the CPU has). None for a range the file ends before. Releases the GIL.\n"
        "A message hashed in pieces: (fd, offset, length, state, prior, final), where state is what the call for "
        "the previous piece gave (b'' for the first), prior the bytes hashed before (a multiple of 64) and final "
        "False for every piece but the last (whose result is then the digest).",
        py::arg("ranges"), py::arg("lanes") = 0);
  m.def("md5_lanes", &md5::best_lanes, "How many messages this CPU hashes at once: 32 (AVX-512), 8 (AVX2) or 1.");
}

// The input digest our request records carry (serving/observability/logs.py input_digest/raw_digest):
// "xxh3-128:" and the canonical (big-endian) hex of XXH3-128, seed 0, of the input buffers one after
// another. Shared by the server's front end and the benchmark's native reference; the hashing itself is
// digest.c, built per instruction set and chosen here once, at the first digest.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

extern "C" {
void sluicegate_xxh3_128_base(const void* const* data, const size_t* sizes, size_t count, unsigned char out[16]);
#if defined(__x86_64__)
void sluicegate_xxh3_128_avx2(const void* const* data, const size_t* sizes, size_t count, unsigned char out[16]);
void sluicegate_xxh3_128_avx512(const void* const* data, const size_t* sizes, size_t count, unsigned char out[16]);
#endif
}

namespace sluicegate {

using DigestFn = void (*)(const void* const*, const size_t*, size_t, unsigned char*);

inline DigestFn pick_digest() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return sluicegate_xxh3_128_avx512;
  if (__builtin_cpu_supports("avx2")) return sluicegate_xxh3_128_avx2;
#endif
  return sluicegate_xxh3_128_base;
}

// buffers: anything iterable of std::string or std::string_view (one request's raw_input_contents).
template <typename Buffers>
std::string input_digest(const Buffers& buffers) {
  static const DigestFn digest = pick_digest();  // thread-safe, once
  std::vector<const void*> data;
  std::vector<size_t> sizes;
  for (const auto& buffer : buffers) {
    data.push_back(buffer.data());
    sizes.push_back(buffer.size());
  }
  unsigned char raw[16];
  digest(data.data(), sizes.data(), data.size(), raw);
  static const char kHex[] = "0123456789abcdef";
  std::string out = "xxh3-128:";
  for (unsigned char byte : raw) {
    out.push_back(kHex[byte >> 4]);
    out.push_back(kHex[byte & 15]);
  }
  return out;
}

}  // namespace sluicegate

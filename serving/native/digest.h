// The input digest our request records carry (serving/observability/logs.py input_digest/raw_digest):
// "xxh3-128:" and the canonical (big-endian) hex of XXH3-128, seed 0, of the input buffers one after
// another. Shared by the server's front end and the benchmark's native reference.
#pragma once

#define XXH_INLINE_ALL  // header-only: the digest must not depend on which libxxhash is installed
#include <xxhash.h>

#include <string>

namespace sluicegate {

// buffers: anything iterable of std::string (one request's raw_input_contents).
template <typename Buffers>
std::string input_digest(const Buffers& buffers) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset(&state);
  for (const auto& buffer : buffers) XXH3_128bits_update(&state, buffer.data(), buffer.size());
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(&state));
  static const char kHex[] = "0123456789abcdef";
  std::string out = "xxh3-128:";
  for (unsigned char byte : canonical.digest) {
    out.push_back(kHex[byte >> 4]);
    out.push_back(kHex[byte & 15]);
  }
  return out;
}

}  // namespace sluicegate

/* XXH3-128 (seed 0) of buffers one after another, for serving/native/digest.h. Compiled once per
 * instruction set (build.py: SSE2 or the platform's baseline, and on x86-64 also AVX2 and AVX-512), each
 * copy under its own name from DIGEST_NAME; digest.h picks one at run time. XXH3 is the same function on
 * every path (xxHash guarantees it), only its speed differs: 48 KiB took 2.4-2.7 us with SSE2, 1.3 with AVX2
 * and 1.0-1.2 with AVX-512 on the benchmark VM. Plain C with xxHash inlined and nothing else, so no code built
 * for a wider instruction set can be shared with (and picked by the linker for) the rest of the module. */
#define XXH_INLINE_ALL
#include <string.h>
#include <xxhash.h>

#ifndef DIGEST_NAME
#error "DIGEST_NAME: the function's name for this instruction set"
#endif

void DIGEST_NAME(const void* const* data, const size_t* sizes, size_t count, unsigned char out[16]) {
  XXH128_hash_t hash;
  if (count == 1) {
    hash = XXH3_128bits(data[0], sizes[0]);
  } else {
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_128bits_reset(&state);
    for (size_t i = 0; i < count; ++i) XXH3_128bits_update(&state, data[i], sizes[i]);
    hash = XXH3_128bits_digest(&state);
  }
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, hash);
  memcpy(out, canonical.digest, 16);
}

// Capsule load in one pass: read a chunk, hash it while it is in cache, next.
// Reading then hashing the whole payload walks it through DRAM twice.
#include "flashrt.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

namespace flashrt {

uint64_t read_hashed(int fd, void* dst, std::size_t len, uint64_t seed, bool* short_read) {
  constexpr std::size_t kChunk = 1 << 20;  // fits L2 on current x86/ARM server cores
  auto* out = static_cast<unsigned char*>(dst);
  Xxh64Stream h(seed);
  *short_read = false;
  for (std::size_t done = 0; done < len;) {
    const std::size_t want = std::min(kChunk, len - done);
    std::size_t got = 0;
    while (got < want) {
      const ssize_t n = ::read(fd, out + done + got, want - got);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw std::system_error(errno, std::generic_category(), "read");
      }
      if (n == 0) {
        *short_read = true;
        return 0;
      }
      got += static_cast<std::size_t>(n);
    }
    h.update(out + done, want);
    done += want;
  }
  return h.digest();
}

}  // namespace flashrt

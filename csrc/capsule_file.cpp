// The common capsule load in one call: a file whose entry table is the one the
// target buffer already holds (the last file loaded into it). Header read,
// metadata parse, payload read + block checksums and the file checksum all run
// here, without the interpreter: at 1-4 MiB the per-file Python work (parse,
// several native calls, their argument conversions) cost as much as reading
// the bytes. Anything this path does not expect is left to the Python reader,
// which parses every form json accepts and names what is wrong.
#include "flashrt.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>
#include <vector>

namespace flashrt {
namespace {

constexpr char kPrefix[] = "{\"__metadata__\":{";   // save writes the metadata first, no spaces
constexpr int64_t kMaxHeader = 100000000;            // safetensors' own limit
constexpr std::size_t kFirstRead = 16 << 10;          // the header of most capsules

// One JSON string starting after its opening quote at p[i]; decoded into *out,
// i left after the closing quote. Only the escapes json.dumps(ensure_ascii)
// writes for ASCII text; \u escapes, raw control or non-ASCII bytes -> false.
bool read_string(const char* p, std::size_t n, std::size_t* i, std::string* out) {
  out->clear();
  std::size_t k = *i;
  while (k < n) {
    std::size_t run = k;  // plain characters go over in runs
    while (run < n && p[run] != '"' && p[run] != '\\' && static_cast<unsigned char>(p[run]) >= 0x20 &&
           static_cast<unsigned char>(p[run]) < 0x80)
      ++run;
    out->append(p + k, run - k);
    if (run == n) return false;
    k = run;
    if (p[k] == '"') {
      *i = k + 1;
      return true;
    }
    if (p[k] != '\\' || k + 1 == n) return false;   // raw control or non-ASCII byte
    switch (p[k + 1]) {
      case '"': out->push_back('"'); break;
      case '\\': out->push_back('\\'); break;
      case '/': out->push_back('/'); break;
      case 'b': out->push_back('\b'); break;
      case 'f': out->push_back('\f'); break;
      case 'n': out->push_back('\n'); break;
      case 'r': out->push_back('\r'); break;
      case 't': out->push_back('\t'); break;
      default: return false;
    }
    k += 2;
  }
  return false;
}

// The flat {"key":"value",...} metadata object at the head of the header, as
// save writes it; *checksum_at = offset in `h` of the raw checksum value.
bool parse_metadata(const char* h, std::size_t n, std::vector<MetadataItem>* md,
                    std::size_t* checksum_at) {
  const std::size_t plen = sizeof(kPrefix) - 1;
  if (n < plen || std::memcmp(h, kPrefix, plen) != 0) return false;
  md->clear();
  *checksum_at = 0;
  std::size_t i = plen;
  if (i < n && h[i] == '}') return true;
  for (;;) {
    MetadataItem item;
    if (i >= n || h[i++] != '"' || !read_string(h, n, &i, &item.key)) return false;
    if (i + 1 >= n || h[i] != ':' || h[i + 1] != '"') return false;
    i += 2;
    const std::size_t raw = i;
    if (!read_string(h, n, &i, &item.value)) return false;
    for (const MetadataItem& m : *md)
      if (m.key == item.key) return false;  // json keeps the last: let the Python reader decide
    if (item.key == "checksum") {
      if (i - 1 - raw != 16 || item.value.size() != 16) return false;  // 16 digits, unescaped
      *checksum_at = raw;
    }
    md->push_back(std::move(item));
    if (i >= n) return false;
    if (h[i] == '}') return true;
    if (h[i++] != ',') return false;
  }
}

// The metadata has exactly `keys`, and the `fixed` keys hold their values.
bool matches(const std::vector<MetadataItem>& md, const std::vector<std::string>& keys,
             const std::vector<MetadataItem>& fixed) {
  if (md.size() != keys.size()) return false;   // md has no duplicate keys
  for (const MetadataItem& m : md)
    if (std::find(keys.begin(), keys.end(), m.key) == keys.end()) return false;
  for (const MetadataItem& f : fixed) {
    const auto it = std::find_if(md.begin(), md.end(), [&](const MetadataItem& m) { return m.key == f.key; });
    if (it == md.end() || it->value != f.value) return false;
  }
  return true;
}

// pread until `len` bytes or the end of the file; bytes read.
std::size_t pread_full(int fd, char* dst, std::size_t len, int64_t offset) {
  std::size_t got = 0;
  while (got < len) {
    const ssize_t r = ::pread(fd, dst + got, len - got, offset + static_cast<int64_t>(got));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw std::system_error(errno, std::generic_category(), "pread");
    }
    if (r == 0) break;
    got += static_cast<std::size_t>(r);
  }
  return got;
}

}  // namespace

KnownLoad load_known_table(int fd, const std::vector<std::string>& keys,
                           const std::vector<MetadataItem>& fixed, const int64_t* addr,
                           const int64_t* nbytes, int64_t n, const int64_t* gap_addr,
                           const int64_t* gap_nbytes, int64_t ngaps, int64_t block,
                           int num_threads, std::vector<MetadataItem>* md) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw std::system_error(errno, std::generic_category(), "fstat");
  const int64_t size = st.st_size;
  std::string head(static_cast<std::size_t>(std::min<int64_t>(size, kFirstRead)), '\0');
  head.resize(pread_full(fd, &head[0], head.size(), 0));
  if (head.size() < 8) return KnownLoad::kNotFast;
  uint64_t hlen = 0;
  for (int b = 7; b >= 0; --b) hlen = (hlen << 8) | static_cast<unsigned char>(head[b]);  // LE
  if (hlen > static_cast<uint64_t>(std::min(kMaxHeader, size - 8))) return KnownLoad::kNotFast;
  const std::size_t end = 8 + static_cast<std::size_t>(hlen);
  if (head.size() < end) {
    const std::size_t had = head.size();
    head.resize(end);
    if (pread_full(fd, &head[had], end - had, static_cast<int64_t>(had)) != end - had)
      return KnownLoad::kNotFast;
  }
  head.resize(end);
  std::size_t at = 0;
  if (!parse_metadata(head.data() + 8, hlen, md, &at) || at == 0) return KnownLoad::kNotFast;
  at += 8;   // offset in the header with its length prefix
  if (!matches(*md, keys, fixed)) return KnownLoad::kNotFast;
  int64_t data_bytes = 0;
  for (int64_t i = 0; i < n; ++i) data_bytes += nbytes[i];
  if (data_bytes != size - static_cast<int64_t>(end)) return KnownLoad::kNotFast;

  // From here the buffer is written.
  for (int64_t i = 0; i < ngaps; ++i)
    std::memset(reinterpret_cast<void*>(gap_addr[i]), 0, static_cast<std::size_t>(gap_nbytes[i]));
  const int64_t nblocks = (data_bytes + block - 1) / block;
  std::vector<uint64_t> digests(static_cast<std::size_t>(nblocks) + 1);   // never empty
  if (!read_blocks_hashed(fd, static_cast<int64_t>(end), addr, nbytes, n, block, digests.data(),
                          num_threads))
    return KnownLoad::kShort;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  for (auto& d : digests) d = __builtin_bswap64(d);   // the format stores them little-endian
#endif
  static const char zeros[] = "0000000000000000";
  const ByteSpan parts[] = {{head.data(), at}, {zeros, 16}, {head.data() + at + 16, end - at - 16},
                            {digests.data(), static_cast<std::size_t>(nblocks) * 8}};
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(xxh3_64(parts, 4)));
  return std::memcmp(hex, head.data() + at, 16) == 0 ? KnownLoad::kLoaded : KnownLoad::kMismatch;
}

}  // namespace flashrt

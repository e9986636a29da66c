#include "launchers.h"

#include <cerrno>
#include <stdexcept>
#include <system_error>
#include <string>

#include "flashrt.h"

namespace py = pybind11;

namespace flashrt {
namespace launch {
namespace {

// std::invalid_argument surfaces in Python as ValueError.
void check_table(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes) {
  if (src.ndim() != 1 || dst.ndim() != 1 || nbytes.ndim() != 1)
    throw std::invalid_argument("segment tables must be 1-D int64 arrays");
  if (src.shape(0) != nbytes.shape(0) || dst.shape(0) != nbytes.shape(0))
    throw std::invalid_argument("segment tables differ in length: src " + std::to_string(src.shape(0)) +
                                ", dst " + std::to_string(dst.shape(0)) + ", nbytes " +
                                std::to_string(nbytes.shape(0)));
  const int64_t *s = src.data(), *d = dst.data(), *nb = nbytes.data();
  for (py::ssize_t i = 0; i < nbytes.shape(0); ++i) {
    if (nb[i] < 0)
      throw std::invalid_argument("segment " + std::to_string(i) + ": negative nbytes");
    if (nb[i] > 0 && (s[i] == 0 || d[i] == 0))
      throw std::invalid_argument("segment " + std::to_string(i) + ": null address");
  }
}

}  // namespace

void copy_segments_cpu(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes,
                       int num_threads) {
  check_table(src, dst, nbytes);
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = all cores)");
  py::gil_scoped_release nogil;  // the arrays stay alive: the caller holds them
  segcopy_cpu(src.data(), dst.data(), nbytes.data(), nbytes.shape(0), num_threads);
}

#ifdef FLASHRT_WITH_CUDA
void copy_segments_cuda(const Int64Array& src, const Int64Array& dst, const Int64Array& nbytes,
                        std::uintptr_t stream) {
  check_table(src, dst, nbytes);
  py::gil_scoped_release nogil;
  segcopy_cuda(src.data(), dst.data(), nbytes.data(), nbytes.shape(0), stream);
}
#endif

uint64_t xxh64(std::uintptr_t ptr, int64_t nbytes, uint64_t seed) {
  if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0");
  if (nbytes > 0 && ptr == 0) throw std::invalid_argument("null pointer");
  py::gil_scoped_release nogil;
  return flashrt::xxh64(reinterpret_cast<const void*>(ptr), static_cast<std::size_t>(nbytes), seed);
}

// Returns the digest, or None when the file ended before nbytes were read.
py::object read_hashed(int fd, std::uintptr_t ptr, int64_t nbytes, uint64_t seed) {
  if (fd < 0) throw std::invalid_argument("read_hashed: bad file descriptor");
  if (nbytes < 0) throw std::invalid_argument("read_hashed: nbytes must be >= 0");
  if (nbytes > 0 && ptr == 0) throw std::invalid_argument("read_hashed: null pointer");
  bool short_read = false;
  uint64_t h = 0;
  int err = 0;
  {
    py::gil_scoped_release nogil;
    try {
      h = flashrt::read_hashed(fd, reinterpret_cast<void*>(ptr), static_cast<std::size_t>(nbytes),
                               seed, &short_read);
    } catch (const std::system_error& e) {
      err = e.code().value();
    }
  }
  if (err) {  // with the GIL again: surface as OSError(errno)
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    throw py::error_already_set();
  }
  if (short_read) return py::none();
  return py::int_(h);
}

}  // namespace launch
}  // namespace flashrt

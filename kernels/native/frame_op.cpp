// colibri::recv_frame: the next frame off a connected stream socket (colibri_common/frames.py: an 8-byte header,
// the payload's size as a little-endian u32 and a status byte, then the payload), read in one call for the router's
// same-host links (router_service/moe/same_host.py), the payload straight into a tensor combine_replies reads:
//
//   recv_frame(fd, limit) -> (code, size, payload uint8 [size])
//       code >= 0: the frame's status (0 = OK, else a gRPC status code's number, the payload its message);
//       code < 0: no frame: -errno, or CLOSED (the peer closed before a frame), CUT (closed mid-frame),
//       OVER (the header says more than `limit` bytes: nothing of the payload is read, the connection is unusable)
//
// What it saves against frames.py's recv_frame: two buffers, their views and two to three recv_into calls, each
// a Python call on caches the workers have just flushed.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cerrno>
#include <cstdint>
#include <poll.h>
#include <sys/socket.h>
#include <tuple>

namespace {

constexpr int64_t CLOSED = -1000, CUT = -1001, OVER = -1002;    // kernels/native_wire.py's FRAME_CODES

// n bytes into p: 0 once read, CLOSED where the peer closed first (CUT where some were read), else -errno
int64_t read_exactly(int fd, uint8_t* p, size_t n, bool started) {
    size_t got = 0;
    while (got < n) {
        const ssize_t k = ::recv(fd, p + got, n - got, 0);
        if (k > 0) {
            got += size_t(k);
        } else if (k == 0) {
            return started || got ? CUT : CLOSED;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {           // a non-blocking socket: wait for bytes
            pollfd r{fd, POLLIN, 0};
            if (::poll(&r, 1, -1) < 0 && errno != EINTR) return -errno;
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    return 0;
}

std::tuple<int64_t, int64_t, at::Tensor> recv_frame(int64_t fd, int64_t limit) {
    uint8_t header[8];
    if (const int64_t rc = read_exactly(int(fd), header, sizeof header, false); rc < 0)
        return {rc, 0, at::empty({0}, at::kByte)};
    const int64_t size = int64_t(header[0]) | int64_t(header[1]) << 8 | int64_t(header[2]) << 16 |
                         int64_t(header[3]) << 24;
    if (size > limit) return {OVER, size, at::empty({0}, at::kByte)};
    at::Tensor payload = at::empty({size}, at::kByte);
    if (const int64_t rc = read_exactly(int(fd), payload.data_ptr<uint8_t>(), size_t(size), true); rc < 0)
        return {rc, size, at::empty({0}, at::kByte)};
    return {int64_t(header[4]), size, payload};
}

}  // namespace

// no tensor argument: registered for every dispatch key, as rest() and wake() are
TORCH_LIBRARY_FRAGMENT(colibri, m) { m.def("recv_frame(int fd, int limit) -> (int, int, Tensor)", &recv_frame); }

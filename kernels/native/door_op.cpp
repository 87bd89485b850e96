// colibri::door_*: a worker's same-host connections served in native code (expert_service/local_socket.py,
// expert_service/door.py). A connection's thread sits in `door_serve`, which reads each frame, answers the plain
// calls of a `colibri serve` fleet itself (expert_answer, the op the Python path's fast answer calls) from the table
// the worker published, writes the reply and reads the next frame, without entering Python; it returns to Python only
// with a frame it does not answer (any other kind of call, a refusal to word, a table not published) or when the
// connection ends.
//
//   door_open(bounds [B]) -> door; door_free(door)
//   door_publish(door, serve, x_dtype, H, E, epochs, digest, checkpoint, instance, layers..., files...)
//       the experts and placement epochs answered from now on (serve=false: none); returns once no call is computing
//       on the table it replaces, so its experts may then be unmapped
//   door_serve(door, fd, limit) -> (code, size, payload uint8 [size])
//       code >= 0: a frame for Python to answer (its status byte); else the connection ended: frame_op.cpp's codes
//   door_write(door, fd, status, payload uint8 [B]) -> 0 or -errno: Python's answer to such a frame
//   door_forget(door, fd): the connection closed (its buffered bytes dropped)
//   door_stats(door) -> (calls, rows, seconds, int64 counts [B + 1] per bound, then +Inf): what it answered (the worker's metrics)
//
// A call answered here is one the Python path answers with the same bytes: exact_sum set, no prefetch hint, the
// router's checkpoint the worker's (or either unset), an epoch the table serves and `holds` its digest (or 0), a MoE
// layer whose experts the table has, its files unchanged since they were mapped (fstat: size, mtime), and whatever
// expert_answer takes. Everything else, refusals included, is Python's, which says what is wrong.
//
// Both directions flow at once: a reply that the socket does not take whole (the router writing its next micro-batch's
// request meanwhile, not reading) is written as the socket drains while what the router writes is read into the
// connection's buffer, which the next frames are read from first.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"
#include "wire.h"

#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t CLOSED = -1000, CUT = -1001, OVER = -1002;    // kernels/native_wire.py's FRAME_CODES

struct Layer {                               // one MoE layer's experts as expert_answer takes them
    bool set = false;
    at::Tensor local;                        // int64 [E]: global id -> held row, -1 = not held
    int64_t w13 = 0, w2 = 0;                 // expert_blocks numbers
    c10::optional<at::Tensor> b13, b2;
    double alpha = 0, up_offset = 0;
    c10::optional<double> limit;
    bool w8a8 = false;
    std::vector<std::array<int64_t, 3>> files;   // (descriptor, size, mtime_ns) of the files read in place
};

struct Table {
    std::vector<uint64_t> epochs;
    uint64_t digest = 0, checkpoint = 0;
    std::string instance;
    int64_t x_dtype = 0, H = 0, E = 0;
    std::vector<Layer> layers;               // by layer number
    int users = 0;                           // calls computing on it (the door's lock)
};

struct Conn {                                // bytes read ahead while a reply was being written
    std::vector<uint8_t> in;
    size_t head = 0;
    bool eof = false;
};

struct Door {
    std::mutex lock;
    std::condition_variable idle;
    std::shared_ptr<Table> table;
    std::unordered_map<int64_t, Conn> conns;     // by descriptor (nodes: a reference stays valid)
    std::vector<double> bounds;
    std::vector<int64_t> counts;                 // per bound, then +Inf: not cumulative
    int64_t calls = 0, rows = 0;
    double seconds = 0;
};

std::mutex doors_lock;
std::unordered_map<int64_t, std::shared_ptr<Door>> doors;
int64_t doors_next = 1;

std::shared_ptr<Door> find_door(int64_t id) {       // null once freed
    std::lock_guard<std::mutex> hold(doors_lock);
    auto it = doors.find(id);
    return it == doors.end() ? nullptr : it->second;
}

std::shared_ptr<Door> door_of(int64_t id) {
    auto d = find_door(id);
    TORCH_CHECK(d, "colibri::door: no door numbered ", id);
    return d;
}

// n bytes into p: the connection's buffer first, then the socket; 0 once read, CLOSED where the peer closed first
// (CUT where some were read), else -errno
int64_t take(Conn& c, int fd, uint8_t* p, size_t n, bool started) {
    size_t got = std::min(n, c.in.size() - c.head);
    if (got) {
        std::memcpy(p, c.in.data() + c.head, got);
        c.head += got;
        if (c.head == c.in.size()) {
            c.in.clear();
            c.head = 0;
            if (c.in.capacity() > (size_t(1) << 22)) std::vector<uint8_t>().swap(c.in);   // a prefill's: not kept
        } else if (c.head > (size_t(1) << 20) && 2 * c.head > c.in.size()) {
            // the bytes read are dropped from the front: with several micro-batches a step's requests keep arriving
            // while replies wait, and the buffer would otherwise hold all of them until the step's last
            c.in.erase(c.in.begin(), c.in.begin() + std::ptrdiff_t(c.head));
            c.head = 0;
        }
    }
    while (got < n) {
        if (c.eof) return started || got ? CUT : CLOSED;
        const ssize_t k = ::recv(fd, p + got, n - got, 0);
        if (k > 0) {
            got += size_t(k);
        } else if (k == 0) {
            c.eof = true;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            pollfd r{fd, POLLIN, 0};
            if (::poll(&r, 1, -1) < 0 && errno != EINTR) return -errno;
        } else if (errno != EINTR) {
            return -errno;
        }
    }
    return 0;
}

// one frame out (colibri_common/frames.py's header, then the payload); what the peer writes meanwhile is read into
// the connection's buffer, so neither side waits on the other to read
int64_t put(Conn& c, int fd, int status, const uint8_t* p, size_t n) {
    uint8_t header[8] = {uint8_t(n), uint8_t(n >> 8), uint8_t(n >> 16), uint8_t(n >> 24), uint8_t(status), 0, 0, 0};
    size_t sent = 0;
    const size_t total = sizeof header + n;
    while (sent < total) {
        iovec iov[2];
        int parts = 0;
        if (sent < sizeof header) iov[parts++] = {header + sent, sizeof header - sent};
        const size_t from = sent < sizeof header ? 0 : sent - sizeof header;
        if (n > from) iov[parts++] = {const_cast<uint8_t*>(p) + from, n - from};
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = parts;
        const ssize_t k = ::sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k > 0) {
            sent += size_t(k);
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
        pollfd w{fd, short(POLLOUT | (c.eof ? 0 : POLLIN)), 0};
        if (::poll(&w, 1, -1) < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (w.revents & POLLIN) {
            uint8_t chunk[1 << 16];
            const ssize_t r = ::recv(fd, chunk, sizeof chunk, MSG_DONTWAIT);
            if (r > 0) {
                c.in.insert(c.in.end(), chunk, chunk + r);
            } else if (r == 0) {
                c.eof = true;
            } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                return -errno;
            }
        }
    }
    return 0;
}

struct Scalars {                             // a ForwardRequest's fields other than its tensors
    int64_t layer = 0;
    uint64_t epoch = 0, holds = 0, checkpoint = 0;
    bool exact_sum = false, explicit_pairs = false, prefetch = false;
};

// false where a field has another wire type than the message's (protobuf's parse then says what is wrong)
bool scalars(const uint8_t* s, uint64_t n, Scalars& out) {
    colibri_wire::Cursor c{s, s + n};
    while (c.p < c.end) {
        uint64_t key, field, v;
        int wire_type;
        if (!c.varint(key) || !colibri_wire::field_of(key, field, wire_type)) return false;
        if (field == 1 || field == 7 || field == 8 || field == 11 || field == 5) {      // varints
            if (wire_type != 0 || !c.varint(v)) return false;
            if (field == 1) out.layer = int64_t(int32_t(uint32_t(v)));                 // int32, as protobuf keeps it
            else if (field == 7) out.exact_sum = v != 0;
            else if (field == 8) out.epoch = v;
            else if (field == 11) out.explicit_pairs = v != 0;
        } else if (field == 9 || field == 10) {                                         // fixed64
            if (wire_type != 1 || c.end - c.p < 8) return false;
            std::memcpy(&v, c.p, 8);
            c.p += 8;
            (field == 9 ? out.holds : out.checkpoint) = v;
        } else {
            if (field == 6) out.prefetch = true;
            if (!c.skip(wire_type)) return false;
        }
    }
    return true;
}

bool unchanged(const Layer& layer) {
    for (const auto& f : layer.files) {
        struct stat st;
        if (::fstat(int(f[0]), &st) != 0 || int64_t(st.st_size) != f[1] ||
            int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec != f[2])
            return false;
    }
    return true;
}

// the reply to `payload` where this door answers it (the reply's bytes, rows, seconds); an empty reply otherwise
std::tuple<at::Tensor, int64_t, double> answer(Door& d, const at::Tensor& payload) {
    std::tuple<at::Tensor, int64_t, double> none{at::Tensor(), 0, 0.0};
    Scalars q;
    if (!scalars(payload.data_ptr<uint8_t>(), uint64_t(payload.numel()), q) || !q.exact_sum || q.prefetch)
        return none;
    std::shared_ptr<Table> t;
    {
        std::lock_guard<std::mutex> hold(d.lock);
        if (!d.table) return none;
        t = d.table;
        ++t->users;
    }
    struct Release {
        Door& d;
        Table& t;
        ~Release() {
            std::lock_guard<std::mutex> hold(d.lock);
            if (--t.users == 0) d.idle.notify_all();
        }
    } release{d, *t};
    if (q.checkpoint && t->checkpoint && q.checkpoint != t->checkpoint) return none;
    bool serves = false;
    for (uint64_t e : t->epochs) serves = serves || e == q.epoch;
    if (!serves || (q.holds && q.holds != t->digest)) return none;
    if (q.layer < 0 || q.layer >= int64_t(t->layers.size()) || !t->layers[q.layer].set) return none;
    const Layer& l = t->layers[q.layer];
    if (!unchanged(l)) return none;
    auto got = colibri_ops::expert_answer(payload, t->x_dtype, t->H, t->E, q.explicit_pairs, l.local, l.w13, l.w2,
                                          l.b13, l.b2, l.alpha, l.limit, l.up_offset, l.w8a8, t->instance);
    if (!std::get<0>(got).numel()) return none;
    return got;
}

int64_t door_open(c10::ArrayRef<double> bounds) {
    auto d = std::make_shared<Door>();
    d->bounds.assign(bounds.begin(), bounds.end());
    d->counts.assign(bounds.size() + 1, 0);
    std::lock_guard<std::mutex> hold(doors_lock);
    doors[doors_next] = std::move(d);
    return doors_next++;
}

void door_free(int64_t id) {
    std::shared_ptr<Door> gone;
    std::lock_guard<std::mutex> hold(doors_lock);
    auto it = doors.find(id);
    if (it == doors.end()) return;
    gone = std::move(it->second);
    doors.erase(it);
}

void door_publish(int64_t id, bool serve, int64_t x_dtype, int64_t H, int64_t E, c10::ArrayRef<int64_t> epochs,
                  int64_t digest, int64_t checkpoint, c10::string_view instance, c10::ArrayRef<int64_t> layers,
                  at::TensorList locals, c10::ArrayRef<int64_t> w13, c10::ArrayRef<int64_t> w2,
                  const c10::List<c10::optional<at::Tensor>>& b13, const c10::List<c10::optional<at::Tensor>>& b2,
                  c10::ArrayRef<double> alpha, c10::ArrayRef<double> limit, c10::ArrayRef<double> up_offset,
                  c10::ArrayRef<int64_t> w8a8, c10::ArrayRef<int64_t> file_layer, c10::ArrayRef<int64_t> file_fd,
                  c10::ArrayRef<int64_t> file_size, c10::ArrayRef<int64_t> file_mtime) {
    auto d = door_of(id);
    std::shared_ptr<Table> made;
    if (serve) {
        const size_t L = layers.size();
        TORCH_CHECK(locals.size() == L && w13.size() == L && w2.size() == L && b13.size() == L && b2.size() == L &&
                    alpha.size() == L && limit.size() == L && up_offset.size() == L && w8a8.size() == L,
                    "colibri::door_publish: one entry per layer in every layer list");
        TORCH_CHECK(file_fd.size() == file_layer.size() && file_size.size() == file_layer.size() &&
                    file_mtime.size() == file_layer.size(), "colibri::door_publish: one entry per file in each list");
        TORCH_CHECK(x_dtype == 0 || x_dtype == 1, "colibri::door_publish: x_dtype is 0 (float32) or 1 (bfloat16)");
        made = std::make_shared<Table>();
        for (int64_t e : epochs) made->epochs.push_back(uint64_t(e));
        made->digest = uint64_t(digest);
        made->checkpoint = uint64_t(checkpoint);
        made->instance = std::string(instance);
        made->x_dtype = x_dtype;
        made->H = H;
        made->E = E;
        int64_t most = -1;
        for (int64_t l : layers) {
            TORCH_CHECK(l >= 0 && l < (int64_t(1) << 20), "colibri::door_publish: layer ", l, " out of range");
            most = std::max(most, l);
        }
        made->layers.resize(size_t(most + 1));
        for (size_t i = 0; i < L; ++i) {
            TORCH_CHECK(locals[i].scalar_type() == at::kLong && locals[i].dim() == 1 && locals[i].numel() == E &&
                        locals[i].is_contiguous(), "colibri::door_publish: each layer's map is int64 [E]");
            Layer& l = made->layers[size_t(layers[i])];
            l.set = true;
            l.local = locals[i];
            l.w13 = w13[i];
            l.w2 = w2[i];
            l.b13 = b13.get(i);
            l.b2 = b2.get(i);
            l.alpha = alpha[i];
            if (limit[i] == limit[i]) l.limit = limit[i];                       // NaN: none
            l.up_offset = up_offset[i];
            l.w8a8 = w8a8[i] != 0;
        }
        for (size_t f = 0; f < file_layer.size(); ++f) {
            const int64_t l = file_layer[f];
            TORCH_CHECK(l >= 0 && l <= most && made->layers[size_t(l)].set,
                        "colibri::door_publish: a file of a layer not given");
            made->layers[size_t(l)].files.push_back({file_fd[f], file_size[f], file_mtime[f]});
        }
    }
    std::shared_ptr<Table> old;
    {
        std::unique_lock<std::mutex> hold(d->lock);
        old = std::move(d->table);
        d->table = std::move(made);
        d->idle.wait(hold, [&] { return !old || old->users == 0; });
    }
    // `old` goes here, outside the lock (its tensors' deleters may take the GIL)
}

std::tuple<int64_t, int64_t, at::Tensor> door_serve(int64_t id, int64_t fd, int64_t limit) {
    auto d = find_door(id);
    if (!d) return {CLOSED, 0, at::empty({0}, at::kByte)};          // freed: its connections end
    Conn* c;
    {
        std::lock_guard<std::mutex> hold(d->lock);
        c = &d->conns[fd];
    }
    for (;;) {
        uint8_t header[8];
        if (const int64_t rc = take(*c, int(fd), header, sizeof header, false); rc < 0)
            return {rc, 0, at::empty({0}, at::kByte)};
        const int64_t size = int64_t(header[0]) | int64_t(header[1]) << 8 | int64_t(header[2]) << 16 |
                             int64_t(header[3]) << 24;
        if (size > limit) return {OVER, size, at::empty({0}, at::kByte)};
        at::Tensor payload = at::empty({size}, at::kByte);
        if (const int64_t rc = take(*c, int(fd), payload.data_ptr<uint8_t>(), size_t(size), true); rc < 0)
            return {rc, size, at::empty({0}, at::kByte)};
        std::tuple<at::Tensor, int64_t, double> got;
        try {
            got = answer(*d, payload);
        } catch (const std::exception&) {       // (a registration gone, memory): Python answers it, and says why
            std::get<0>(got) = at::Tensor();
        }
        auto& [reply, rows, seconds] = got;
        if (!reply.defined()) return {int64_t(header[4]), size, payload};
        {                                              // counted before the reply goes, as the Python path counts
            std::lock_guard<std::mutex> hold(d->lock);
            ++d->calls;
            d->rows += rows;
            d->seconds += seconds;
            size_t b = 0;
            while (b < d->bounds.size() && seconds > d->bounds[b]) ++b;        // Prometheus' le: value <= bound
            ++d->counts[b];
        }
        if (const int64_t rc = put(*c, int(fd), 0, reply.data_ptr<uint8_t>(), size_t(reply.numel())); rc < 0)
            return {rc, 0, at::empty({0}, at::kByte)};
    }
}

int64_t door_write(int64_t id, int64_t fd, int64_t status, const at::Tensor& payload) {
    TORCH_CHECK(payload.scalar_type() == at::kByte && payload.dim() == 1 && payload.is_contiguous(),
                "colibri::door_write: the payload is a contiguous uint8 [B] tensor");
    TORCH_CHECK(status >= 0 && status < 256 && payload.numel() < (int64_t(1) << 32),
                "colibri::door_write: a status byte and under 4 GiB");
    auto d = find_door(id);
    if (!d) return -EBADF;                                          // freed: its connections end
    Conn* c;
    {
        std::lock_guard<std::mutex> hold(d->lock);
        c = &d->conns[fd];
    }
    return put(*c, int(fd), int(status), payload.numel() ? payload.data_ptr<uint8_t>() : nullptr,
               size_t(payload.numel()));
}

void door_forget(int64_t id, int64_t fd) {
    auto d = find_door(id);
    if (!d) return;
    std::lock_guard<std::mutex> hold(d->lock);
    d->conns.erase(fd);
}

std::tuple<int64_t, int64_t, double, at::Tensor> door_stats(int64_t id) {
    auto d = door_of(id);
    std::lock_guard<std::mutex> hold(d->lock);
    at::Tensor counts = at::empty({int64_t(d->counts.size())}, at::kLong);
    std::memcpy(counts.data_ptr<int64_t>(), d->counts.data(), d->counts.size() * sizeof(int64_t));
    return {d->calls, d->rows, d->seconds, counts};
}

}  // namespace

// no tensor argument (or only optional ones): registered for every dispatch key, as recv_frame
TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("door_open(float[] bounds) -> int", &door_open);
    m.def("door_free(int door) -> ()", &door_free);
    m.def("door_publish(int door, bool serve, int x_dtype, int H, int E, int[] epochs, int digest, int checkpoint, "
          "str instance, int[] layers, Tensor[] locals, int[] w13, int[] w2, Tensor?[] b13, Tensor?[] b2, "
          "float[] alpha, float[] limit, float[] up_offset, int[] w8a8, int[] file_layer, int[] file_fd, "
          "int[] file_size, int[] file_mtime) -> ()", &door_publish);
    m.def("door_serve(int door, int fd, int limit) -> (int, int, Tensor)", &door_serve);
    m.def("door_write(int door, int fd, int status, Tensor payload) -> int", &door_write);
    m.def("door_forget(int door, int fd) -> ()", &door_forget);
    m.def("door_stats(int door) -> (int, int, float, Tensor)", &door_stats);
}

// colibri::exit_on_sigbus: a read through a mapping whose file was truncated or replaced under the process faults
// with SIGBUS. The services check their mapped files before every read (colibri_common/file_watch.py), but a change
// that lands during a read still faults, and SIGBUS's default action kills the process without a word (exit -7).
// This handler names the mapped file the faulting address lies in, says what happened and exits with `code` (75,
// EX_TEMPFAIL: serve or Kubernetes starts the service again on the new file). Any other SIGBUS (a fault outside a
// file mapping, shared memory running out, a signal sent with kill) goes to the handler this one replaced, or the
// default action, as before.
//
//   exit_on_sigbus(int code) -> bool (installed)
//
// Only async-signal-safe calls in the handler: open/read/close of /proc/self/maps, stat, write to stderr, sigaction,
// raise, pause, _exit; buffers on the faulting thread's stack (several threads may fault at once: the first
// explains and exits, the others wait for that exit).

#include <torch/library.h>

#include <csignal>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

volatile sig_atomic_t exit_code = 75;
volatile sig_atomic_t dying = 0;                 // the first faulting thread explains and exits; the others wait
struct sigaction before {};                      // the handler this one replaced (faulthandler's, or the default)

void say(const char* s) {
    for (size_t n = strlen(s); n > 0;) {
        const ssize_t w = write(STDERR_FILENO, s, n);
        if (w <= 0) return;
        s += w;
        n -= size_t(w);
    }
}

uint64_t hex(const char*& p) {
    uint64_t v = 0;
    for (;; ++p) {
        const char c = *p;
        if (c >= '0' && c <= '9') v = v * 16 + uint64_t(c - '0');
        else if (c >= 'a' && c <= 'f') v = v * 16 + uint64_t(c - 'a' + 10);
        else return v;
    }
}

uint64_t dec(const char*& p) {
    uint64_t v = 0;
    for (; *p >= '0' && *p <= '9'; ++p) v = v * 10 + uint64_t(*p - '0');
    return v;
}

const char* skip(const char* p) {                // past one field and the spaces after it
    while (*p && *p != ' ') ++p;
    while (*p == ' ') ++p;
    return p;
}

// A file mapping of /proc/self/maps ("start-end perms offset dev inode   path") holding `addr`: the file's path,
// its inode, and the file offset of `addr`.
struct Where {
    char path[1024];
    uint64_t inode = 0, offset = 0;
};

bool file_of(const char* line, uint64_t addr, Where& at) {
    const char* p = line;
    const uint64_t lo = hex(p);
    if (*p++ != '-') return false;
    const uint64_t hi = hex(p);
    if (addr < lo || addr >= hi) return false;
    p = skip(skip(p));                                         // perms
    const uint64_t offset = hex(p);
    p = skip(skip(p));                                         // dev
    const uint64_t inode = dec(p);
    while (*p == ' ') ++p;
    if (*p != '/' || inode == 0) return false;                 // anonymous, [heap], [stack]: not a file
    size_t n = 0;
    while (p[n] && p[n] != '\n' && n + 1 < sizeof at.path) ++n;
    memcpy(at.path, p, n);
    at.path[n] = 0;
    at.inode = inode;
    at.offset = offset + (addr - lo);
    return true;
}

bool mapped_file(uint64_t addr, Where& at) {
    const int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    char buf[2048], line[2048];                                // this thread's stack: faults may come together
    size_t used = 0;
    bool found = false;
    for (ssize_t got; !found && (got = read(fd, buf, sizeof buf)) > 0;) {
        for (ssize_t i = 0; i < got && !found; ++i) {
            if (buf[i] != '\n') {
                if (used + 1 < sizeof line) line[used++] = buf[i];
                continue;
            }
            line[used] = 0;
            found = file_of(line, addr, at);
            used = 0;
        }
    }
    close(fd);
    return found;
}

// Not ours to explain (a signal sent with kill, a fault outside a file mapping, a file that did not change): the
// handler before this one takes it, as if this one had never been installed.
void pass_on(siginfo_t* info) {
    sigaction(SIGBUS, &before, nullptr);
    if (info->si_code <= 0) raise(SIGBUS);                     // sent, not a fault: nothing faults again
}                                                              // a fault: the instruction faults again, for it

bool starts(const char* s, const char* prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

// What became of the mapped file: a file that shrinks under a mapping is the only way a read of a checkpoint's
// bytes faults (its tensors were checked against its size when it was mapped).
const char* fate(Where& at) {
    const size_t n = strlen(at.path), tag = strlen(" (deleted)");
    if (n > tag && strcmp(at.path + n - tag, " (deleted)") == 0) {
        at.path[n - tag] = 0;
        return "was deleted or replaced (renamed over)";
    }
    struct stat st {};
    if (stat(at.path, &st) != 0) return "is gone";
    if (uint64_t(st.st_ino) != at.inode) return "was replaced";
    if (uint64_t(st.st_size) <= at.offset) return "was truncated";
    return "changed (it is long enough again: rewritten in place, as by a copy over it)";
}

void on_sigbus(int, siginfo_t* info, void*) {
    Where at;
    if (info->si_code != BUS_ADRERR || !mapped_file(reinterpret_cast<uint64_t>(info->si_addr), at) ||
        starts(at.path, "/memfd:") || starts(at.path, "/dev/shm/")) {   // shared memory running out: not a file's
        pass_on(info);
        return;
    }
    if (__sync_lock_test_and_set(&dying, 1))                   // another thread is explaining: wait for its exit
        for (;;) pause();
    const char* what = fate(at);
    say("colibri: SIGBUS reading ");
    say(at.path);
    say(" through its mapping: the file ");
    say(what);
    say(" while mapped, and the pages read are no more; exiting for a restart on the new file\n");
    _exit(exit_code);
}

bool exit_on_sigbus(int64_t code) {
    exit_code = sig_atomic_t(code);
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGBUS, &sa, &before) == 0;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(colibri, m) { m.def("exit_on_sigbus(int code) -> bool", &exit_on_sigbus); }

// colibri::exit_on_sigbus: a read through a mapping whose file was truncated or replaced under the process faults
// with SIGBUS. The services check their mapped files before every read (colibri_common/file_watch.py), but a change
// that lands during a read still faults, and SIGBUS's default action kills the process without a word (exit -7).
// This handler names the mapped file the faulting address lies in, says what happened and exits with `code` (75,
// EX_TEMPFAIL: serve or Kubernetes starts the service again on the new file). A fault outside any mapped file is
// not ours to explain: the default action is restored and the instruction faults again.
//
//   exit_on_sigbus(int code) -> bool (installed)
//
// Only async-signal-safe calls in the handler: open/read/close of /proc/self/maps, write to stderr, _exit.

#include <torch/library.h>

#include <csignal>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

namespace {

volatile sig_atomic_t exit_code = 75;

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

// The path of the file mapping holding `addr` ("" when none) from one line of /proc/self/maps:
// "start-end perms offset dev inode   path".
bool file_of(const char* line, uint64_t addr, char* path, size_t cap) {
    const char* p = line;
    const uint64_t lo = hex(p);
    if (*p++ != '-') return false;
    const uint64_t hi = hex(p);
    if (addr < lo || addr >= hi) return false;
    for (int field = 0; field < 4; ++field) {                  // perms, offset, dev, inode
        while (*p == ' ') ++p;
        while (*p && *p != ' ') ++p;
    }
    while (*p == ' ') ++p;
    if (*p != '/') return false;                                // anonymous, [heap], [stack]: not a file
    size_t n = 0;
    while (p[n] && p[n] != '\n' && n + 1 < cap) ++n;
    memcpy(path, p, n);
    path[n] = 0;
    return true;
}

bool mapped_file(uint64_t addr, char* path, size_t cap) {
    const int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    static char buf[8192], line[8192];
    size_t used = 0;
    bool found = false;
    for (ssize_t got; !found && (got = read(fd, buf, sizeof buf)) > 0;) {
        for (ssize_t i = 0; i < got && !found; ++i) {
            if (buf[i] != '\n') {
                if (used + 1 < sizeof line) line[used++] = buf[i];
                continue;
            }
            line[used] = 0;
            found = file_of(line, addr, path, cap);
            used = 0;
        }
    }
    close(fd);
    return found;
}

void on_sigbus(int, siginfo_t* info, void*) {
    static char path[4096];
    if (!mapped_file(reinterpret_cast<uint64_t>(info->si_addr), path, sizeof path)) {
        signal(SIGBUS, SIG_DFL);                               // not a mapped file's: the default action, as before
        return;
    }
    say("colibri: SIGBUS reading ");
    say(path);
    say(" through its mapping: its pages are gone (the file was truncated or replaced while mapped); exiting for a "
        "restart on the new file\n");
    _exit(exit_code);
}

bool exit_on_sigbus(int64_t code) {
    exit_code = sig_atomic_t(code);
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGBUS, &sa, nullptr) == 0;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(colibri, m) { m.def("exit_on_sigbus(int code) -> bool", &exit_on_sigbus); }

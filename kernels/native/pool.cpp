// colibri_ops::parallel_for's pool (pool.h): one team of workers per process, made on first use and again when
// torch's thread count changes; the caller runs the first chunk itself.
//
// A job: the caller writes it into the team, opens its chunks' claims, bumps `seq` and wakes sleepers; worker i
// runs chunk i unless the caller, done with chunk 0, claimed it first; `left` counts the chunks not yet done, and
// the caller waits for zero. Workers never leave the team between jobs: after one they watch `seq` for
// COLIBRI_SPIN_US, then sleep on it (futex), counted in `sleepers` so the caller makes the wake-up call only when
// someone sleeps; wake() bumps `seq` without a job, so sleepers get up and spin for the next one. A forked child
// starts a team of its own.

#include "pool.h"

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <torch/library.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

void futex_wait(std::atomic<uint32_t>* addr, uint32_t seen) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
#else
    std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

void futex_wake_all(std::atomic<uint32_t>* addr) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
}

int spin_us_from_env() {
    const char* s = std::getenv("COLIBRI_SPIN_US");
    if (!s || !*s) return 300;
    char* end = nullptr;
    long v = std::strtol(s, &end, 10);
    return (end && *end == 0 && v >= 0) ? int(std::min<long>(v, 1000000)) : 300;
}

thread_local bool in_job = false;     // this thread runs a chunk: a nested call runs inline
std::atomic<bool> resting{false};       // rest() was called: spinning workers sleep now (the next job clears it)

struct Team {
    Team(int threads, int spin_us)
        : threads(threads), spin(std::chrono::microseconds(spin_us)), claim(new std::atomic<uint64_t>[threads]) {
        for (int i = 0; i < threads; ++i) claim[i].store(1, std::memory_order_relaxed);   // taken: no job yet
    }
    const int threads;                   // the caller and threads - 1 workers
    const Clock::duration spin;
    std::atomic<uint64_t> job{0};        // the job's number, from 1
    std::atomic<uint32_t> seq{0};        // the futex word: bumped for each job, each wake() and once to stop
    std::atomic<int> sleepers{0};
    std::atomic<int> left{0};            // chunks of the job not yet done
    std::atomic<bool> stop{false};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    // claim[i] is 2j while chunk i of job j is open and 2j + 1 once taken: its worker or the caller, done with its
    // own chunk, takes it (a worker asleep or off its core costs a serial chunk, never a wait). A worker that reads
    // a job number late fails the exchange: every chunk of a finished job is taken, and a newer job's claims
    // are values it does not expect.
    std::unique_ptr<std::atomic<uint64_t>[]> claim;
    // the job: written before seq is bumped; a worker reads it only after it claimed a chunk, which the caller
    // waits for
    colibri_ops::chunk_fn fn = nullptr;
    const void* ctx = nullptr;
    int64_t begin = 0, end = 0, chunk = 0;

    bool take(int64_t tid, uint64_t j) {
        uint64_t open = 2 * j;
        return claim[tid].compare_exchange_strong(open, open + 1, std::memory_order_acq_rel);
    }

    void run_chunk(int64_t tid) {
        const int64_t b = begin + tid * chunk;
        if (b < end) {
            in_job = true;
            c10::ParallelGuard guard(true);
            try {
                fn(ctx, b, std::min(end, b + chunk));
            } catch (...) {
                if (!failed.exchange(true)) error = std::current_exception();
            }
            in_job = false;
        }
        left.fetch_sub(1, std::memory_order_acq_rel);
    }
};

void work(std::shared_ptr<Team> t, int tid) {
#ifdef __linux__
    pthread_setname_np(pthread_self(), "colibri-pool");   // what `top -H` and /proc/PID/task/*/comm show
#endif
    at::internal::lazy_init_num_threads();
#ifdef _OPENMP
    omp_set_num_threads(1);              // torch ops a chunk might call stay on this thread
#endif
    uint32_t seen = 0;                   // a team's seq starts at 0: a job posted before this thread ran is seen
    for (;;) {
        uint32_t s = t->seq.load(std::memory_order_acquire);
        if (s == seen) {
            const Clock::time_point until = Clock::now() + t->spin;
            while (s == seen && Clock::now() < until && !resting.load(std::memory_order_relaxed)) {
                for (int i = 0; i < 32 && (s = t->seq.load(std::memory_order_acquire)) == seen; ++i) relax();
                if (s == seen) std::this_thread::yield();       // another thread wanting this core has it
            }
            if (s == seen) {
                t->sleepers.fetch_add(1);   // seq_cst, as the caller's bump and its read of sleepers
                while ((s = t->seq.load()) == seen) futex_wait(&t->seq, seen);
                t->sleepers.fetch_sub(1);
            }
        }
        seen = s;
        if (t->stop.load(std::memory_order_acquire)) return;
        if (t->take(tid, t->job.load(std::memory_order_acquire))) t->run_chunk(tid);
    }
}

struct Pool {
    std::mutex busy;                     // one job at a time; a second caller runs inline
    std::shared_ptr<Team> team;
    const int spin_us = spin_us_from_env();

    Team& ready(int threads) {          // under `busy`
        if (team && team->threads == threads) return *team;
        if (team) {                      // a new thread count: the old workers leave, new ones start
            team->stop.store(true, std::memory_order_release);
            team->seq.fetch_add(1);
            futex_wake_all(&team->seq);
        }
        team = std::make_shared<Team>(threads, spin_us);
        for (int i = 1; i < threads; ++i) std::thread(work, team, i).detach();
        return *team;
    }
};

Pool* pool = nullptr;                    // never destroyed: workers may still sleep in it at exit
std::once_flag made;

Pool& the_pool() {
    std::call_once(made, [] {
        pool = new Pool();
        pthread_atfork(nullptr, nullptr, [] { pool = new Pool(); });   // the child has none of the threads
    });
    return *pool;
}

}  // namespace

namespace colibri_ops {

void parallel_run(int64_t begin, int64_t end, int64_t grain, chunk_fn fn, const void* ctx) {
    if (begin >= end) return;
    const int64_t n = end - begin;
    const int threads = at::get_num_threads();
    if (n <= grain || n == 1 || threads <= 1 || in_job || at::in_parallel_region()) {
        fn(ctx, begin, end);
        return;
    }
    Pool& p = the_pool();
    std::unique_lock<std::mutex> lock(p.busy, std::try_to_lock);
    if (!lock.owns_lock()) {                                    // another thread's job holds the workers
        fn(ctx, begin, end);
        return;
    }
    Team& t = p.ready(threads);
    resting.store(false, std::memory_order_relaxed);
    const int64_t tasks = std::min<int64_t>(threads, grain > 0 ? (n + grain - 1) / grain : n);
    const uint64_t j = t.job.load(std::memory_order_relaxed) + 1;
    t.fn = fn;
    t.ctx = ctx;
    t.begin = begin;
    t.end = end;
    t.chunk = (n + tasks - 1) / tasks;
    t.failed.store(false, std::memory_order_relaxed);
    t.error = nullptr;
    t.left.store(int(tasks), std::memory_order_relaxed);
    for (int64_t i = 0; i < t.threads; ++i)                      // chunk 0 and workers without one: taken
        t.claim[i].store(i == 0 || i >= tasks ? 2 * j + 1 : 2 * j, std::memory_order_relaxed);
    t.job.store(j, std::memory_order_release);
    t.seq.fetch_add(1);                                         // seq_cst: publishes the job, then reads sleepers
    if (t.sleepers.load() > 0) futex_wake_all(&t.seq);
    t.run_chunk(0);
    for (int64_t i = 1; i < tasks; ++i)                          // the chunks no worker has started
        if (t.take(i, j)) t.run_chunk(i);
    for (int i = 0; t.left.load(std::memory_order_acquire) > 0; ++i) {
        if (i < 20000)
            relax();
        else
            std::this_thread::yield();                          // a worker off its core: let it have ours
    }
    if (t.failed.load(std::memory_order_acquire)) std::rethrow_exception(t.error);
}

void rest() { resting.store(true, std::memory_order_relaxed); }

void wake() {
    Pool& p = the_pool();
    std::unique_lock<std::mutex> lock(p.busy, std::try_to_lock);
    if (!lock.owns_lock() || !p.team) return;                   // a job runs (its workers are up), or no team yet
    Team& t = *p.team;
    resting.store(false, std::memory_order_relaxed);
    t.seq.fetch_add(1);                                         // no job: each worker finds nothing to claim, spins
    if (t.sleepers.load() > 0) futex_wake_all(&t.seq);
}

}  // namespace colibri_ops

// rest() and wake() as plain C functions too, which kernels/native.py calls through ctypes: a torch op's dispatch
// costs tens of µs on the caches a layer's weights have just flushed, for what is a flag's store, and a fleet's
// router calls them two or three times a layer.
extern "C" {
void colibri_rest() { colibri_ops::rest(); }
void colibri_wake() { colibri_ops::wake(); }
}

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("rest() -> ()", &colibri_ops::rest);
    m.def("wake() -> ()", &colibri_ops::wake);
}

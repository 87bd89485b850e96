// The native ops' own thread pool: colibri_ops::parallel_for, a drop-in for at::parallel_for (the same chunks, so
// the same bits) whose workers spin a short while after each job before they sleep.
//
// Why not torch's OpenMP pool: libgomp spins its idle threads only while it manages no more threads than the machine
// has cores, and every Python thread that runs a parallel torch op keeps a pool of its own, so a serving process
// (the loader's thread, then the engine's) is past that count at once. From then on each region wakes a sleeping
// thread; on a 2-core VM that cost 0.1-0.25 ms per op: a decode step's attention block took 367 µs on the engine's
// thread against 125 µs where one thread ran everything.
//
// Workers: at::get_num_threads() - 1 (torch.set_num_threads governs them, as it governs torch's). After a job a
// worker spins for COLIBRI_SPIN_US microseconds (default 300; 0 = sleep at once) so the next op of the same step
// finds it awake, then waits on a futex; rest() (torch.ops.colibri.rest) sends spinning workers to sleep at once,
// for a caller about to wait on something else (a router on its expert workers): the cores go to whoever
// computes; wake() gets them up again ahead of the caller's next op, as that wait ends (a worker woken by the op
// takes 0.1-0.2 ms to be back on a core of a VM, longer than a decode step's op: meanwhile the caller runs its
// chunks alone). A call from inside a job, or while another thread's job runs, runs inline on the calling thread: the
// same chunks' results, since every kernel's output is one tile whoever computes it.
#pragma once

#include <cstdint>

namespace colibri_ops {

using chunk_fn = void (*)(const void* ctx, int64_t begin, int64_t end);

// fn(ctx, b, e) over [begin, end) in chunks of at::parallel_for's sizes (one per thread, at least `grain` each);
// the first exception a chunk throws is rethrown here once every chunk is done.
void parallel_run(int64_t begin, int64_t end, int64_t grain, chunk_fn fn, const void* ctx);

void rest();   // spinning workers sleep now; the next job wakes them
void wake();   // sleeping workers get up and spin (COLIBRI_SPIN_US) for a job about to come; none while one runs

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    parallel_run(begin, end, grain, [](const void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); },
                 &f);
}

}  // namespace colibri_ops

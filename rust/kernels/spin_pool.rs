//! A fixed set of threads that run one job at a time, split in parts, the
//! caller computing part 0 itself; between jobs they spin for a moment
//! before they sleep.
//!
//! Parts are claimed, not assigned: each thread, the caller included,
//! takes the next part not taken yet until none is left, so a helper that
//! the OS has not scheduled (a machine busier than its cores) delays no
//! job: the caller does its part. Every part computes the same thing on
//! whichever thread runs it.
//!
//! Why not rayon: a parallel call from a thread outside rayon's pool
//! queues the job, wakes a sleeping worker and puts the caller to sleep
//! until it is done. On this 2-core machine that round trip cost ~45 µs
//! per call (a 576x576 block-quantized product: 73 µs through rayon
//! against ~30 µs of work), and a decode step makes ~120 such calls in a
//! row. Spinning helpers pick the next call up within a microsecond.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper spins before it sleeps: longer than the other
/// operations between two matmuls of a decode step, short enough that an
/// idle server does not keep the cores busy.
const SPIN: Duration = Duration::from_micros(300);

/// A job's parts, erased to 'static while the pool holds it (see `run`).
type Job = dyn Fn(usize) + Sync + 'static;

pub struct SpinPool {
    shared: Arc<Shared>,
    helpers: usize,
    /// One job at a time: callers on other threads wait here.
    submitting: Mutex<()>,
}

struct Shared {
    /// Bumped once per job; helpers watch it.
    generation: AtomicU64,
    /// The current job, written before `generation` is bumped and read by
    /// a thread once it has claimed one of its parts.
    job: UnsafeCell<Option<*const Job>>,
    /// The current job's generation (low 32 bits), number of parts and
    /// next part not claimed yet, in one word (see `claim`).
    claims: AtomicU64,
    /// Parts of the current job not finished yet.
    unfinished: AtomicUsize,
    panicked: AtomicBool,
    sleeping: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the submitting caller while no helper
// reads it (between jobs) and read by helpers while the caller waits.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

impl SpinPool {
    /// A pool of `threads` threads: the caller and `threads - 1` helpers.
    pub fn new(threads: usize) -> SpinPool {
        SpinPool::with_helpers(threads, threads.max(1) - 1)
    }

    /// A pool that splits jobs for `threads` threads but starts only
    /// `running` helpers: the others never get to run, as a helper the OS
    /// does not schedule.
    fn with_helpers(threads: usize, running: usize) -> SpinPool {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            claims: AtomicU64::new(0),
            unfinished: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let helpers = threads.max(1) - 1;
        for index in 1..=running.min(helpers) {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("pyserve-matmul-{index}"))
                .spawn(move || helper(&shared))
                .expect("spawning a matmul thread");
        }
        SpinPool { shared, helpers, submitting: Mutex::new(()) }
    }

    /// The process's pool, one thread per CPU this process may use.
    pub fn global() -> &'static SpinPool {
        static POOL: OnceLock<SpinPool> = OnceLock::new();
        POOL.get_or_init(|| SpinPool::new(std::thread::available_parallelism().map_or(1, |n| n.get())))
    }

    pub fn threads(&self) -> usize {
        self.helpers + 1
    }

    /// Runs job(0), ..., job(parts - 1) at once (`parts` at most
    /// `threads()`), part 0 on this thread, and returns when all are done.
    pub fn run(&self, parts: usize, job: &(dyn Fn(usize) + Sync)) {
        let parts = parts.clamp(1, self.threads());
        if parts == 1 {
            return job(0);
        }
        let _one_job = self.submitting.lock().unwrap_or_else(|e| e.into_inner());
        let shared = &*self.shared;
        // SAFETY: no helper reads `job` before it claims a part of this
        // generation, and this call returns only once every claimed part is
        // done, so the borrowed closure outlives its use.
        unsafe {
            let erased: *const Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(job);
            *shared.job.get() = Some(erased);
        }
        let generation = shared.generation.load(Ordering::Relaxed) + 1;
        shared.unfinished.store(parts, Ordering::Relaxed);
        shared.claims.store(claim_word(generation, parts, 1), Ordering::Relaxed); // part 0 is ours
        shared.generation.store(generation, Ordering::SeqCst);
        if shared.sleeping.load(Ordering::SeqCst) > 0 {
            let _guard = shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            shared.wake.notify_all();
        }
        let mut failed = false;
        let mut part = Some(0);
        while let Some(p) = part {
            failed |= catch_unwind(AssertUnwindSafe(|| job(p))).is_err();
            shared.unfinished.fetch_sub(1, Ordering::AcqRel);
            part = claim(shared, generation);
        }
        // Parts the helpers claimed: spin for them, and let the OS run one
        // that waits for this core now and then.
        let mut spins = 0u32;
        while shared.unfinished.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if failed || shared.panicked.swap(false, Ordering::Relaxed) {
            panic!("a matmul part panicked");
        }
    }
}

fn claim_word(generation: u64, parts: usize, next: usize) -> u64 {
    (generation & 0xffff_ffff) << 32 | (parts as u64) << 16 | next as u64
}

/// The next unclaimed part of the job of `generation`, claimed; None once
/// all are, or when a later job has replaced it (a helper that woke late).
fn claim(shared: &Shared, generation: u64) -> Option<usize> {
    let mut word = shared.claims.load(Ordering::Acquire);
    loop {
        let (parts, next) = ((word >> 16 & 0xffff) as usize, (word & 0xffff) as usize);
        if word >> 32 != generation & 0xffff_ffff || next >= parts {
            return None;
        }
        match shared.claims.compare_exchange_weak(word, word + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(next),
            Err(now) => word = now,
        }
    }
}

/// A buffer's start, shared by a job's parts that read it or write
/// disjoint elements of it (each part's writes are its own to keep apart).
pub(crate) struct SharedPtr<T>(pub(crate) *mut T);
impl<T> Clone for SharedPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedPtr<T> {}
// SAFETY: a SharedPtr is only an address; the parts that dereference it
// (in unsafe blocks of their own) write disjoint elements while the
// buffer's owner waits in `SpinPool::run`.
unsafe impl<T> Send for SharedPtr<T> {}
unsafe impl<T> Sync for SharedPtr<T> {}

impl<T> SharedPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

fn helper(shared: &Shared) {
    let mut seen = 0;
    loop {
        seen = next_generation(shared, seen);
        while let Some(part) = claim(shared, seen) {
            // SAFETY: the caller wrote the job before bumping `generation`
            // and keeps the closure alive until its claimed parts are done.
            let job = unsafe { (*shared.job.get()).expect("a job comes with its generation") };
            if catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(part) })).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
            }
            shared.unfinished.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Waits until `generation` differs from `seen`: spinning for SPIN, then asleep.
fn next_generation(shared: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let generation = shared.generation.load(Ordering::Acquire);
        if generation != seen {
            return generation;
        }
        spins += 1;
        if spins % 64 != 0 || start.elapsed() < SPIN {
            std::hint::spin_loop();
            continue;
        }
        let mut guard = shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
        shared.sleeping.fetch_add(1, Ordering::SeqCst);
        while shared.generation.load(Ordering::SeqCst) == seen {
            guard = shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        shared.sleeping.fetch_sub(1, Ordering::SeqCst);
        return shared.generation.load(Ordering::Acquire);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_per_job() {
        let pool = SpinPool::new(3);
        let counts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for round in 0..200 {
            if round == 100 {
                std::thread::sleep(SPIN * 3); // the helpers fall asleep and must wake
            }
            pool.run(3, &|part| {
                counts[part].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 200));
    }

    #[test]
    fn a_helper_that_never_runs_delays_no_job() {
        let pool = SpinPool::with_helpers(3, 1);
        let counts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..100 {
            pool.run(3, &|part| {
                counts[part].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 100));
    }

    #[test]
    fn fewer_parts_than_threads() {
        let pool = SpinPool::new(4);
        let total = AtomicUsize::new(0);
        pool.run(2, &|part| {
            total.fetch_add(part + 1, Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn a_panicking_part_reaches_the_caller() {
        let pool = SpinPool::new(2);
        let result = catch_unwind(AssertUnwindSafe(|| pool.run(2, &|part| assert_ne!(part, 1))));
        assert!(result.is_err());
        let ran = AtomicUsize::new(0);
        pool.run(2, &|_| {
            ran.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(ran.load(Ordering::Relaxed), 2, "the pool still works after a panic");
    }
}

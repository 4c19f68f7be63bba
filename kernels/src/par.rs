//! A team of threads for a forward's parallel loops, whose idle members keep polling for the
//! next loop for a while before they sleep.
//!
//! Why not rayon's pool alone: a forward alternates parallel loops (matmuls, attention) with
//! short serial steps (norms, RoPE, the KV append). A rayon worker with nothing to do goes to
//! sleep after 32 rounds of `yield`, about 10–15 µs here, and waking it again costs 20–50 µs
//! under a hypervisor. So every parallel loop that followed a serial step of more than ~10 µs
//! ran mostly on one thread: on SmolLM2 at k = 2 the attention took 1.6 ms per forward in
//! parallel against 1.1 ms serially (`kernels/examples/attpar.rs` shows it in isolation: a
//! 10 µs serial gap before each loop doubles the loop's mean time). Team members poll for
//! [`SPIN`] (yielding the core, so other processes still get it) before they sleep, which
//! covers every gap inside a forward, and a loop never waits for a sleeping member: the caller
//! claims work too, so whoever is awake finishes it.
//!
//! [`Team::install`] makes a team the one [`for_each`] and [`map`] use on the calling thread;
//! elsewhere they run on rayon's current pool, as before.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::KernelError;

/// How long an idle member polls for the next loop before it sleeps: longer than any serial
/// step inside a forward (about 40 µs per layer at k = 8 on SmolLM2), short enough that a
/// team between requests costs nothing.
pub const SPIN: Duration = Duration::from_micros(300);

/// The first part of [`SPIN`], polled without yielding the core: a `yield` costs about a
/// microsecond here, and back-to-back loops (gaps of 1–2 µs) lost a third of the member's
/// share to it.
const SPIN_HOT: Duration = Duration::from_micros(50);

type Job = dyn Fn(usize) + Sync;

/// Keeps a hot atomic on its own cache lines (two, for the adjacent-line prefetcher): the
/// caller polls `completed` while members claim through `ticket`.
#[repr(align(128))]
struct Line<T>(T);

/// Most indices one loop may have: claims past the end must never carry into the epoch bits.
const MAX_N: usize = 1 << 31;

/// The state a team's members share. One loop at a time is published: its epoch numbers it,
/// and `ticket` hands out its indices.
struct Shared {
    /// `(epoch << 32) | next index to claim`: one `fetch_add` both claims an index and says
    /// which loop it belongs to.
    ticket: Line<AtomicU64>,
    /// `(epoch << 32) | n` for the loop published at that epoch.
    job_n: AtomicU64,
    /// That loop's body. Read only by a member holding a claim below `n` of the current epoch,
    /// and the caller does not return (nor publish the next loop) before every such claim is
    /// completed, so the body outlives every read.
    job: UnsafeCell<*const Job>,
    completed: Line<AtomicUsize>,
    /// Members between their first claim and their last of a [`Shared::work`] call. `run`
    /// returns only once it is 0, so no member's claim window spans two publications (an
    /// epoch that wrapped around could otherwise validate a stale claim).
    inflight: Line<AtomicUsize>,
    /// The first panic of the loop, re-raised by the caller. Kept, not dropped, by the member
    /// that caught it: a payload whose `Drop` panics would otherwise unwind out of `work`.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the one caller that holds `Team::caller`, before the epoch
// is published with release ordering, and read only by members that acquired that epoch's
// ticket and hold a live claim (see the field's comment); everything else is atomic or locked.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under those rules.
unsafe impl Send for Shared {}

const LOW: u64 = 0xffff_ffff;

impl Shared {
    /// Claims and runs indices of the current loop until none are left.
    fn work(&self) {
        self.inflight.0.fetch_add(1, Ordering::SeqCst);
        self.claim_all();
        self.inflight.0.fetch_sub(1, Ordering::SeqCst);
    }

    fn claim_all(&self) {
        loop {
            let s = self.ticket.0.fetch_add(1, Ordering::AcqRel);
            let (epoch, i) = (s >> 32, (s & LOW) as usize);
            let jn = self.job_n.load(Ordering::Acquire);
            if jn >> 32 != epoch {
                // A later loop was published: this claim belonged to a finished one.
                return;
            }
            if i >= (jn & LOW) as usize {
                return;
            }
            // SAFETY: this claim (below n, of the published epoch) is not completed yet, so
            // the caller is still inside `run` with the body alive (see `job`).
            let f = unsafe { &**self.job.get() };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                if first.is_none() {
                    *first = Some(p);
                } else {
                    std::mem::forget(p);
                }
            }
            self.completed.0.fetch_add(1, Ordering::Release);
        }
    }
}

thread_local! {
    /// The team [`for_each`] uses on this thread (set by [`Team::install`]).
    static CURRENT: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// True on team members and inside a loop body: a nested loop runs serially there.
    static IN_LOOP: Cell<bool> = const { Cell::new(false) };
}

/// A fixed set of threads (the caller counts as one) that run parallel loops.
pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held by the one thread running a loop; another caller meanwhile runs its loop alone.
    caller: Mutex<()>,
}

impl Team {
    /// A team of `threads` (at least 1; the caller is one of them, so `threads − 1` are
    /// spawned, named `{name}-{i}`).
    pub fn new(threads: usize, name: &str) -> Result<Team, KernelError> {
        let shared = Arc::new(Shared {
            ticket: Line(AtomicU64::new(0)),
            job_n: AtomicU64::new(0),
            job: UnsafeCell::new(std::ptr::null::<fn(usize)>() as *const Job),
            completed: Line(AtomicUsize::new(0)),
            inflight: Line(AtomicUsize::new(0)),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let mut team = Team {
            shared,
            workers: Vec::new(),
            caller: Mutex::new(()),
        };
        for i in 1..threads.max(1) {
            let sh = team.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || member(&sh))
                .map_err(|e| KernelError::Unsupported(format!("spawning a thread: {e}")))?;
            team.workers.push(h);
        }
        Ok(team)
    }

    /// Threads in the team, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f` with this team as the one [`for_each`] and [`map`] use on this thread.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(*const Team);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(CURRENT.with(|c| c.replace(self as *const Team)));
        f()
    }

    /// `f(i)` for every `i < n`, spread over the team; returns when all are done. A panic in
    /// `f` is re-raised here after every index finished.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n == 0 {
            return;
        }
        let nested = IN_LOOP.with(|c| c.get());
        let guard = if self.workers.is_empty() || n == 1 || n > MAX_N || nested {
            None
        } else {
            self.caller.try_lock().ok()
        };
        if guard.is_none() {
            (0..n).for_each(f);
            return;
        }
        let sh = &*self.shared;
        let epoch = ((sh.job_n.load(Ordering::Relaxed) >> 32) + 1) & LOW;
        // SAFETY: only the holder of `caller` writes `job`, and no member holds a live claim
        // (the previous loop's claims all completed before its `run` returned). The lifetime
        // is erased because this call does not return before every claim completed.
        unsafe {
            *sh.job.get() = std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Job>(
                f as *const _,
            );
        }
        sh.completed.0.store(0, Ordering::Relaxed);
        sh.job_n.store((epoch << 32) | n as u64, Ordering::Release);
        sh.ticket.0.store(epoch << 32, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        IN_LOOP.with(|c| c.set(true));
        sh.work();
        IN_LOOP.with(|c| c.set(false));
        let mut spins = 0u32;
        while sh.completed.0.load(Ordering::Acquire) < n || sh.inflight.0.load(Ordering::SeqCst) > 0
        {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let panic = sh.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(guard);
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }
}

/// A member's life: wait for a new loop (polling for [`SPIN`], then asleep), work on it.
fn member(sh: &Shared) {
    IN_LOOP.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        let t0 = Instant::now();
        loop {
            if sh.shutdown.load(Ordering::Acquire) {
                return;
            }
            let e = sh.ticket.0.load(Ordering::Acquire) >> 32;
            if e != seen {
                seen = e;
                break;
            }
            let idle = t0.elapsed();
            if idle < SPIN_HOT {
                std::hint::spin_loop();
            } else if idle < SPIN {
                std::thread::yield_now();
            } else {
                let mut g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
                sh.sleepers.fetch_add(1, Ordering::SeqCst);
                while sh.ticket.0.load(Ordering::SeqCst) >> 32 == seen
                    && !sh.shutdown.load(Ordering::SeqCst)
                {
                    g = sh.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                sh.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
        }
        sh.work();
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

fn current() -> Option<&'static Team> {
    let p = CURRENT.with(|c| c.get());
    // SAFETY: `install` sets the pointer only for the duration of its closure, during which the
    // team is borrowed, and restores the previous one (also on unwinding); the reference is used
    // only within the calling function, inside that closure.
    unsafe { p.as_ref() }
}

/// `f(i)` for every `i < n`, in parallel: on the installed [`Team`], else on rayon's current
/// pool; serially inside a team's loop body.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync + Send) {
    if IN_LOOP.with(|c| c.get()) {
        // Inside a team's loop body: the team's threads are busy with the outer loop.
        return (0..n).for_each(f);
    }
    match current() {
        Some(t) => t.run(n, &f),
        None => (0..n).into_par_iter().for_each(f),
    }
}

/// `[f(0), …, f(n − 1)]`, computed as [`for_each`] does.
pub fn map<T: Send + Sync>(n: usize, f: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
    let slots: Vec<OnceLock<T>> = (0..n).map(|_| OnceLock::new()).collect();
    for_each(n, |i| {
        let _ = slots[i].set(f(i));
    });
    slots
        .into_iter()
        .map(|s| s.into_inner().expect("every index of a parallel loop runs"))
        .collect()
}

/// Where [`rows2_mut`] hands each run its rows from.
struct RowsPtr<T>(*mut T);
// SAFETY: every run of the loop forms slices of its own rows only (see `rows2_mut`), and `T`
// is `Send`, so the rows may be written from another thread.
unsafe impl<T: Send> Send for RowsPtr<T> {}
unsafe impl<T: Send> Sync for RowsPtr<T> {}

/// `f(i, &mut a[i·la..], &mut b[i·lb..])` for the rows `i < n` of two row-major buffers
/// (`n` = the rows both hold), in parallel when `parallel` (one run of consecutive rows per
/// thread, as [`for_each`] runs them), else in order on this thread. For the per-token steps
/// between a forward's matmuls (norms, RoPE, SwiGLU): one thread doing them for a batch of 32
/// tokens left the other idle for a tenth of the step.
pub fn rows2_mut<A: Send, B: Send>(
    a: &mut [A],
    la: usize,
    b: &mut [B],
    lb: usize,
    parallel: bool,
    f: impl Fn(usize, &mut [A], &mut [B]) + Sync + Send,
) {
    // A zero-length row (the unused buffer of `rows_mut`) is an empty slice for every row.
    let Some(n) = a.len().checked_div(la) else {
        return;
    };
    let n = b.len().checked_div(lb).map_or(n, |m| m.min(n));
    let runs = threads().min(n);
    if !parallel || runs < 2 {
        for i in 0..n {
            f(
                i,
                &mut a[i * la..(i + 1) * la],
                &mut b[i * lb..(i + 1) * lb],
            );
        }
        return;
    }
    let per = n.div_ceil(runs);
    let (pa, pb) = (RowsPtr(a.as_mut_ptr()), RowsPtr(b.as_mut_ptr()));
    for_each(n.div_ceil(per), |r| {
        let (pa, pb) = (&pa, &pb);
        for i in r * per..((r + 1) * per).min(n) {
            // SAFETY: row i lies inside both buffers (i < n; an empty row is a zero-length
            // slice at the buffer's own pointer), which outlive the loop, and no other index
            // of the loop forms a slice of it.
            let (ra, rb) = unsafe {
                (
                    std::slice::from_raw_parts_mut(pa.0.add(i * la), la),
                    std::slice::from_raw_parts_mut(pb.0.add(i * lb), lb),
                )
            };
            f(i, ra, rb);
        }
    });
}

/// [`rows2_mut`] over one buffer.
pub fn rows_mut<T: Send>(
    data: &mut [T],
    len: usize,
    parallel: bool,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    rows2_mut(data, len, &mut [0u8; 0], 0, parallel, |i, r, _| f(i, r));
}

/// Threads the parallel loops here would use: the installed team's, else rayon's.
pub fn threads() -> usize {
    current().map_or_else(rayon::current_num_threads, Team::threads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_index_runs_once() {
        let team = Team::new(3, "t").unwrap();
        for n in [0usize, 1, 2, 3, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            team.install(|| {
                for_each(n, |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                })
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
        let v = team.install(|| map(50, |i| i * i));
        assert_eq!(v, (0..50).map(|i| i * i).collect::<Vec<_>>());
        assert_eq!(team.install(threads), 3);
    }

    #[test]
    fn rows_are_each_visited_once_with_their_own_index() {
        let team = Team::new(3, "rows").unwrap();
        for (n, la, lb) in [
            (0usize, 4usize, 2usize),
            (1, 4, 2),
            (2, 3, 5),
            (7, 4, 1),
            (64, 9, 3),
        ] {
            for parallel in [false, true] {
                let mut a = vec![0usize; n * la + 1]; // a spare element past the last row
                let mut b = vec![0usize; n * lb];
                team.install(|| {
                    rows2_mut(&mut a, la, &mut b, lb, parallel, |i, ra, rb| {
                        assert_eq!((ra.len(), rb.len()), (la, lb));
                        ra.iter_mut().for_each(|x| *x += i + 1);
                        rb.iter_mut().for_each(|x| *x += 2 * i + 1);
                    })
                });
                for i in 0..n {
                    assert!(
                        a[i * la..(i + 1) * la].iter().all(|&x| x == i + 1),
                        "{n} {la}"
                    );
                    assert!(b[i * lb..(i + 1) * lb].iter().all(|&x| x == 2 * i + 1));
                }
                assert_eq!(a[n * la], 0, "past the rows");
                let mut c = vec![0usize; n * la];
                team.install(|| rows_mut(&mut c, la, parallel, |i, r| r.fill(i)));
                assert!(
                    c.chunks(la)
                        .enumerate()
                        .all(|(i, r)| r.iter().all(|&x| x == i))
                );
            }
        }
        // A zero-length row: nothing to visit, no panic.
        rows_mut(&mut [1u8; 4], 0, true, |_, _| panic!("no rows"));
    }

    #[test]
    fn members_share_the_work_and_wake_from_sleep() {
        let team = Team::new(2, "t").unwrap();
        // Long enough for the member to poll past SPIN and sleep between loops: each loop
        // must wake it (a lost wake-up leaves all the work to the caller).
        for round in 0..3 {
            if round > 0 {
                std::thread::sleep(SPIN * 3);
            }
            let on_member = AtomicUsize::new(0);
            team.install(|| {
                for_each(64, |_| {
                    if std::thread::current().name() == Some("t-1") {
                        on_member.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_micros(200));
                })
            });
            assert!(
                on_member.load(Ordering::Relaxed) > 0,
                "round {round}: the member took no work"
            );
        }
    }

    #[test]
    fn nested_loops_and_concurrent_callers_complete() {
        let team = Arc::new(Team::new(2, "t").unwrap());
        let total = AtomicUsize::new(0);
        team.install(|| {
            for_each(8, |_| {
                for_each(8, |_| {
                    total.fetch_add(1, Ordering::Relaxed);
                })
            })
        });
        assert_eq!(total.load(Ordering::Relaxed), 64);
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let t = team.clone();
                std::thread::spawn(move || {
                    let sum = AtomicUsize::new(0);
                    for _ in 0..200 {
                        t.install(|| {
                            for_each(16, |i| {
                                sum.fetch_add(i, Ordering::Relaxed);
                            })
                        });
                    }
                    sum.load(Ordering::Relaxed)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 200 * 120);
        }
    }

    #[test]
    fn a_panicking_task_is_reraised_and_the_team_still_works() {
        let team = Team::new(2, "t").unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.install(|| for_each(32, |i| assert!(i != 17, "task 17")))
        }));
        let msg = r.expect_err("the panic comes back");
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"task 17"));
        let v = team.install(|| map(32, |i| i + 1));
        assert_eq!(v.iter().sum::<usize>(), 32 * 33 / 2);
        // A payload whose drop panics is handed back whole, not dropped inside the team.
        struct Bomb;
        impl Drop for Bomb {
            fn drop(&mut self) {
                panic!("dropped");
            }
        }
        for who in [0usize, 31] {
            let r = catch_unwind(AssertUnwindSafe(|| {
                team.install(|| {
                    for_each(32, |i| {
                        if i == who {
                            std::panic::panic_any(Bomb)
                        }
                    })
                })
            }));
            let p = r.expect_err("the panic comes back");
            assert!(p.is::<Bomb>());
            std::mem::forget(p);
            assert_eq!(team.install(|| map(8, |i| i)).len(), 8);
        }
    }

    #[test]
    fn without_a_team_loops_run_on_rayon() {
        assert_eq!(threads(), rayon::current_num_threads());
        assert_eq!(map(5, |i| i * 2), vec![0, 2, 4, 6, 8]);
    }
}

//! The collective watchdog: a peer process that dies or stops mid-run leaves NCCL waiting
//! forever (its kernels spin on the peer, and NCCL has no timeout of its own). The watchdog
//! notices a collective that has not completed `dist.timeout_s` after it was issued and calls
//! `on_overdue` once, which for NCCL ranks prints the error and ends the process (as PyTorch's
//! NCCL watchdog does). The clock starts when the host issues the collective, so the time
//! counted includes the GPU work queued before it on the stream (milliseconds to seconds, next
//! to `dist.timeout_s`, 600 s by default); otherwise as the in-process backend's timeout: a
//! collective may wait that long for the others, e.g. while rank 0 writes a checkpoint.
//!
//! Two threads, because asking whether a collective completed can itself block: on an H200
//! with a killed peer, the watchdog thread's queries (answered throughout the healthy steps)
//! stalled once the collective hung, most likely on a driver lock held by the rank's thread,
//! itself stuck behind it (found by `scripts/gpu_dist_check.py`; PyTorch's NCCL watchdog has a
//! heartbeat monitor for the same hazard). The
//! *pruner* queries completion and drops what completed, never holding the lock while it
//! queries; the *monitor* only reads issue times under the lock and makes no device calls, so
//! a blocked query leaves the oldest entry in place and the monitor still fires. The rank
//! threads also drop their own completed entries each time they issue one, so the queue stays
//! short when the pruner lags. A healthy run is reported only if the pruner's query stays
//! blocked for `dist.timeout_s` (the trace on the H200 showed queries answering throughout a
//! healthy run, and stalling only once the collective hung).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Work recorded behind a collective on its stream (a CUDA event).
pub trait Completion: Send + Sync + 'static {
    /// Whether the work is complete. May block. An error counts as complete: the rank reports
    /// device errors itself at its next synchronisation.
    fn is_complete(&self) -> bool;
}

/// The collective that waited too long.
#[derive(Clone, Debug, PartialEq)]
pub struct Overdue {
    pub rank: usize,
    pub op: &'static str,
    pub waited: Duration,
}

struct Entry<E> {
    op: &'static str,
    since: Instant,
    /// None while the host is still inside the collective's call (which can block too).
    behind: Option<Arc<E>>,
}

type Queues<E> = HashMap<usize, VecDeque<Entry<E>>>;

pub struct Watchdog<E> {
    /// Per rank, oldest first (a stream's work completes in order).
    pending: Mutex<Queues<E>>,
    timeout: Duration,
    stop: AtomicBool,
}

impl<E: Completion> Watchdog<E> {
    /// Start the pruner and the monitor; the monitor checks every quarter of the timeout (100
    /// ms to 1 s) and calls `on_overdue` at most once.
    pub fn start(timeout: Duration, on_overdue: impl FnOnce(Overdue) + Send + 'static) -> Arc<Self> {
        let w = Arc::new(Watchdog { pending: Mutex::new(HashMap::new()), timeout, stop: AtomicBool::new(false) });
        let pruner = w.clone();
        std::thread::Builder::new().name("nccl-watchdog-pruner".into()).spawn(move || pruner.prune()).expect("spawn the watchdog's pruner");
        let monitor = w.clone();
        let poll = (timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
        std::thread::Builder::new()
            .name("nccl-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(poll);
                // Checked after the sleep: stopped meanwhile, the run is over, whatever is queued.
                if monitor.stop.load(Ordering::Relaxed) {
                    return;
                }
                if let Some(o) = monitor.overdue() {
                    on_overdue(o);
                    return;
                }
            })
            .expect("spawn the watchdog");
        w
    }

    fn lock(&self) -> MutexGuard<'_, Queues<E>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The host is about to enter the call that issues `op` for `rank` (on the rank's thread,
    /// which first drops its own completed entries).
    pub fn issuing(&self, rank: usize, op: &'static str) {
        while self.prune_front(rank) {}
        self.lock().entry(rank).or_default().push_back(Entry { op, since: Instant::now(), behind: None });
    }

    /// The call returned: `Some(work recorded behind it)`, or None when there is nothing to
    /// wait for (the call failed, which the rank reports, or it completed on return).
    pub fn issued(&self, rank: usize, behind: Option<E>) {
        let mut pending = self.lock();
        let q = pending.entry(rank).or_default();
        match behind {
            Some(b) => {
                if let Some(last) = q.back_mut() {
                    last.behind = Some(Arc::new(b));
                }
            }
            None => {
                q.pop_back();
            }
        }
    }

    /// Stop both threads (the run is over) and drop what is still queued, on the caller's
    /// thread and outside the lock.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let left = std::mem::take(&mut *self.lock());
        drop(left);
    }

    /// Drop `rank`'s oldest entry if its work completed: true if it did. The query runs outside
    /// the lock, and the last reference to the completed work is dropped outside it too.
    fn prune_front(&self, rank: usize) -> bool {
        let Some(b) = self.lock().get(&rank).and_then(|q| q.front()).and_then(|e| e.behind.clone()) else {
            return false;
        };
        if !b.is_complete() {
            return false;
        }
        let mut pending = self.lock();
        let Some(q) = pending.get_mut(&rank) else { return false };
        let same = q.front().and_then(|e| e.behind.as_ref()).is_some_and(|f| Arc::ptr_eq(f, &b));
        if same {
            q.pop_front();
        }
        same
    }

    /// The pruner thread: drops completed entries of every rank.
    fn prune(&self) {
        while !self.stop.load(Ordering::Relaxed) {
            let ranks: Vec<usize> = self.lock().keys().copied().collect();
            let mut progressed = false;
            for rank in ranks {
                progressed |= self.prune_front(rank);
            }
            if !progressed {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// The first rank whose oldest collective has waited past the timeout (no device calls).
    fn overdue(&self) -> Option<Overdue> {
        let pending = self.lock();
        pending.iter().find_map(|(rank, q)| {
            let e = q.front()?;
            let waited = e.since.elapsed();
            (waited > self.timeout).then_some(Overdue { rank: *rank, op: e.op, waited })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A stand-in for a CUDA event: complete when the flag is set; a query blocks while `block`
    /// is held (only the pruner thread's query, with `only_pruner`).
    struct Flag {
        done: Arc<AtomicBool>,
        block: Arc<Mutex<()>>,
        only_pruner: bool,
    }

    impl Completion for Flag {
        fn is_complete(&self) -> bool {
            let _held = (!self.only_pruner || std::thread::current().name() == Some("nccl-watchdog-pruner")).then(|| self.block.lock().unwrap());
            self.done.load(Ordering::Relaxed)
        }
    }

    fn flag(done: bool, block: &Arc<Mutex<()>>) -> (Flag, Arc<AtomicBool>) {
        let d = Arc::new(AtomicBool::new(done));
        (Flag { done: d.clone(), block: block.clone(), only_pruner: false }, d)
    }

    fn watchdog(timeout_ms: u64) -> (Arc<Watchdog<Flag>>, mpsc::Receiver<Overdue>) {
        let (tx, rx) = mpsc::channel();
        let w = Watchdog::start(Duration::from_millis(timeout_ms), move |o| tx.send(o).unwrap());
        (w, rx)
    }

    #[test]
    fn watchdog_stays_quiet_while_collectives_complete() {
        // A timeout well above the pruner's lag on a loaded machine: the claim is that completed
        // collectives are dropped, not how fast.
        let (w, rx) = watchdog(1000);
        let block = Arc::new(Mutex::new(()));
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(2500) {
            for rank in 0..2 {
                w.issuing(rank, "all_gather");
                w.issued(rank, Some(flag(true, &block).0));
            }
            // A failed call leaves nothing pending.
            w.issuing(0, "broadcast");
            w.issued(0, None);
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(rx.recv_timeout(Duration::from_millis(1500)).is_err(), "fired although every collective completed");
        assert!(w.lock().values().all(|q| q.is_empty()), "completed collectives were not dropped");
        w.stop();
    }

    #[test]
    fn watchdog_names_the_rank_and_collective_that_never_completes() {
        // The completed entries ahead of the hung one must be dropped first: a timeout well
        // above the pruner's lag on a loaded machine.
        let (w, rx) = watchdog(1000);
        let block = Arc::new(Mutex::new(()));
        w.issuing(1, "all_gather");
        w.issued(1, Some(flag(true, &block).0));
        w.issuing(1, "reduce_scatter");
        let (hung, _) = flag(false, &block);
        w.issued(1, Some(hung));
        w.issuing(0, "reduce_scatter");
        w.issued(0, Some(flag(true, &block).0));
        let o = rx.recv_timeout(Duration::from_secs(10)).expect("a collective pending past the timeout was not reported");
        assert_eq!((o.rank, o.op), (1, "reduce_scatter"));
        assert!(o.waited >= Duration::from_millis(1000), "fired early: {o:?}");
        w.stop();
    }

    #[test]
    fn watchdog_fires_when_the_completion_query_itself_blocks() {
        // The query blocks forever (as cuEventQuery did behind a driver lock on the H200): the
        // monitor must not depend on it.
        let (w, rx) = watchdog(300);
        let block = Arc::new(Mutex::new(()));
        let _held = block.lock().unwrap();
        w.issuing(0, "all_gather");
        w.issued(0, Some(flag(false, &block).0));
        let o = rx.recv_timeout(Duration::from_secs(10)).expect("a blocked completion query kept the watchdog from firing");
        assert_eq!((o.rank, o.op), (0, "all_gather"));
        w.stop();
    }

    #[test]
    fn a_stopped_watchdog_never_fires_and_drops_what_was_queued() {
        let (w, rx) = watchdog(100);
        let block = Arc::new(Mutex::new(()));
        let (hung, _) = flag(false, &block);
        w.issuing(0, "all_gather");
        w.issued(0, Some(hung));
        w.stop();
        assert!(w.lock().is_empty(), "stop() kept the queued entries");
        assert!(rx.recv_timeout(Duration::from_millis(1500)).is_err(), "fired after stop()");
    }

    #[test]
    fn the_rank_drops_its_completed_entries_when_the_pruner_is_stalled() {
        // The pruner's query blocks while the rank's own do not: the queue stays short.
        let (w, _rx) = watchdog(10_000);
        let stall = Arc::new(Mutex::new(()));
        let _held = stall.lock().unwrap();
        for _ in 0..50 {
            w.issuing(0, "all_gather");
            w.issued(0, Some(Flag { done: Arc::new(AtomicBool::new(true)), block: stall.clone(), only_pruner: true }));
            std::thread::sleep(Duration::from_millis(2));
        }
        let left = w.lock()[&0].len();
        assert!(left <= 1, "{left} completed entries queued");
        w.stop();
    }

    #[test]
    fn watchdog_fires_when_the_host_never_returns_from_the_call() {
        let (w, rx) = watchdog(300);
        w.issuing(0, "broadcast");
        let o = rx.recv_timeout(Duration::from_secs(10)).expect("a call that never returned was not reported");
        assert_eq!((o.rank, o.op), (0, "broadcast"));
        w.stop();
    }
}

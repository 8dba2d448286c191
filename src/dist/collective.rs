//! Collectives between ranks, and the in-process backend the CPU runs (and the tests) use.
//!
//! Every rank calls the same collectives in the same order (the training loop is the same
//! code on every rank), so the k-th call on one rank meets the k-th call on the others. A call
//! whose partners do not arrive within the timeout, or whose partner has failed or left, is
//! an error naming the ranks it waited for: a dead rank never turns into a hang.
//!
//! Sums are taken in rank order, so every rank gets bit-identical results.

use crate::error::{Error, Result};
use candle_core::Tensor;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the training loop and the ZeRO-3 weight source need from a communicator. Tensors are
/// 1-D and contiguous, on the rank's device.
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// x [n] on every rank -> [W * n], rank r's x at [r * n, (r + 1) * n).
    fn all_gather(&self, x: &Tensor) -> Result<Tensor>;
    /// x [W * n] on every rank -> [n]: the sum over ranks of part `rank` of x.
    fn reduce_scatter(&self, x: &Tensor) -> Result<Tensor>;
    /// x on every rank -> the sum over ranks.
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor>;
    /// `root`'s x on every rank.
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor>;
    fn barrier(&self) -> Result<()>;
}

/// The rendezvous point of one in-process group (one rank per thread).
pub struct InProcessGroup {
    shared: Arc<Shared>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    /// Open rounds by call number.
    rounds: HashMap<u64, Round>,
    /// The first rank that failed, and why.
    failed: Option<(usize, String)>,
    /// Ranks whose handle is gone (finished or died).
    left: Vec<bool>,
}

struct Round {
    op: &'static str,
    slots: Vec<Option<Tensor>>,
    readers: usize,
}

impl InProcessGroup {
    pub fn new(world: usize, timeout: Duration) -> Self {
        let state = State { left: vec![false; world], ..Default::default() };
        InProcessGroup { shared: Arc::new(Shared { world, timeout, state: Mutex::new(state), cv: Condvar::new() }) }
    }

    /// The handle rank `rank` calls collectives through.
    pub fn member(&self, rank: usize) -> InProcess {
        InProcess { shared: self.shared.clone(), rank, calls: AtomicU64::new(0) }
    }

    /// Record that `rank` failed: every rank waiting in (or later entering) a collective gets
    /// an error naming it instead of waiting for it.
    pub fn abort(&self, rank: usize, why: &str) {
        let mut st = self.shared.lock();
        if st.failed.is_none() {
            st.failed = Some((rank, why.to_string()));
        }
        self.shared.cv.notify_all();
    }

    /// The first failure recorded, if any.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.shared.lock().failed.clone()
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank's handle on an [`InProcessGroup`]. Dropping it tells the others this rank is gone.
pub struct InProcess {
    shared: Arc<Shared>,
    rank: usize,
    calls: AtomicU64,
}

impl InProcess {
    /// Post `x` for this call and wait for every rank's; returns them in rank order.
    fn exchange(&self, op: &'static str, x: &Tensor) -> Result<Vec<Tensor>> {
        let sh = &*self.shared;
        let err = |msg: String| Error::Dist { rank: self.rank, msg };
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let mut st = sh.lock();
        if let Some((r, why)) = &st.failed {
            return Err(Error::PeerFailed { rank: self.rank, msg: format!("stopping because rank {r} failed: {why}") });
        }
        let round = st.rounds.entry(call).or_insert_with(|| Round { op, slots: vec![None; sh.world], readers: 0 });
        if round.op != op {
            let msg = format!("collective #{call} is {op} here but {} on another rank (ranks out of step)", round.op);
            st.failed = Some((self.rank, msg.clone()));
            sh.cv.notify_all();
            return Err(err(msg));
        }
        round.slots[self.rank] = Some(x.clone());
        sh.cv.notify_all();
        let deadline = Instant::now() + sh.timeout;
        loop {
            // A round every rank posted to has succeeded, even if a rank failed right after
            // (say, on the lead's broadcast that it could not write a checkpoint): check that
            // first, so this rank goes on to report its own error rather than the other's.
            let round = st.rounds.get(&call).ok_or_else(|| err(format!("collective #{call} vanished")))?;
            let missing: Vec<usize> = (0..sh.world).filter(|&r| round.slots[r].is_none()).collect();
            if missing.is_empty() {
                break;
            }
            if let Some((r, why)) = &st.failed {
                return Err(Error::PeerFailed { rank: self.rank, msg: format!("stopping because rank {r} failed: {why}") });
            }
            if let Some(&gone) = missing.iter().find(|&&r| st.left[r]) {
                return Err(err(format!("rank {gone} left before {op} #{call}; it stopped or crashed")));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(err(format!(
                    "timed out after {} s in {op} #{call} waiting for rank(s) {missing:?} (dist.timeout_s; a rank died or hangs)",
                    sh.timeout.as_secs()
                )));
            }
            st = sh.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        let round = st.rounds.get_mut(&call).ok_or_else(|| err(format!("collective #{call} vanished")))?;
        let vals: Vec<Tensor> = round.slots.iter().flatten().cloned().collect();
        round.readers += 1;
        if round.readers == sh.world {
            st.rounds.remove(&call);
        }
        Ok(vals)
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.left[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

/// Sum in rank order (the same order on every rank, so the same bits).
fn sum(parts: impl Iterator<Item = Result<Tensor>>) -> Result<Tensor> {
    let mut acc: Option<Tensor> = None;
    for p in parts {
        let p = p?;
        acc = Some(match acc {
            None => p.copy()?,
            Some(a) => (a + p)?,
        });
    }
    acc.ok_or_else(|| Error::Dist { rank: 0, msg: "empty group".into() })
}

impl Collective for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world
    }
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        let parts = self.exchange("all_gather", x)?;
        if parts.iter().any(|p| p.dims() != x.dims()) {
            return Err(Error::Dist { rank: self.rank, msg: "all_gather: ranks sent different lengths".into() });
        }
        Ok(Tensor::cat(&parts, 0)?.copy()?)
    }
    fn reduce_scatter(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.shared.world;
        let len = x.dim(0)?;
        if len % w != 0 {
            return Err(Error::Dist { rank: self.rank, msg: format!("reduce_scatter: length {len} is not a multiple of {w} ranks") });
        }
        let n = len / w;
        let parts = self.exchange("reduce_scatter", x)?;
        sum(parts.iter().map(|p| Ok(p.narrow(0, self.rank * n, n)?)))
    }
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        let parts = self.exchange("all_reduce", x)?;
        sum(parts.into_iter().map(Ok))
    }
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let parts = self.exchange("broadcast", x)?;
        Ok(parts[root].copy()?)
    }
    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", &Tensor::zeros(1, candle_core::DType::U8, &candle_core::Device::Cpu)?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn run<T: Send>(world: usize, timeout_ms: u64, f: impl Fn(InProcess) -> T + Sync) -> Vec<T> {
        let g = InProcessGroup::new(world, Duration::from_millis(timeout_ms));
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world).map(|r| {
                let m = g.member(r);
                let f = &f;
                s.spawn(move || f(m))
            }).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn collectives_agree_with_their_definitions() {
        let out = run(3, 5_000, |c| {
            let r = c.rank() as f32;
            let x = Tensor::new(&[r, 10.0 + r], &Device::Cpu).unwrap();
            let g: Vec<f32> = c.all_gather(&x).unwrap().to_vec1().unwrap();
            let big = Tensor::new(&[1.0 + r, 2.0, 3.0, 4.0, 5.0, 6.0 * r], &Device::Cpu).unwrap();
            let rs: Vec<f32> = c.reduce_scatter(&big).unwrap().to_vec1().unwrap();
            let ar: Vec<f32> = c.all_reduce(&x).unwrap().to_vec1().unwrap();
            let b: Vec<f32> = c.broadcast(&x, 2).unwrap().to_vec1().unwrap();
            c.barrier().unwrap();
            (g, rs, ar, b)
        });
        for (r, (g, rs, ar, b)) in out.iter().enumerate() {
            assert_eq!(g, &[0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
            let want = [[1.0 + 2.0 + 3.0, 6.0], [9.0, 12.0], [15.0, 6.0 * 3.0]][r];
            assert_eq!(rs, &want);
            assert_eq!(ar, &[3.0, 33.0]);
            assert_eq!(b, &[2.0, 12.0]);
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_instead_of_hanging() {
        let started = Instant::now();
        let out = run(3, 60_000, |c| {
            if c.rank() == 1 {
                return Ok(());
            }
            c.all_reduce(&Tensor::new(&[1f32], &Device::Cpu).unwrap()).map(|_| ())
        });
        assert!(started.elapsed() < Duration::from_secs(30));
        for r in [0, 2] {
            let e = out[r].as_ref().unwrap_err().to_string();
            assert!(e.contains("rank 1 left"), "{e}");
        }
    }

    #[test]
    fn a_rank_that_hangs_times_out_with_the_missing_rank_named() {
        let out = run(2, 300, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(());
            }
            c.barrier()
        });
        let e = out[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("timed out") && e.contains("[1]"), "{e}");
    }

    #[test]
    fn a_failed_rank_stops_the_others_with_its_reason() {
        let g = InProcessGroup::new(2, Duration::from_secs(60));
        let e = std::thread::scope(|s| {
            let m0 = g.member(0);
            let h = s.spawn(move || m0.barrier());
            std::thread::sleep(Duration::from_millis(100));
            g.abort(1, "out of memory");
            h.join().unwrap()
        });
        let e = e.unwrap_err().to_string();
        assert!(e.contains("rank 1 failed: out of memory"), "{e}");
    }

    #[test]
    fn a_round_every_rank_posted_to_succeeds_even_if_a_rank_fails_right_after() {
        // Rank 1 posts its part and fails before rank 0 wakes (as when the lead broadcasts that
        // it could not write a checkpoint): rank 0 must get the broadcast and go on to its own
        // error, not report rank 1's as the cause. Done under one lock, so the order is fixed.
        let g = InProcessGroup::new(2, Duration::from_secs(60));
        let x = Tensor::new(&[7f32], &Device::Cpu).unwrap();
        let got = std::thread::scope(|s| {
            let m0 = g.member(0);
            let x0 = &x;
            let h = s.spawn(move || m0.broadcast(x0, 0).and_then(|t| Ok(t.to_vec1::<f32>()?)));
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let mut st = g.shared.lock();
                if let Some(round) = st.rounds.get_mut(&0) {
                    round.slots[1] = Some(x.clone());
                    st.failed = Some((1, "stopping: rank 0 failed to write".into()));
                    g.shared.cv.notify_all();
                    break;
                }
                drop(st);
                assert!(Instant::now() < deadline, "rank 0 never posted");
                std::thread::sleep(Duration::from_millis(5));
            }
            h.join().unwrap()
        });
        assert_eq!(got.unwrap(), vec![7.0]);
    }
}

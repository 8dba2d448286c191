//! The NCCL backend (feature `nccl`): the [`Collective`] interface over NCCL communicators,
//! one per rank (GPU), all local ranks initialised together from one id. Multi-node runs get
//! the id from process 0 through the TCP [`rendezvous`](super::rendezvous).
//!
//! Each collective is a candle custom op whose CUDA forward calls NCCL on the device's own
//! stream, so it is ordered with the kernels around it (candle's multi-GPU llama example does
//! all-reduce the same way). Compiled without a GPU by `make check-cuda`; run on a GPU machine
//! by `scripts/gpu_dist_check.py` (2 and 4 processes on one GPU, each its own NCCL "host").
//!
//! A peer that dies or stops mid-run would leave NCCL waiting forever (its kernels spin on the
//! peer): each collective records a CUDA event behind it for the [`Watchdog`], which stops this
//! process with an error naming the rank and the collective once one has waited
//! `dist.timeout_s`. The rendezvous has its own timeout.

use super::collective::Collective;
use super::Layout;
use crate::error::{Error, Result};
use crate::recipe::LoadedRecipe;
use crate::train::{RunOptions, RunSummary};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout as TLayout, Shape, Tensor};
use super::watchdog::{Completion, Overdue, Watchdog};
use cudarc::driver::CudaEvent;
use cudarc::nccl::safe::{group_end, group_start, Comm, Id, ReduceOp};
use std::sync::Arc;
use std::time::Duration;

/// One rank's communicator.
pub struct NcclComm {
    comm: Comm,
    rank: usize,
    world: usize,
    device: candle_core::Device,
    watch: Arc<Watchdog<Behind>>,
}

// SAFETY: a communicator is only ever used by the one rank thread that owns it (NCCL allows a
// communicator on any single thread at a time); the Arc exists to fit the `Collective` trait
// object, not to share it between threads.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

/// The event recorded behind a collective on its rank's stream.
struct Behind(CudaEvent);

impl Completion for Behind {
    fn is_complete(&self) -> bool {
        // The query needs the event's context current on the asking thread (without it
        // cuEventQuery fails, which would read as complete). Made current directly: cudarc's
        // bind_to_thread would also take, and clear, an error the context holds for the rank.
        let ctx = self.0.context().cu_ctx();
        let current = matches!(cudarc::driver::result::ctx::get_current(), Ok(Some(c)) if c == ctx);
        // SAFETY: the context outlives the event, which holds a reference to it.
        if !current && unsafe { cudarc::driver::result::ctx::set_current(ctx) }.is_err() {
            return false;
        }
        !matches!(self.0.try_is_complete(), Ok(false))
    }
}

#[derive(Clone, Copy)]
enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
    Broadcast(usize),
}

struct NcclOp<'a> {
    comm: &'a Comm,
    op: Op,
    world: usize,
    rank: usize,
    watch: &'a Watchdog<Behind>,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllReduce => "all_reduce",
            Op::Broadcast(_) => "broadcast",
        }
    }
}

impl CustomOp1 for NcclOp<'_> {
    fn name(&self) -> &'static str {
        "nccl-collective"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &TLayout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL collectives run on CUDA tensors (CPU ranks use the in-process backend)")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &TLayout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (lo, hi) = l.contiguous_offsets().ok_or_else(|| candle_core::Error::msg("nccl: the tensor must be contiguous"))?;
        let n = hi - lo;
        let out_len = match self.op {
            Op::AllGather => n * self.world,
            Op::ReduceScatter => n / self.world,
            Op::AllReduce | Op::Broadcast(_) => n,
        };
        let dev = s.device.clone();
        macro_rules! run {
            ($t:ty) => {{
                let src = s.as_cuda_slice::<$t>()?.slice(lo..hi);
                let mut dst = dev.alloc_zeros::<$t>(out_len)?;
                self.watch.issuing(self.rank, self.op.name());
                let r = match self.op {
                    Op::AllGather => self.comm.all_gather(&src, &mut dst),
                    Op::ReduceScatter => self.comm.reduce_scatter(&src, &mut dst, &ReduceOp::Sum),
                    Op::AllReduce => self.comm.all_reduce(&src, &mut dst, &ReduceOp::Sum),
                    Op::Broadcast(root) => self.comm.broadcast(Some(&src), &mut dst, root as i32),
                };
                let behind = match r {
                    Ok(_) => dev.cuda_stream().record_event(None).map_err(|e| candle_core::Error::msg(format!("CUDA event: {e:?}"))),
                    Err(e) => Err(candle_core::Error::msg(format!("nccl: {e:?}"))),
                };
                match behind {
                    Ok(event) => self.watch.issued(self.rank, Some(Behind(event))),
                    Err(e) => {
                        self.watch.issued(self.rank, None);
                        return Err(e);
                    }
                }
                CudaStorage::wrap_cuda_slice(dst, dev)
            }};
        }
        let out = match s.dtype() {
            DType::F32 => run!(f32),
            DType::F64 => run!(f64),
            DType::BF16 => run!(half::bf16),
            DType::F16 => run!(half::f16),
            DType::U8 => run!(u8),
            dt => candle_core::bail!("nccl: dtype {dt:?} is not supported"),
        };
        Ok((out, Shape::from(out_len)))
    }
}

impl NcclComm {
    fn apply(&self, x: &Tensor, op: Op) -> Result<Tensor> {
        let x = x.flatten_all()?.contiguous()?;
        x.apply_op1_no_bwd(&NcclOp { comm: &self.comm, op, world: self.world, rank: self.rank, watch: &self.watch })
            .map_err(|e| Error::Dist { rank: self.rank, msg: crate::error::candle_msg(&e) })
    }
}

impl Collective for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, Op::AllGather)
    }
    fn reduce_scatter(&self, x: &Tensor) -> Result<Tensor> {
        if x.elem_count() % self.world != 0 {
            return Err(Error::Dist { rank: self.rank, msg: format!("reduce_scatter: length {} is not a multiple of {} ranks", x.elem_count(), self.world) });
        }
        self.apply(x, Op::ReduceScatter)
    }
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, Op::AllReduce)
    }
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.apply(x, Op::Broadcast(root))
    }
    fn barrier(&self) -> Result<()> {
        // A one-element all-reduce, waited for on the host.
        let one = Tensor::ones(1, DType::F32, &self.device)?;
        self.all_reduce(&one)?.to_vec1::<f32>()?;
        Ok(())
    }
}

/// The first rank this process drives: the one its process-wide errors are reported as.
fn first_rank(layout: &Layout) -> usize {
    layout.local.first().map_or(0, |l| l.0)
}

/// An NCCL call's error, reported as this process's first rank's.
fn nccl_err(layout: &Layout) -> impl Fn(cudarc::nccl::result::NcclError) -> Error + Copy {
    let rank = first_rank(layout);
    move |e| Error::Dist { rank, msg: format!("NCCL: {e:?}") }
}

/// Run the recipe's CUDA ranks of this process over NCCL.
pub fn run(loaded: &LoadedRecipe, run_opts: &RunOptions, layout: &Layout) -> Result<RunSummary> {
    let r = &loaded.recipe;
    let nccl_err = nccl_err(layout);
    let id = if layout.processes > 1 {
        let addr = super::rendezvous::master_addr(&|k| std::env::var(k).ok())
            .map_err(|msg| Error::Recipe { file: loaded.file.display().to_string(), key: "$MASTER_ADDR".into(), msg })?;
        let mine = if layout.process == 0 { Some(Id::new().map_err(nccl_err)?) } else { None };
        let bytes: Option<Vec<u8>> = mine.map(|id| id.internal().iter().map(|&c| c as u8).collect());
        let got = super::rendezvous::rendezvous(&addr, layout.process, layout.processes, layout.world, bytes.as_deref(), Duration::from_secs(r.dist.timeout_s))?;
        if got.len() != 128 {
            return Err(Error::Dist { rank: first_rank(layout), msg: format!("the NCCL id from process 0 has {} bytes, expected 128", got.len()) });
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(&got) {
            *d = *s as std::ffi::c_char;
        }
        Id::uninit(internal)
    } else {
        Id::new().map_err(nccl_err)?
    };
    let mut devices = Vec::new();
    for &(rank, spec) in &layout.local {
        devices.push((rank, crate::train::open_device(loaded, spec)?));
    }
    let timeout_s = r.dist.timeout_s;
    let watch = Watchdog::start(Duration::from_secs(timeout_s), move |o: Overdue| {
        crate::note!(
            "error: rank {}: NCCL {} has not completed after {:.0} s: a peer process died or stopped (NCCL would wait \
             forever); stopping this process",
            o.rank,
            o.op,
            o.waited.as_secs_f64()
        );
        crate::note!("hint: dist.timeout_s sets how long a collective may wait for the other ranks (now {timeout_s} s)");
        // _exit, not exit: atexit handlers (the CUDA runtime's teardown) could block behind the
        // hung collective as the completion query did. Checkpoints are written by rename, so
        // none is left half written.
        unsafe { libc::_exit(1) }
    });
    // Stopped however the run ends: an early error must not leave the watchdog to report the
    // communicator initialisation it interrupted.
    let summary = run_watched(loaded, run_opts, layout, devices, id, &watch);
    watch.stop();
    summary
}

/// Initialise this process's communicators (all in one group) and train its ranks.
fn run_watched(
    loaded: &LoadedRecipe,
    run_opts: &RunOptions,
    layout: &Layout,
    devices: Vec<(usize, candle_core::Device)>,
    id: Id,
    watch: &Arc<Watchdog<Behind>>,
) -> Result<RunSummary> {
    let nccl_err = nccl_err(layout);
    // All local communicators in one group: initialising them one by one would block on the
    // first until the others join.
    group_start().map_err(nccl_err)?;
    let mut comms = Vec::new();
    for (rank, dev) in &devices {
        let stream = dev.as_cuda_device()?.cuda_stream();
        // ncclCommInitRank uses the calling thread's current device: make it this rank's GPU.
        stream.context().bind_to_thread().map_err(|e| Error::Dist { rank: *rank, msg: format!("CUDA: {e:?}") })?;
        comms.push(Comm::from_rank(stream, *rank, layout.world, id));
    }
    // Watched too: a peer that dies between the rendezvous and here would leave it waiting.
    for (rank, _) in &devices {
        watch.issuing(*rank, "communicator initialisation");
    }
    let ended = group_end();
    for (rank, _) in &devices {
        watch.issued(*rank, None);
    }
    ended.map_err(nccl_err)?;
    let mut ranks: Vec<(Arc<dyn Collective>, candle_core::Device)> = Vec::new();
    for (c, (rank, dev)) in comms.into_iter().zip(devices) {
        let comm = NcclComm { comm: c.map_err(nccl_err)?, rank, world: layout.world, device: dev.clone(), watch: watch.clone() };
        ranks.push((Arc::new(comm), dev));
    }
    crate::train::run_ranks(loaded, run_opts, ranks, &|_, _| {}, &|| None)
}

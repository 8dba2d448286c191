//! Several devices: which ranks this process drives, how they talk, and ZeRO-3 for the
//! frozen base.
//!
//! - [`collective`]: the interface (all_gather, reduce_scatter, all_reduce, broadcast,
//!   barrier) and the in-process backend (one rank per thread; CPU runs and tests).
//! - `nccl` (feature `nccl`): the same interface over NCCL communicators.
//! - [`rendezvous`]: processes meet over TCP (MASTER_ADDR/MASTER_PORT) to share the NCCL id.
//! - [`watchdog`]: stops a process whose collective waited past `dist.timeout_s` (NCCL ranks).
//! - [`zero`]: the sharded frozen-weight source and the memory account.
//! - [`plan`]: memory per device and host from config.json alone (`finetune plan`).
//!
//! Boundary: model code sees none of this. It reads frozen tensors through `WeightSource`
//! and gets LoRA parameters as `Var`s; the training loop does the rest.

pub mod collective;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod plan;
pub mod rendezvous;
pub mod watchdog;
pub mod zero;

use crate::device::DeviceSpec;
use crate::recipe::DistSection;

/// Ranks of the whole run and the ones this process drives.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    /// Ranks in the run (all processes).
    pub world: usize,
    /// Processes in the run (WORLD_SIZE) and this one's index (RANK).
    pub processes: usize,
    pub process: usize,
    /// (global rank, device) of each rank this process drives, one thread each.
    pub local: Vec<(usize, DeviceSpec)>,
}

/// Work out the layout from the `[dist]` section, `model.device` and the launcher's
/// environment (`env("RANK")`, `env("WORLD_SIZE")`, as torchrun sets them, one process per
/// node). Errors name the recipe key or variable to fix: `(key, message)`.
pub fn layout(d: &DistSection, model_device: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Layout, (String, String)> {
    let var = |name: &str, default: usize| -> Result<usize, (String, String)> {
        match env(name) {
            None => Ok(default),
            Some(v) => v.trim().parse().map_err(|_| (format!("${name}"), format!("\"{v}\" is not a number"))),
        }
    };
    let processes = var("WORLD_SIZE", 1)?;
    if processes == 0 {
        // torchrun never sets 0; a hand-written 0 is a typo, not "one process".
        return Err(("$WORLD_SIZE".into(), "is 0; it counts the run's processes (1 or more), as torchrun sets it".into()));
    }
    let process = var("RANK", 0)?;
    if process >= processes {
        return Err(("$RANK".into(), format!("RANK={process} but WORLD_SIZE={processes}; ranks are 0..WORLD_SIZE-1")));
    }
    let devices: Vec<DeviceSpec> = match &d.devices {
        Some(list) => list
            .iter()
            .map(|s| crate::device::parse_device(s).map_err(|m| ("dist.devices".to_string(), m)))
            .collect::<Result<_, _>>()?,
        None => {
            let world = d.world_size.unwrap_or(processes);
            if !world.is_multiple_of(processes) {
                return Err((
                    "dist.world_size".into(),
                    format!("{world} ranks do not divide evenly over WORLD_SIZE={processes} processes"),
                ));
            }
            let k = world / processes;
            let base = crate::device::parse_device(model_device).map_err(|m| ("model.device".to_string(), m))?;
            match base {
                DeviceSpec::Cpu => vec![DeviceSpec::Cpu; k],
                // One rank per GPU of this node: cuda:0 .. cuda:k-1. A single-rank process
                // takes LOCAL_RANK's GPU when a launcher set it (torchrun, one process per
                // GPU), else model.device's.
                DeviceSpec::Cuda(n) if k == 1 => vec![DeviceSpec::Cuda(var("LOCAL_RANK", n)?)],
                DeviceSpec::Cuda(_) => (0..k).map(DeviceSpec::Cuda).collect(),
            }
        }
    };
    let world = devices.len() * processes;
    if let Some(w) = d.world_size {
        if w != world {
            return Err((
                "dist.world_size".into(),
                format!("is {w}, but dist.devices lists {} device(s) x {processes} process(es) = {world} ranks", devices.len()),
            ));
        }
    }
    let kinds: std::collections::HashSet<bool> = devices.iter().map(|d| *d == DeviceSpec::Cpu).collect();
    if kinds.len() > 1 {
        return Err(("dist.devices".into(), "mixes CPU and CUDA devices; use one kind".into()));
    }
    let mut seen = std::collections::HashSet::new();
    for dv in &devices {
        if let DeviceSpec::Cuda(n) = dv {
            if !seen.insert(*n) {
                return Err(("dist.devices".into(), format!("lists cuda:{n} twice; one rank per GPU")));
            }
        }
    }
    let k = devices.len();
    let local = devices.into_iter().enumerate().map(|(i, dv)| (process * k + i, dv)).collect();
    Ok(Layout { world, processes, process, local })
}

/// A rank's share of a flat vector of `total` values: [r c, (r+1) c) with c = ceil(total / W),
/// the last shares shorter (zero-padded to c on the wire). The one partition rule: LoRA
/// gradients and AdamW state (train/), frozen tensors (zero.rs) and `finetune plan` use it.
#[derive(Clone, Copy, Debug)]
pub struct Partition {
    total: usize,
    chunk: usize,
    lo: usize,
    hi: usize,
    world: usize,
}

impl Partition {
    pub fn new(total: usize, rank: usize, world: usize) -> Self {
        let chunk = total.div_ceil(world).max(1);
        Partition { total, chunk, lo: (rank * chunk).min(total), hi: ((rank + 1) * chunk).min(total), world }
    }
    pub fn len(&self) -> usize {
        self.hi - self.lo
    }
    pub fn is_empty(&self) -> bool {
        self.hi == self.lo
    }
    /// Elements per rank on the wire (c).
    pub fn chunk(&self) -> usize {
        self.chunk
    }
    /// This rank's range of the full vector.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.lo..self.hi
    }
    /// Length of the whole vector padded to world * chunk.
    pub fn padded(&self) -> usize {
        self.chunk * self.world
    }
    pub fn slice(&self, full: &[f32]) -> Vec<f32> {
        full[self.lo..self.hi].to_vec()
    }
    /// Every rank's share, concatenated back into the full vector.
    pub fn gather(&self, comm: &dyn collective::Collective, mine: &[f32], device: &candle_core::Device) -> crate::Result<Vec<f32>> {
        let mut v = mine.to_vec();
        v.resize(self.chunk, 0.0);
        let mut full: Vec<f32> = comm.all_gather(&candle_core::Tensor::from_vec(v, self.chunk, device)?)?.to_vec1()?;
        full.truncate(self.total);
        Ok(full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn world_size_on_cpu_gives_that_many_local_ranks() {
        let d = DistSection { world_size: Some(4), ..Default::default() };
        let l = layout(&d, "cpu", &env(&[])).unwrap();
        assert_eq!(l.world, 4);
        assert_eq!(l.local.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn torchrun_environment_places_this_process_ranks() {
        let d = DistSection { devices: Some(vec!["cuda:0".into(), "cuda:1".into()]), ..Default::default() };
        let l = layout(&d, "cpu", &env(&[("RANK", "1"), ("WORLD_SIZE", "3")])).unwrap();
        assert_eq!(l.world, 6);
        assert_eq!(l.local, vec![(2, DeviceSpec::Cuda(0)), (3, DeviceSpec::Cuda(1))]);
    }

    #[test]
    fn one_process_per_gpu_takes_local_rank_s_gpu() {
        let l = layout(&DistSection::default(), "cuda", &env(&[("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")])).unwrap();
        assert_eq!(l.local, vec![(5, DeviceSpec::Cuda(1))]);
        assert_eq!(l.world, 8);
    }

    #[test]
    fn inconsistent_world_size_names_the_key() {
        let d = DistSection { world_size: Some(3), devices: Some(vec!["cpu".into(), "cpu".into()]), ..Default::default() };
        let (key, msg) = layout(&d, "cpu", &env(&[])).unwrap_err();
        assert_eq!(key, "dist.world_size");
        assert!(msg.contains("2 device(s)"), "{msg}");
        let (key, _) = layout(&DistSection::default(), "cpu", &env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert_eq!(key, "$RANK");
        let (key, msg) = layout(&DistSection::default(), "cpu", &env(&[("WORLD_SIZE", "0")])).unwrap_err();
        assert_eq!(key, "$WORLD_SIZE");
        assert!(msg.contains("is 0"), "{msg}");
    }
}

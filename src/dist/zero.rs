//! ZeRO-3 for the frozen base: each rank keeps 1/N of every frozen tensor and gathers a
//! layer just before it runs.
//!
//! Sharding: tensor t with n elements is flattened and cut into N equal pieces of
//! c = ceil(n / N) elements (the last one zero-padded); rank r keeps elements [r c, (r+1) c)
//! in the storage dtype, read from the memory map (never the whole tensor), so after load a
//! rank holds sum_t c_t elements. Gathering is one all_gather per tensor ([N c] -> first n
//! elements -> the tensor's shape), as DeepSpeed's partitioned parameters do.
//!
//! Gathered tensors are cached per *unit* (a decoder layer, or one non-layer tensor such as
//! the embedding). [`Window`](crate::weights::Window) says which units stay gathered after a request: the requested
//! one and the next `prefetch_layers` layers in the direction of travel (forward in the
//! forward pass, backward in the recomputed backward pass); everything else is released.
//! The [`Account`] records what is held, and `finetune plan` replays the same window over
//! the same access order to predict it (see `plan.rs`).
//!
//! Model code cannot tell this source from the resident one: it asks for tensors by name.

use super::collective::Collective;
use crate::error::{Error, Result};
use crate::weights::{Held, SafetensorsFiles, Unit, WeightSource};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes a rank holds, by kind (what `finetune plan` predicts).
#[derive(Default, Debug)]
pub struct Account {
    /// This rank's shards of the frozen base (or the whole base with zero_stage = 0).
    pub frozen: AtomicUsize,
    /// Gathered frozen tensors held now, and the most ever held at once.
    pub gathered: AtomicUsize,
    pub gathered_peak: AtomicUsize,
    /// LoRA A/B on the device (every rank holds all of them).
    pub lora_params: AtomicUsize,
    /// Full LoRA gradients accumulated over a step (f64), before reduce-scatter.
    pub lora_grads: AtomicUsize,
    /// This rank's slice of AdamW state (exp_avg, exp_avg_sq) in host memory.
    pub optimizer: AtomicUsize,
}

impl Account {
    pub fn get(&self, f: &AtomicUsize) -> usize {
        f.load(Ordering::SeqCst)
    }
    pub(crate) fn add_gathered(&self, bytes: usize) {
        let now = self.gathered.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.gathered_peak.fetch_max(now, Ordering::SeqCst);
    }
    pub(crate) fn sub_gathered(&self, bytes: usize) {
        self.gathered.fetch_sub(bytes, Ordering::SeqCst);
    }
}

/// A snapshot of one rank's [`Account`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MemoryUse {
    pub rank: usize,
    pub frozen: usize,
    pub gathered_peak: usize,
    pub lora_params: usize,
    pub lora_grads: usize,
    pub optimizer: usize,
}

impl MemoryUse {
    pub fn of(rank: usize, a: &Account) -> Self {
        MemoryUse {
            rank,
            frozen: a.get(&a.frozen),
            gathered_peak: a.get(&a.gathered_peak),
            lora_params: a.get(&a.lora_params),
            lora_grads: a.get(&a.lora_grads),
            optimizer: a.get(&a.optimizer),
        }
    }
}

impl std::fmt::Display for MemoryUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = |b: usize| format!("{:.2} MB", b as f64 / 1e6);
        write!(
            f,
            "rank {}: frozen base held {} + gathered peak {}; LoRA {} + grads {}; optimizer state (host) {}",
            self.rank,
            mb(self.frozen),
            mb(self.gathered_peak),
            mb(self.lora_params),
            mb(self.lora_grads),
            mb(self.optimizer)
        )
    }
}

struct Shard {
    /// [c] in the storage dtype.
    data: Tensor,
    shape: Vec<usize>,
}


/// The ZeRO-3 frozen-weight source of one rank.
pub struct ShardedWeights {
    comm: Arc<dyn Collective>,
    /// Open until [`ShardedWeights::seal`]: tensors are sharded on first request.
    files: Mutex<Option<SafetensorsFiles>>,
    shards: Mutex<HashMap<String, Shard>>,
    /// Names per layer in the order they were sharded (the same on every rank).
    order: Mutex<Vec<String>>,
    held: Mutex<Held>,
    storage_dtype: DType,
    compute_dtype: DType,
    matmul_dtype: DType,
    device: Device,
    account: Arc<Account>,
}

impl ShardedWeights {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        files: SafetensorsFiles,
        comm: Arc<dyn Collective>,
        n_layers: usize,
        prefetch: usize,
        storage_dtype: DType,
        compute_dtype: DType,
        device: Device,
        account: Arc<Account>,
    ) -> Self {
        ShardedWeights {
            comm,
            files: Mutex::new(Some(files)),
            shards: Default::default(),
            order: Default::default(),
            held: Mutex::new(Held::new(n_layers, prefetch)),
            storage_dtype,
            compute_dtype,
            matmul_dtype: compute_dtype,
            device,
            account,
        }
    }

    /// Hand projection weights to the frozen matmul in `dtype` (see `ops::Kernels::matmul_dtype`).
    pub fn with_matmul_dtype(mut self, dtype: DType) -> Self {
        self.matmul_dtype = dtype;
        self
    }


    /// Read this rank's slice of `name` from the map.
    fn shard(&self, name: &str, shape: &[usize]) -> Result<()> {
        if lock(&self.shards).contains_key(name) {
            return Ok(());
        }
        let files = lock(&self.files);
        let files = files.as_ref().ok_or_else(|| Error::MissingTensor { name: name.into(), files: "(weights sealed after load)".into() })?;
        let got = files.shape(name)?;
        if got != shape {
            let file = files.file_of(name).map(|p| p.display().to_string()).unwrap_or_default();
            return Err(Error::Shape { name: name.into(), file, expected: shape.to_vec(), got });
        }
        let n: usize = shape.iter().product();
        let part = super::Partition::new(n, self.comm.rank(), self.comm.world_size());
        let (c, lo, hi) = (part.chunk(), part.range().start, part.range().end);
        let dt = crate::weights::stored_dtype(name, self.storage_dtype);
        let mine = if files.is_fp8(name) {
            // Only the rows this rank's 1/N spans are dequantised.
            files.load_fp8_flat(name, shape, lo, hi)?.to_dtype(dt)?
        } else {
            let view = files.view(name)?;
            let dtype = DType::try_from(view.dtype()).map_err(|e| Error::Safetensors {
                file: files.file_of(name).map(|p| p.to_path_buf()).unwrap_or_default(),
                msg: format!("tensor `{name}`: {}", crate::error::candle_msg(&e)),
            })?;
            let es = dtype.size_in_bytes();
            // Only these bytes of the map are touched: the rank's 1/N.
            Tensor::from_raw_buffer(&view.data()[lo * es..hi * es], dtype, &[hi - lo], &Device::Cpu)?.to_dtype(dt)?
        };
        let data = if hi - lo < c {
            Tensor::cat(&[&mine, &Tensor::zeros(c - (hi - lo), dt, &Device::Cpu)?], 0)?
        } else {
            mine
        };
        let data = data.to_device(&self.device)?;
        self.account.frozen.fetch_add(c * dt.size_in_bytes(), Ordering::SeqCst);
        lock(&self.shards).insert(name.to_string(), Shard { data, shape: shape.to_vec() });
        lock(&self.order).push(name.to_string());
        Ok(())
    }

    /// Gather every sharded tensor of `unit` not yet in `held` (plus `also`).
    fn gather_unit(&self, unit: &Unit, held: &mut HashMap<String, Tensor>, also: Option<&str>) -> Result<usize> {
        let names: Vec<String> = lock(&self.order)
            .iter()
            .filter(|n| &Unit::of(n) == unit || Some(n.as_str()) == also)
            .filter(|n| !held.contains_key(*n))
            .cloned()
            .collect();
        let mut bytes = 0;
        for name in names {
            let shards = lock(&self.shards);
            let s = shards.get(&name).ok_or_else(|| Error::MissingTensor { name: name.clone(), files: "(shards)".into() })?;
            let (data, shape) = (s.data.clone(), s.shape.clone());
            drop(shards);
            let full = self.comm.all_gather(&data)?; // [N c]
            bytes += full.elem_count() * full.dtype().size_in_bytes();
            let n: usize = shape.iter().product();
            held.insert(name, full.narrow(0, 0, n)?.reshape(shape)?);
        }
        Ok(bytes)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl WeightSource for ShardedWeights {
    /// Drop the memory map once every tensor the model uses has been sharded: from here on
    /// a rank holds only its shards.
    fn seal(&self) {
        *lock(&self.files) = None;
    }

    fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn matmul_dtype(&self) -> DType {
        self.matmul_dtype
    }
    fn get_stored(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.shard(name, shape)?;
        let t = lock(&self.held).fetch(name, &self.account, |u, held, also| self.gather_unit(u, held, also))?;
        if t.dims() != shape {
            return Err(Error::Shape { name: name.into(), file: "(sharded base)".into(), expected: shape.to_vec(), got: t.dims().to_vec() });
        }
        Ok(t)
    }

    fn contains(&self, name: &str) -> bool {
        lock(&self.shards).contains_key(name) || lock(&self.files).as_ref().is_some_and(|f| f.file_of(name).is_some())
    }
}

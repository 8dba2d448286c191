//! Device selection: the only place that knows about CUDA. CPU is the default build; a
//! `cuda` build maps "cuda:N" to a candle CUDA device.

use candle_core::Device;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

/// Parse "cpu", "cuda" or "cuda:N".
pub fn parse_device(s: &str) -> Result<DeviceSpec, String> {
    match s {
        "cpu" => Ok(DeviceSpec::Cpu),
        "cuda" => Ok(DeviceSpec::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(DeviceSpec::Cuda)
            .ok_or_else(|| format!("\"{s}\" is not a device; expected \"cpu\", \"cuda\" or \"cuda:N\"")),
    }
}

pub fn open(spec: DeviceSpec) -> Result<Device, String> {
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(n) => {
            if !candle_core::utils::cuda_is_available() {
                return Err(format!(
                    "device cuda:{n} requested, but this binary was built without CUDA \
                     (rebuild with `cargo build --release --features cuda`) or set model.device = \"cpu\""
                ));
            }
            Device::new_cuda(n).map_err(|e| format!("cannot open cuda:{n}: {}", crate::error::candle_msg(&e)))
        }
    }
}

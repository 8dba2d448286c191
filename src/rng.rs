//! Our own seeded randomness. candle's CPU RNG cannot be seeded (`Device::Cpu.set_seed` errors),
//! so LoRA init and dropout masks come from here. Dropout uses a counter-based hash: the mask
//! of (seed, micro-batch, layer, module, element) is a pure function, so a recomputed layer
//! (activation checkpointing) and a resumed run draw exactly the same masks with no RNG state
//! to save.

/// SplitMix64: small, fast, and good enough for initialisation and shuffling.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }
    pub fn state(&self) -> u64 {
        self.state
    }
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.state)
    }
    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        // Multiply-shift; bias is < n / 2^64, irrelevant here.
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// The SplitMix64 finaliser: a bijective mix of 64 bits.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash of a tuple of counters: the stream a dropout mask is drawn from.
pub fn stream(parts: &[u64]) -> u64 {
    parts.iter().fold(0x5151_5151_u64, |h, &p| mix(h ^ mix(p.wrapping_add(0x9E37_79B9))))
}

/// Inverted-dropout mask of elements `first..first + n` of a stream: 0 with probability `p`,
/// else 1/(1-p).
pub fn dropout_mask(stream_id: u64, first: u64, n: usize, p: f64) -> Vec<f32> {
    let keep = 1.0 / (1.0 - p);
    let threshold = (p * (u64::MAX as f64)) as u64;
    (first..first + n as u64)
        .map(|i| if mix(stream_id ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) < threshold { 0.0 } else { keep as f32 })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropout_mask_is_deterministic_and_has_the_right_rate() {
        let a = dropout_mask(stream(&[1, 2, 3]), 0, 100_000, 0.1);
        let b = dropout_mask(stream(&[1, 2, 3]), 0, 100_000, 0.1);
        assert_eq!(a, b);
        // A part of the stream (a pass of a micro-batch's rows) is that part of the whole.
        assert_eq!(dropout_mask(stream(&[1, 2, 3]), 40_000, 20_000, 0.1), a[40_000..60_000]);
        let dropped = a.iter().filter(|&&v| v == 0.0).count() as f64 / a.len() as f64;
        assert!((dropped - 0.1).abs() < 0.01, "dropped {dropped}");
        let c = dropout_mask(stream(&[1, 2, 4]), 0, 1000, 0.1);
        assert_ne!(a[..1000], c[..]);
    }
}

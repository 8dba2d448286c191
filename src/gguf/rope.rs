//! Llama 3's rope scaling, read back from a GGUF file's `rope_freqs.weight`.
//!
//! llama.cpp's converter does not write Llama 3's scaling (Llama-3.1/3.2, and so
//! DeepSeek-R1-Distill-Llama) as metadata: it writes one divisor per rotated pair of
//! dimensions, computed from config.json's `factor`, `low_freq_factor`, `high_freq_factor` and
//! `original_max_position_embeddings`. Those last three reach the frequencies only through two
//! numbers (where the blend between kept and divided frequencies starts and ends), so they are
//! recovered as an equivalent set with `low_freq_factor = 1`, which every Llama 3 release has
//! (and so gives back their own values), and accepted only when they give every divisor of the
//! file again.

use crate::config::llama3_inv_freq;
use std::f64::consts::PI;

/// Relative difference allowed between a divisor of the file (float32) and the one the
/// recovered parameters give.
const TOL: f64 = 1e-5;

/// config.json's `rope_scaling` for the divisors `factors` (`rope_freqs.weight`) of heads of
/// `head_dim` dimensions rotated with base `theta`: `null` when every divisor is 1, else
/// Llama 3's. The error says why the divisors are not Llama 3's.
pub fn llama3_from_freq_factors(factors: &[f64], theta: f64, head_dim: usize) -> Result<serde_json::Value, String> {
    if factors.len() != head_dim / 2 {
        return Err(format!("has {} values, but heads of {head_dim} dimensions rotate {} pairs", factors.len(), head_dim / 2));
    }
    if let Some((i, f)) = factors.iter().enumerate().find(|(_, f)| !(f.is_finite() && **f >= 1.0 - TOL)) {
        return Err(format!("value {i} is {f}; Llama 3's divisors are finite and at least 1"));
    }
    let factor = factors.iter().cloned().fold(1.0, f64::max);
    if factor <= 1.0 + TOL {
        return Ok(serde_json::Value::Null);
    }
    // 1 / wavelength of each pair's unscaled frequency.
    let x: Vec<f64> = (0..factors.len()).map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64) / (2.0 * PI)).collect();
    let near = |a: f64, b: f64| (a - b).abs() <= TOL * b;
    // Where the file blends: the blend weight s is linear in 1 / wavelength,
    // s = (original * x - low) / (high - low).
    let blended: Vec<(f64, f64)> = factors
        .iter()
        .zip(&x)
        .filter(|(f, _)| !near(**f, 1.0) && !near(**f, factor))
        .map(|(f, &x)| (x, (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor)))
        .collect();
    let (original, high) = match blended.len() {
        // Kept and divided frequencies only: any boundary between them gives the same
        // divisors; Llama 3's own (8192, 4) where it lies between them.
        0 => {
            let wavelengths = |target: f64| factors.iter().zip(&x).filter(move |(f, _)| near(**f, target)).map(|(_, x)| 1.0 / x);
            // Kept below original / 4, divided above original.
            let (lo, hi) = (4.0 * wavelengths(1.0).fold(0.0, f64::max), wavelengths(factor).fold(f64::INFINITY, f64::min));
            if lo < 8192.0 && 8192.0 < hi {
                (8192.0, 4.0)
            } else {
                (lo.floor() + 1.0, 4.0)
            }
        }
        // One blended pair: Llama 3's high_freq_factor 4, the original context from it.
        1 => {
            let (x, s) = blended[0];
            ((3.0 * s + 1.0) / x, 4.0)
        }
        // A least-squares line s = a x + b through the blended pairs.
        n => {
            let n = n as f64;
            let (sx, ss) = blended.iter().fold((0.0, 0.0), |(a, b), &(x, s)| (a + x, b + s));
            let (mx, ms) = (sx / n, ss / n);
            let (cov, var) = blended.iter().fold((0.0, 0.0), |(c, v), &(x, s)| (c + (x - mx) * (s - ms), v + (x - mx) * (x - mx)));
            let a = cov / var;
            let b = ms - a * mx;
            if !(b < 0.0 && a > 0.0) {
                return Err("its blended values do not rise with the wavelength as Llama 3's do: the file scales RoPE in a way config.json cannot say".into());
            }
            // low = 1: high - 1 = -1 / b, original = a (high - 1).
            (-a / b, 1.0 - 1.0 / b)
        }
    };
    let original = original.round().max(1.0);
    let high = (high * 1e4).round() / 1e4;
    let factor = (factor * 1e6).round() / 1e6;
    for (i, (&f, &x)) in factors.iter().zip(&x).enumerate() {
        let base = 2.0 * PI * x;
        let want = base / llama3_inv_freq(base, factor, 1.0, high, original);
        if !near(f, want) {
            return Err(format!(
                "value {i} is {f}, but Llama 3's rope scaling (factor {factor}, low_freq_factor 1, high_freq_factor {high}, \
                 original_max_position_embeddings {original}) gives {want}: the file scales RoPE in a way config.json cannot say"
            ));
        }
    }
    Ok(serde_json::json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": original as u64,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The divisors llama.cpp's converter (`LlamaModel.generate_extra_tensors` in
    /// convert_hf_to_gguf.py) writes for a Llama 3 config, rounded to float32 as it stores them.
    fn converter_factors(theta: f64, head_dim: usize, factor: f64, low: f64, high: f64, original: f64) -> Vec<f64> {
        (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
                let wavelen = 2.0 * PI / freq;
                let f = if wavelen < original / high {
                    1.0
                } else if wavelen > original / low {
                    factor
                } else {
                    let smooth = (original / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                f as f32 as f64
            })
            .collect()
    }

    #[test]
    fn llama_3_1_and_3_2_scaling_comes_back_from_their_divisors() {
        // Llama-3.1-8B (and R1-Distill-Llama-8B): theta 500000, head 128, factor 8;
        // Llama-3.2-1B: factor 32.
        for factor in [8.0, 32.0] {
            let f = converter_factors(500000.0, 128, factor, 1.0, 4.0, 8192.0);
            let got = llama3_from_freq_factors(&f, 500000.0, 128).unwrap();
            assert_eq!(
                got,
                serde_json::json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
            );
        }
    }

    #[test]
    fn other_parameters_come_back_as_an_equivalent_set() {
        // low_freq_factor 2 is not what Llama 3 ships; the set found gives the same divisors.
        let f = converter_factors(10000.0, 64, 4.0, 2.0, 8.0, 4096.0);
        let got = llama3_from_freq_factors(&f, 10000.0, 64).unwrap();
        let (high, original) = (got["high_freq_factor"].as_f64().unwrap(), got["original_max_position_embeddings"].as_f64().unwrap());
        for (i, f) in f.iter().enumerate() {
            let base = 1.0 / 10000f64.powf((2 * i) as f64 / 64.0);
            assert!((base / llama3_inv_freq(base, 4.0, 1.0, high, original) - f).abs() < 1e-5 * f, "{i}");
        }
        // Tiny heads with one blended pair, or none, or no pair divided by the whole factor.
        for head_dim in [8, 12, 16] {
            let f = converter_factors(10000.0, head_dim, 8.0, 1.0, 4.0, 8192.0);
            llama3_from_freq_factors(&f, 10000.0, head_dim).unwrap();
        }
    }

    #[test]
    fn divisors_that_are_not_llama_3_are_refused() {
        assert_eq!(llama3_from_freq_factors(&[1.0; 32], 10000.0, 64).unwrap(), serde_json::Value::Null);
        let mut f = converter_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        f[3] = 1.5;
        let e = llama3_from_freq_factors(&f, 500000.0, 128).unwrap_err();
        assert!(e.contains("cannot say"), "{e}");
        assert!(llama3_from_freq_factors(&[1.0; 8], 10000.0, 64).unwrap_err().contains("32 pairs"));
        assert!(llama3_from_freq_factors(&[0.5; 32], 10000.0, 64).unwrap_err().contains("at least 1"));
    }
}

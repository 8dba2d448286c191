//! Progress display: an indicatif bar on a terminal, plain log lines otherwise (CI, files).

use crate::train::StepMetrics;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

pub struct Progress {
    bar: Option<ProgressBar>,
    every: usize,
}

impl Progress {
    pub fn new(total: u64, every: usize) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new(total);
            if let Ok(style) = ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} eta {eta}") {
                b.set_style(style);
            }
            b
        });
        Progress { bar, every: every.max(1) }
    }

    pub fn step(&self, m: &StepMetrics, total: usize) {
        let msg = format!("loss {:.4} lr {:.3e} grad_norm {:.3} tok/s {:.0}", m.loss, m.lr, m.grad_norm, m.tokens_per_s);
        match &self.bar {
            Some(b) => {
                b.set_message(msg);
                b.set_position(m.step as u64);
            }
            None => {
                if m.step.is_multiple_of(self.every) || m.step == total || m.step == 1 {
                    crate::note!("step {}/{total} {msg}", m.step);
                }
            }
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}

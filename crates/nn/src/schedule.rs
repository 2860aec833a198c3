//! Learning-rate schedule: linear warmup, then cosine decay to `min_lr`.

#[derive(Clone, Debug, PartialEq)]
pub struct CosineSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
}

impl CosineSchedule {
    /// Learning rate for optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if self.warmup_steps > 0 && step < self.warmup_steps {
            return self.max_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let t = ((step - self.warmup_steps.min(step)) as f64 / span as f64).min(1.0);
        self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn warmup_then_cosine() {
        let s = CosineSchedule { max_lr: 1.0, min_lr: 0.1, warmup_steps: 10, total_steps: 110 };
        assert!((s.lr(0) - 0.1).abs() < 1e-12);
        assert!((s.lr(9) - 1.0).abs() < 1e-12);
        assert!((s.lr(10) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.55).abs() < 1e-12);
        assert!((s.lr(110) - 0.1).abs() < 1e-12);
        assert!((s.lr(500) - 0.1).abs() < 1e-12);
        assert!((1..110).all(|i| s.lr(i + 10) <= s.lr(i + 9) + 1e-12));
    }
}

//! The preference losses over per-sequence log-probs (`super::PairLogProbs`), as TRL 1.x's
//! `DPOTrainer._compute_loss` computes them (reverse-KL scores, no label smoothing), each a small
//! function of one pair: its loss and the loss's derivatives with respect to the pair's chosen
//! and rejected log-probs. With c, r the policy's and c₀, r₀ the reference's sums, lc, lr the
//! completion lengths (at least 1), β = `beta` and Δ = (c − c₀) − (r − r₀):
//!
//! - `sigmoid`: −log σ(β Δ) (DPO);
//! - `hinge`: max(0, 1 − β Δ) (SLiC);
//! - `ipo`: (Δₙ − 1 / (2β))², Δₙ = (c − c₀) / lc − (r − r₀) / lr (IPO, normalised by completion
//!   length as TRL does);
//! - `sigmoid_norm`: −log σ(β Δₙ) (length-normalised, SimPO-style, with the reference);
//! - `sft`: the NLL of the chosen completions, −Σ c / Σ lc (a token mean over the batch).
//!
//! `loss_type` is a comma list with `loss_weights` (default 1 each), as TRL's: the loss is
//! Σ weight · (the pair-mean of each type). The pair losses are computed on the host in f64 (a
//! batch's pairs are few): one read of the 2 · pairs sums; the backward hands each sum its
//! derivative times the incoming gradient, on the sums' device. Normalisation: by default over
//! the batch's pairs (and chosen tokens for `sft`); a trainer passes the optimizer step's totals
//! (`Normalizer`) so that micro-batches and ranks weigh each pair alike.
use super::PairLogProbs;
use ferrolm_tensor::{bail, Error, Result, Tensor};

/// One preference loss (TRL's `loss_type` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreferenceLoss {
    Sigmoid,
    Hinge,
    Ipo,
    SigmoidNorm,
    Sft,
}

impl PreferenceLoss {
    pub const NAMES: [&'static str; 5] = ["sigmoid", "hinge", "ipo", "sigmoid_norm", "sft"];

    pub fn name(self) -> &'static str {
        match self {
            PreferenceLoss::Sigmoid => "sigmoid",
            PreferenceLoss::Hinge => "hinge",
            PreferenceLoss::Ipo => "ipo",
            PreferenceLoss::SigmoidNorm => "sigmoid_norm",
            PreferenceLoss::Sft => "sft",
        }
    }

    pub fn parse(s: &str) -> Result<PreferenceLoss> {
        Ok(match s.trim() {
            "sigmoid" => PreferenceLoss::Sigmoid,
            "hinge" => PreferenceLoss::Hinge,
            "ipo" => PreferenceLoss::Ipo,
            "sigmoid_norm" => PreferenceLoss::SigmoidNorm,
            "sft" => PreferenceLoss::Sft,
            other => bail!("--loss-type", "unknown loss type {other:?}: expected one of {}", Self::NAMES.join(", ")),
        })
    }
}

/// β (`--beta`, default 0.1) and the weighted losses (`--loss-type`, `--loss-weights`).
#[derive(Clone, Debug, PartialEq)]
pub struct PreferenceConfig {
    pub beta: f64,
    pub losses: Vec<(PreferenceLoss, f64)>,
}

impl Default for PreferenceConfig {
    fn default() -> Self {
        PreferenceConfig { beta: 0.1, losses: vec![(PreferenceLoss::Sigmoid, 1.0)] }
    }
}

impl PreferenceConfig {
    /// From `--loss-type a,b` and `--loss-weights x,y` (one weight per type; absent, 1 each).
    pub fn parse(beta: f64, loss_type: &str, loss_weights: Option<&str>) -> Result<PreferenceConfig> {
        if !(beta.is_finite() && beta > 0.0) {
            bail!("--beta", "must be a positive number, got {beta}");
        }
        let types = loss_type.split(',').map(PreferenceLoss::parse).collect::<Result<Vec<_>>>()?;
        let weights = match loss_weights {
            None => vec![1.0; types.len()],
            Some(w) => w
                .split(',')
                .map(|x| {
                    x.trim()
                        .parse::<f64>()
                        .ok()
                        .filter(|v| v.is_finite())
                        .ok_or_else(|| Error::new("--loss-weights", format!("{x:?} is not a number")))
                })
                .collect::<Result<Vec<_>>>()?,
        };
        if weights.len() != types.len() {
            bail!("--loss-weights", "{} weights for {} loss types ({loss_type})", weights.len(), types.len());
        }
        Ok(PreferenceConfig { beta, losses: types.into_iter().zip(weights).collect() })
    }
}

/// What the losses are averaged over: the pairs (and, for `sft`, the chosen completion tokens)
/// of the whole optimizer step; `None`: this batch's.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Normalizer {
    pub pairs: Option<f64>,
    pub chosen_tokens: Option<f64>,
}

/// The reference's sums of the same pairs (no gradient), on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceLogProbs {
    pub chosen: Vec<f64>,
    pub rejected: Vec<f64>,
}

impl ReferenceLogProbs {
    /// From a reference forward's `PairLogProbs` (read back once).
    pub fn of(p: &PairLogProbs) -> Result<ReferenceLogProbs> {
        Ok(ReferenceLogProbs { chosen: p.chosen.detach().to_vec_f64()?, rejected: p.rejected.detach().to_vec_f64()? })
    }
}

/// Sums over pairs of TRL's metrics (`rewards/chosen` is the mean of β (c − c₀), ...), so that
/// micro-batches and ranks add up before the means are taken.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PreferenceMetrics {
    pub pairs: usize,
    pub rewards_chosen: f64,
    pub rewards_rejected: f64,
    pub accuracies: f64,
    pub margins: f64,
    pub logps_chosen: f64,
    pub logps_rejected: f64,
}

impl PreferenceMetrics {
    pub fn merge(&mut self, o: &PreferenceMetrics) {
        self.pairs += o.pairs;
        self.rewards_chosen += o.rewards_chosen;
        self.rewards_rejected += o.rewards_rejected;
        self.accuracies += o.accuracies;
        self.margins += o.margins;
        self.logps_chosen += o.logps_chosen;
        self.logps_rejected += o.logps_rejected;
    }

    /// The means under TRL's names, in its order.
    pub fn means(&self) -> [(&'static str, f64); 6] {
        let n = self.pairs.max(1) as f64;
        [
            ("rewards/chosen", self.rewards_chosen / n),
            ("rewards/rejected", self.rewards_rejected / n),
            ("rewards/accuracies", self.accuracies / n),
            ("rewards/margins", self.margins / n),
            ("logps/chosen", self.logps_chosen / n),
            ("logps/rejected", self.logps_rejected / n),
        ]
    }
}

/// −log σ(z), stably.
fn neg_log_sigmoid(z: f64) -> f64 {
    (-z).max(0.0) + (-z.abs()).exp().ln_1p()
}

fn sigmoid(z: f64) -> f64 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

/// One pair's loss of `kind` and its derivatives (d/dc, d/dr), from the log-ratios
/// lc = c − c₀, lr = r − r₀ and completion lengths nc, nr (at least 1).
fn pair_loss(kind: PreferenceLoss, beta: f64, lc: f64, lr: f64, nc: f64, nr: f64) -> (f64, f64, f64) {
    let delta = lc - lr;
    match kind {
        PreferenceLoss::Sigmoid => {
            let d = -beta * sigmoid(-beta * delta);
            (neg_log_sigmoid(beta * delta), d, -d)
        }
        PreferenceLoss::Hinge => {
            let m = 1.0 - beta * delta;
            if m > 0.0 {
                (m, -beta, beta)
            } else {
                (0.0, 0.0, 0.0)
            }
        }
        PreferenceLoss::Ipo => {
            let dn = lc / nc - lr / nr;
            let e = dn - 1.0 / (2.0 * beta);
            (e * e, 2.0 * e / nc, -2.0 * e / nr)
        }
        PreferenceLoss::SigmoidNorm => {
            let dn = lc / nc - lr / nr;
            let d = -beta * sigmoid(-beta * dn);
            (neg_log_sigmoid(beta * dn), d / nc, -d / nr)
        }
        PreferenceLoss::Sft => unreachable!("sft is a token mean over the batch"),
    }
}

/// The weighted preference loss (a scalar in the sums' dtype, differentiable through
/// `policy.chosen` and `policy.rejected`) and the batch's metric sums.
pub fn preference_loss(
    cfg: &PreferenceConfig,
    policy: &PairLogProbs,
    reference: &ReferenceLogProbs,
    norm: Normalizer,
) -> Result<(Tensor, PreferenceMetrics)> {
    let op = "preference_loss";
    let p = policy.chosen.numel();
    if policy.rejected.numel() != p || reference.chosen.len() != p || reference.rejected.len() != p || policy.chosen_tokens.len() != p {
        bail!(op, "the policy has {p} pairs, the reference {} and {}", reference.chosen.len(), reference.rejected.len());
    }
    let c = policy.chosen.detach().to_vec_f64()?;
    let r = policy.rejected.detach().to_vec_f64()?;
    let beta = cfg.beta;
    let pairs = norm.pairs.unwrap_or(p as f64).max(1.0);
    let tokens = norm.chosen_tokens.unwrap_or(policy.chosen_tokens.iter().sum::<usize>() as f64).max(1.0);
    let (mut loss, mut dc, mut dr) = (0f64, vec![0f64; p], vec![0f64; p]);
    for &(kind, weight) in &cfg.losses {
        if kind == PreferenceLoss::Sft {
            loss += weight * -c.iter().sum::<f64>() / tokens;
            dc.iter_mut().for_each(|d| *d -= weight / tokens);
            continue;
        }
        for i in 0..p {
            let (nc, nr) = ((policy.chosen_tokens[i].max(1)) as f64, (policy.rejected_tokens[i].max(1)) as f64);
            let (l, a, b) = pair_loss(kind, beta, c[i] - reference.chosen[i], r[i] - reference.rejected[i], nc, nr);
            loss += weight * l / pairs;
            dc[i] += weight * a / pairs;
            dr[i] += weight * b / pairs;
        }
    }
    let mut m = PreferenceMetrics { pairs: p, ..Default::default() };
    for i in 0..p {
        let (rc, rr) = (beta * (c[i] - reference.chosen[i]), beta * (r[i] - reference.rejected[i]));
        m.rewards_chosen += rc;
        m.rewards_rejected += rr;
        m.accuracies += f64::from(u8::from(rc > rr));
        m.margins += rc - rr;
        m.logps_chosen += c[i];
        m.logps_rejected += r[i];
    }
    let (dt, dev) = (policy.chosen.dtype(), policy.chosen.device());
    let out = Tensor::from_vec(vec![loss], (), ferrolm_tensor::Device::Cpu)?.to_dtype(dt)?.to_device(dev)?;
    let backward = move |g: &Tensor| {
        let up = |d: &[f64]| -> Result<Tensor> {
            let t = Tensor::from_vec(d.to_vec(), [d.len()], ferrolm_tensor::Device::Cpu)?.to_dtype(dt)?.to_device(dev)?;
            t.mul(&g.to_dtype(dt)?.reshape([1])?)
        };
        Ok(vec![Some(up(&dc)?), Some(up(&dr)?)])
    };
    Ok((Tensor::from_op(out, op, &[&policy.chosen, &policy.rejected], Box::new(backward)), m))
}

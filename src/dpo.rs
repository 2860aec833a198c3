//! Preference tuning (DPO and its siblings) in the trainer: the objective a micro-batch of
//! pairs trains with, the reference it is measured against, and its validation.
//!
//! The reference is one of (docs/PREFERENCE.md, "The reference"):
//! - **live**: a frozen model (`--ref-model`, default the starting `--model`) on the policy's
//!   layout (with tensor parallelism, sharded as the policy is), run under `no_grad`;
//! - **the base with the adapters off** (LoRA without `--ref-model`): the policy's own frozen
//!   weights under `ferrolm_nn::lora::adapters_off`, no second copy;
//! - **precomputed** (`--precompute-ref`): each pair's reference log-probs, computed once before
//!   training for the training and validation pairs, kept in the run directory
//!   ([`REF_LOGPS`], with a hash of the pairs and the reference's identity) and reused on
//!   `--resume`; no reference weights are held while training.
//!
//! The step's loss is averaged over the pairs of the whole optimizer step (every micro-batch of
//! every data-parallel rank): each micro-batch's loss is divided by the step's pairs per rank
//! (`StepBatches::pairs / dp`), and the engine averages the ranks' gradients.
use crate::batches::{PairMicro, StepBatches};
use crate::nn::CausalLm;
use crate::{AnyResult, Llama};
use anyhow::{bail, Context};
use ferrolm_data::preference::PreferencePair;
use ferrolm_nn::objective::preference::{preference_loss, Normalizer, PreferenceConfig, PreferenceMetrics, ReferenceLogProbs};
use ferrolm_nn::objective::{pack_pairs, pair_logprobs, PackedPairs, PairLogProbs};
use ferrolm_tensor::{no_grad, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The file in the run directory that holds the precomputed reference log-probs.
pub const REF_LOGPS: &str = "ref_logps.json";

/// Each pair's reference log-probs (chosen, rejected), keyed by the pair's index in its split,
/// and the identity of the pairs and the reference they were computed for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RefLogps {
    /// A hash (hex) of every pair's ids and the reference's identity ([`identity`]).
    pub identity: String,
    #[serde(with = "exact")]
    pub train: Vec<[f64; 2]>,
    #[serde(with = "exact")]
    pub val: Vec<[f64; 2]>,
}

/// The log-probs as decimal strings that read back to the same bits (Rust's shortest
/// round-trip form): serde_json's own float parsing may be off by an ulp, and `--resume` must
/// see exactly the values the uninterrupted run trained with.
mod exact {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[[f64; 2]], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|[c, r]| [c.to_string(), r.to_string()]))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<[f64; 2]>, D::Error> {
        let v: Vec<[String; 2]> = Vec::deserialize(d)?;
        let num = |s: &str| s.parse::<f64>().map_err(|e| D::Error::custom(format!("log-prob {s:?}: {e}")));
        v.iter().map(|[c, r]| Ok([num(c)?, num(r)?])).collect()
    }
}

impl RefLogps {
    /// Reads `dir/ref_logps.json` when it is there and was computed for `identity`; a file for
    /// other pairs or another reference is ignored with a warning.
    pub fn find(dir: &Path, identity: &str) -> AnyResult<Option<RefLogps>> {
        let path = dir.join(REF_LOGPS);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let r: RefLogps = serde_json::from_str(&text).with_context(|| format!("{}: not a reference log-prob file", path.display()))?;
        if r.identity != identity {
            tracing::warn!(
                "{}: computed for other pairs or another reference (identity {}, this run's {identity}): computing them again",
                path.display(),
                r.identity
            );
            return Ok(None);
        }
        Ok(Some(r))
    }

    /// Writes `dir/ref_logps.json` atomically.
    pub fn write(&self, dir: &Path) -> AnyResult<()> {
        let path = dir.join(REF_LOGPS);
        ferrolm_nn::safetensors_io::write_atomic(&path, serde_json::to_string(self)?.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))
    }
}

/// FNV-1a 64 over bytes (stable across builds, unlike std's hasher).
fn fnv(h: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *h ^= u64::from(*b);
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

/// The identity of a precomputation: every pair's ids (train, then validation) and `reference`
/// (the reference model's directory, its weights' sizes and times, the dtype: what the
/// log-probs depend on).
pub fn identity(train: &[PreferencePair], val: &[PreferencePair], reference: &str) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for (split, pairs) in [(0u8, train), (1u8, val)] {
        fnv(&mut h, &[split]);
        fnv(&mut h, &(pairs.len() as u64).to_le_bytes());
        for p in pairs {
            for part in [&p.prompt, &p.chosen, &p.rejected] {
                fnv(&mut h, &(part.len() as u64).to_le_bytes());
                part.iter().for_each(|t| fnv(&mut h, &t.to_le_bytes()));
            }
        }
    }
    fnv(&mut h, reference.as_bytes());
    format!("{h:016x}")
}

/// What a reference model directory's log-probs depend on, for [`identity`]: its canonical
/// path, its weight files' sizes and modification times, and the run's dtype.
pub fn model_identity(dir: &Path, dtype: ferrolm_tensor::DType) -> String {
    let mut s = format!("{}|{dtype}", dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf()).display());
    let mut files: Vec<_> = std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).collect();
    files.sort();
    for f in files.iter().filter(|f| f.extension().is_some_and(|e| e == "safetensors") || f.ends_with("config.json")) {
        if let Ok(m) = f.metadata() {
            let t = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
            s.push_str(&format!("|{}:{}:{t}", f.file_name().unwrap_or_default().to_string_lossy(), m.len()));
        }
    }
    s
}

/// Where the reference log-probs come from.
pub enum Reference {
    /// A frozen model (this rank's tensor-parallel shard of it), run under `no_grad`.
    Live(Box<Llama>),
    /// The policy with its LoRA adapters off: the frozen base.
    AdaptersOff,
    /// Computed before training, per pair.
    Precomputed(RefLogps),
}

impl Reference {
    /// How the log line names it.
    pub fn describe(&self) -> &'static str {
        match self {
            Reference::Live(_) => "live (a frozen reference model)",
            Reference::AdaptersOff => "the base model with the LoRA adapters off",
            Reference::Precomputed(_) => "precomputed",
        }
    }
}

/// The preference objective of a run: the losses and the reference, and the last step's metrics.
pub struct Preference {
    pub cfg: PreferenceConfig,
    pub reference: Reference,
    /// The last training step's metric sums over every rank's pairs.
    pub last: Option<PreferenceMetrics>,
    /// A live or adapters-off reference's log-probs of the validation pairs, by pair, kept from
    /// the first validation pass: the reference is frozen, so every later pass would compute the
    /// same values again (the same pairs packed into the same batches).
    val_refs: std::sync::Mutex<Vec<Option<[f64; 2]>>>,
}

/// `model`'s log-probs of `batch`, without gradients (a reference).
fn frozen_logprobs(model: &dyn CausalLm, batch: &PackedPairs, adapters_off: bool) -> Result<ReferenceLogProbs> {
    let _g = no_grad();
    let _off = adapters_off.then(ferrolm_nn::lora::adapters_off);
    ReferenceLogProbs::of(&pair_logprobs(model, batch)?)
}

/// Which split a batch's indices refer to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Split {
    Train,
    Val,
}

impl Preference {
    pub fn new(cfg: PreferenceConfig, reference: Reference) -> Preference {
        Preference { cfg, reference, last: None, val_refs: Default::default() }
    }

    /// The reference log-probs of `batch` (pairs `indices` of `split`): looked up when
    /// precomputed; else run (the live model, or the policy with its adapters off), the
    /// validation pairs' only on the first pass and kept in `val_refs` for the later ones.
    fn reference(&self, policy: &dyn CausalLm, batch: &PackedPairs, indices: &[usize], split: Split) -> Result<ReferenceLogProbs> {
        let lookup = |table: &dyn Fn(usize) -> Option<[f64; 2]>| -> Option<ReferenceLogProbs> {
            let rows: Vec<[f64; 2]> = indices.iter().map(|&i| table(i)).collect::<Option<_>>()?;
            Some(ReferenceLogProbs { chosen: rows.iter().map(|r| r[0]).collect(), rejected: rows.iter().map(|r| r[1]).collect() })
        };
        if let Reference::Precomputed(r) = &self.reference {
            let table = if split == Split::Train { &r.train } else { &r.val };
            return lookup(&|i| table.get(i).copied()).ok_or_else(|| {
                let i = indices.iter().find(|&&i| i >= table.len()).copied().unwrap_or_default();
                ferrolm_tensor::Error::new("reference log-probs", format!("no precomputed reference log-probs for pair {i}"))
            });
        }
        let mut kept = (split == Split::Val).then(|| self.val_refs.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(r) = kept.as_ref().and_then(|cache| lookup(&|i| cache.get(i).copied().flatten())) {
            return Ok(r);
        }
        let r = match &self.reference {
            Reference::Live(m) => frozen_logprobs(m.as_ref(), batch, false)?,
            _ => frozen_logprobs(policy, batch, true)?,
        };
        if let Some(cache) = kept.as_mut() {
            for (k, &i) in indices.iter().enumerate() {
                if cache.len() <= i {
                    cache.resize(i + 1, None);
                }
                cache[i] = Some([r.chosen[k], r.rejected[k]]);
            }
        }
        Ok(r)
    }

    /// One micro-batch's loss (to backpropagate) and metric sums: the reference first (no
    /// gradient), then the policy's forward; normalised over the step's pairs per rank.
    pub fn micro_loss(&self, policy: &dyn CausalLm, pm: &PairMicro, step: &StepBatches, dp: usize) -> Result<(Tensor, PreferenceMetrics)> {
        let reference = self.reference(policy, &pm.packed, &pm.indices, Split::Train)?;
        let lp: PairLogProbs = pair_logprobs(policy, &pm.packed)?;
        let dp = dp.max(1) as f64;
        let norm = Normalizer { pairs: Some(step.pairs as f64 / dp), chosen_tokens: Some(step.chosen_tokens as f64 / dp) };
        preference_loss(&self.cfg, &lp, &reference, norm)
    }

    /// The preference loss and metrics of the first `take` pairs of `pairs` (the validation
    /// split), `batch` pairs a forward: the mean loss over the pairs (a `sft` term over the
    /// chosen tokens) and TRL's metrics.
    pub fn validate(
        &self,
        policy: &dyn CausalLm,
        pairs: &[PreferencePair],
        take: usize,
        batch: usize,
        row_tokens: usize,
        pad_id: u32,
    ) -> AnyResult<(f64, PreferenceMetrics)> {
        let _g = no_grad();
        let take = take.min(pairs.len());
        let chosen: usize = pairs[..take].iter().map(|p| crate::batches::scored_tokens(&p.prompt, &p.chosen)).sum();
        let norm = Normalizer { pairs: Some(take as f64), chosen_tokens: Some(chosen as f64) };
        let (mut loss, mut m) = (0.0, PreferenceMetrics::default());
        for start in (0..take).step_by(batch.max(1)) {
            let end = (start + batch.max(1)).min(take);
            let packed = pack_pairs(&pairs[start..end], row_tokens, pad_id)?;
            let indices: Vec<usize> = (start..end).collect();
            let reference = self.reference(policy, &packed, &indices, Split::Val)?;
            let lp = pair_logprobs(policy, &packed)?;
            let (l, bm) = preference_loss(&self.cfg, &lp, &reference, norm)?;
            loss += l.to_vec_f64()?[0];
            m.merge(&bm);
        }
        if take == 0 {
            bail!("the validation split holds no preference pair");
        }
        Ok((loss, m))
    }
}

/// `model`'s log-probs of every pair of `pairs` (chosen, rejected), `batch` pairs a forward,
/// without gradients (any LoRA adapters of `model` switched off: the reference is its base).
pub fn precompute(
    model: &dyn CausalLm,
    pairs: &[PreferencePair],
    batch: usize,
    row_tokens: usize,
    pad_id: u32,
) -> AnyResult<Vec<[f64; 2]>> {
    let mut out = Vec::with_capacity(pairs.len());
    let bar = crate::progress::Progress::steps(pairs.len().div_ceil(batch.max(1)) as u64, "ref  ");
    for chunk in pairs.chunks(batch.max(1)) {
        let packed = pack_pairs(chunk, row_tokens, pad_id)?;
        let r = frozen_logprobs(model, &packed, true)?;
        out.extend(r.chosen.iter().zip(&r.rejected).map(|(c, r)| [*c, *r]));
        bar.inc(1);
    }
    Ok(out)
}

/// Sums `m` over the data-parallel ranks of `group` (each rank scored its own pairs).
pub fn reduce_metrics(
    m: &mut PreferenceMetrics,
    group: &dyn ferrolm_parallel::comm::Communicator,
    device: ferrolm_tensor::Device,
) -> Result<()> {
    if group.size() == 1 {
        return Ok(());
    }
    let r = |v: f64| ferrolm_parallel::comm::all_reduce_scalar(group, v, device);
    m.pairs = r(m.pairs as f64)?.round() as usize;
    m.rewards_chosen = r(m.rewards_chosen)?;
    m.rewards_rejected = r(m.rewards_rejected)?;
    m.accuracies = r(m.accuracies)?;
    m.margins = r(m.margins)?;
    m.logps_chosen = r(m.logps_chosen)?;
    m.logps_rejected = r(m.logps_rejected)?;
    Ok(())
}

/// The metrics as `key value` pairs for a log line (`rewards/accuracies 0.7500 ...`).
pub fn describe(m: &PreferenceMetrics) -> String {
    m.means().iter().map(|(k, v)| format!("{k} {v:.4}")).collect::<Vec<_>>().join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_tensor::{DType, Device, Rng};

    fn pairs(n: usize) -> Vec<PreferencePair> {
        let mut rng = Rng::new(7);
        let mut ids = |len: usize| (0..len).map(|_| (rng.next_u64() % 60) as u32 + 2).collect::<Vec<u32>>();
        (0..n).map(|i| PreferencePair { prompt: ids(3 + i % 4), chosen: ids(2 + i % 3), rejected: ids(4 - i % 3) }).collect()
    }

    /// A live reference's validation log-probs are computed once: a second pass gives the same
    /// loss and metrics to the bit, and uses the kept values, not the reference (swapped here for
    /// another model, which no real run does, so a recomputation would show).
    #[test]
    fn a_live_references_validation_log_probs_are_kept_from_the_first_pass() {
        let cfg = ferrolm_testing::tiny_llama("");
        let model = |seed| Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(seed)).unwrap();
        let (policy, val) = (model(1), pairs(7));
        let mut pref = Preference::new(PreferenceConfig::default(), Reference::Live(Box::new(model(2))));
        let first = pref.validate(&policy, &val, 7, 3, 16, 0).unwrap();
        let again = pref.validate(&policy, &val, 7, 3, 16, 0).unwrap();
        assert_eq!(first.0.to_bits(), again.0.to_bits());
        assert_eq!(describe(&first.1), describe(&again.1));
        assert!(first.1.means().iter().any(|(k, v)| k.starts_with("rewards/") && *v != 0.0), "a reference unlike the policy gives rewards");
        pref.reference = Reference::Live(Box::new(model(3)));
        let kept = pref.validate(&policy, &val, 7, 3, 16, 0).unwrap();
        assert_eq!(kept.0.to_bits(), first.0.to_bits(), "the second reference was run: the first's log-probs were not kept");
        // A fresh objective with that reference computes its own (different) values.
        let fresh = Preference::new(PreferenceConfig::default(), Reference::Live(Box::new(model(3))));
        assert_ne!(fresh.validate(&policy, &val, 7, 3, 16, 0).unwrap().0.to_bits(), first.0.to_bits());
    }
}

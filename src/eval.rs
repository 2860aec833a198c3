//! Scoring a model (the `eval` tool's work, and the trainer's validation): on a token stream, the
//! mean next-token cross-entropy over every full window `ids[i*T .. i*T+T+1]`, a batch of
//! windows per forward pass; on conversations, the mean over their trained tokens, each
//! conversation scored alone.
use crate::data::chat::{PackedData, IGNORE_INDEX};
use crate::nn::CausalLm;
use crate::ops::Tokens;
use crate::progress::Progress;
use crate::{AnyResult, Device};
use anyhow::bail;

/// A model's score on a token stream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Score {
    /// Mean next-token cross-entropy, nats.
    pub loss: f64,
    /// Tokens scored.
    pub tokens: usize,
    /// On conversations (`eval --chat`): what became of each one read (scored, dropped, cut,
    /// skipped).
    pub chat: Option<crate::chat::ChatCounts>,
}

impl Score {
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }

    /// `eval`'s last line: `loss <float> ppl <float> tokens <int>`, and on conversations
    /// ` conversations <scored> dropped <int> cut <int> skipped <int>` after it (dropped: longer
    /// than --seq-len; cut: scored over their first --seq-len tokens, `--truncate`; skipped:
    /// bad records and conversations with no trained token).
    pub fn line(&self) -> String {
        let mut l = format!("loss {:.6} ppl {:.4} tokens {}", self.loss, self.perplexity(), self.tokens);
        if let Some(c) = &self.chat {
            l += &format!(" conversations {} dropped {} cut {} skipped {}", c.kept, c.dropped, c.cut, c.bad + c.untrained);
        }
        l
    }
}

/// Full windows of `seq_len` + 1 tokens in `n` ids.
pub fn windows(n: usize, seq_len: usize) -> usize {
    if n > seq_len {
        (n - 1) / seq_len
    } else {
        0
    }
}

/// The mean loss of `model` on `device` over every full window of `ids`, `batch_size` windows
/// per forward pass, with a progress bar. Refuses ids that fill no window.
pub fn mean_loss(model: &dyn CausalLm, ids: &[u32], seq_len: usize, batch_size: usize, device: Device) -> AnyResult<Score> {
    let (t, bs) = (seq_len, batch_size.max(1));
    let windows = windows(ids.len(), t);
    if windows == 0 {
        bail!("{} tokens do not fill one window of {} tokens", ids.len(), t + 1);
    }
    let _g = crate::tensor::no_grad();
    let (mut sum, mut n) = (0.0f64, 0usize);
    let bar = Progress::items((windows * t) as u64, "eval");
    for start in (0..windows).step_by(bs) {
        let b = bs.min(windows - start);
        let (mut x, mut y) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for w in start..start + b {
            let win = &ids[w * t..w * t + t + 1];
            x.extend(win[..t].iter().map(|&v| v as i32));
            y.extend(win[1..].iter().map(|&v| v as i32));
        }
        let xt = Tokens::upload(x, [b, t], device)?;
        let yt = Tokens::upload(y, [b, t], device)?;
        sum += model.loss(xt, yt)?.item()? * (b * t) as f64;
        n += b * t;
        bar.inc((b * t) as u64);
    }
    drop(bar);
    Ok(Score { loss: sum / n as f64, tokens: n, chat: None })
}

/// The mean loss over the trained targets of `data`'s conversations, each scored alone: `data`
/// holds one conversation a row (packed with `--no-pack`, so one has the same masking and
/// length limits as training); its first `max_batches x batch_size` rows (all if `max_batches`
/// is 0) are sorted by length and run `batch_size` a forward pass, cut to the longest
/// conversation of the batch. Padding follows a conversation, so causal attention never lets
/// the conversation read it, and its targets are ignored. The sum over tokens is in f64.
pub fn conversations_loss(
    model: &dyn CausalLm,
    data: &PackedData,
    batch_size: usize,
    max_batches: usize,
    device: Device,
) -> AnyResult<Score> {
    let bs = batch_size.max(1);
    let rows = data.num_rows();
    let take = if max_batches > 0 { rows.min(max_batches.saturating_mul(bs)) } else { rows };
    // (conversation length, row): one conversation a row, at its start.
    let mut order: Vec<(usize, usize)> = (0..take).map(|i| (data.row(i).cu_seqlens[1] as usize, i)).collect();
    order.sort();
    let _g = crate::tensor::no_grad();
    let (mut sum, mut n) = (0.0f64, 0usize);
    let bar = Progress::items(take as u64, "eval");
    for batch in order.chunks(bs) {
        let t = batch.iter().map(|&(len, _)| len).max().unwrap_or(0);
        let (mut x, mut y) = (Vec::with_capacity(batch.len() * t), Vec::with_capacity(batch.len() * t));
        for &(_, i) in batch {
            let r = data.row(i);
            x.extend(r.ids[..t].iter().map(|&v| v as i32));
            y.extend_from_slice(&r.targets[..t]);
        }
        let count = y.iter().filter(|&&v| v != IGNORE_INDEX).count();
        bar.inc(batch.len() as u64);
        if count == 0 {
            continue;
        }
        let xt = Tokens::upload(x, [batch.len(), t], device)?;
        let yt = Tokens::upload(y, [batch.len(), t], device)?;
        sum += model.loss(xt, yt)?.item()? * count as f64;
        n += count;
    }
    drop(bar);
    if n == 0 {
        bail!("no trained token to score in {} conversation(s)", take);
    }
    Ok(Score { loss: sum / n as f64, tokens: n, chat: None })
}

/// The reference a preference file is scored against (`eval --preference`).
#[derive(Clone, Copy)]
pub enum PreferenceReference<'a> {
    /// A model of its own (`--ref-model`).
    Model(&'a crate::Llama),
    /// The scored model with its LoRA adapters switched off (`--lora` without `--ref-model`):
    /// the base, with no second copy of the weights.
    AdaptersOff,
    /// The scored model itself: every reward is 0.
    Itself,
}

/// A model's score on preference pairs (`eval --preference`): the loss of the whole file as
/// `preference_loss` computes it over all its pairs at once, and the metrics' sums.
#[derive(Clone, Debug, PartialEq)]
pub struct PreferenceScore {
    /// The weighted loss, averaged over the pairs (and `sft` over the chosen tokens).
    pub loss: f64,
    pub metrics: crate::nn::objective::preference::PreferenceMetrics,
}

impl PreferenceScore {
    /// The metrics' means under TRL's names, one `name value` line each (`rewards/chosen`, ...).
    pub fn metric_lines(&self) -> Vec<String> {
        self.metrics.means().iter().map(|(k, v)| format!("{k} {v:.6}")).collect()
    }

    /// `eval --preference`'s last line: `dpo_loss X accuracy Y margin Z pairs N` (the mean loss,
    /// TRL's `rewards/accuracies` and `rewards/margins`, the pairs scored).
    pub fn line(&self) -> String {
        let m = self.metrics.means();
        let get = |k: &str| m.iter().find(|(n, _)| *n == k).map_or(f64::NAN, |(_, v)| *v);
        format!(
            "dpo_loss {:.6} accuracy {:.6} margin {:.6} pairs {}",
            self.loss,
            get("rewards/accuracies"),
            get("rewards/margins"),
            self.metrics.pairs
        )
    }
}

/// Scores `pairs` under `model` against `reference`, `batch_size` pairs a forward pass (each
/// batch's chosen and rejected sequences packed into rows as long as its longest sequence, with
/// per-sequence attention: `objective::pack_pairs`), without gradients. The per-sequence sums of
/// every batch are gathered on the host and `preference_loss` runs once over all the pairs, so
/// the loss is the file's mean, whatever the batch size. A sequence longer than the model's
/// max_position_embeddings is refused.
pub fn preference_score(
    model: &crate::Llama,
    reference: PreferenceReference,
    pairs: &[crate::data::preference::PreferencePair],
    cfg: &crate::nn::objective::preference::PreferenceConfig,
    batch_size: usize,
) -> AnyResult<PreferenceScore> {
    use crate::nn::objective::preference::{preference_loss, Normalizer, ReferenceLogProbs};
    use crate::nn::objective::{pack_pairs, pair_logprobs, PairLogProbs};
    if pairs.is_empty() {
        bail!("no preference pair to score");
    }
    let max = model.config().max_position_embeddings;
    for (i, p) in pairs.iter().enumerate() {
        let len = p.chosen_len().max(p.rejected_len());
        if len > max {
            bail!(
                "pair {i} is {len} tokens (prompt + completion), more than the model's max_position_embeddings {max}: lower --max-length"
            );
        }
    }
    let _g = crate::tensor::no_grad();
    let (mut c, mut r, mut rc, mut rr) = (vec![], vec![], vec![], vec![]);
    let (mut nc, mut nr) = (vec![], vec![]);
    let bar = Progress::items(pairs.len() as u64, "eval");
    for batch in pairs.chunks(batch_size.max(1)) {
        let row = batch.iter().map(|p| p.chosen_len().max(p.rejected_len())).max().unwrap_or(1);
        let packed = pack_pairs(batch, row, 0)?;
        let policy = pair_logprobs(model, &packed)?;
        let refs = match reference {
            PreferenceReference::Model(m) => ReferenceLogProbs::of(&pair_logprobs(m, &packed)?)?,
            PreferenceReference::AdaptersOff => {
                let _off = crate::nn::lora::adapters_off();
                ReferenceLogProbs::of(&pair_logprobs(model, &packed)?)?
            }
            PreferenceReference::Itself => ReferenceLogProbs::of(&policy)?,
        };
        c.extend(policy.chosen.to_vec_f64()?);
        r.extend(policy.rejected.to_vec_f64()?);
        nc.extend_from_slice(&policy.chosen_tokens);
        nr.extend_from_slice(&policy.rejected_tokens);
        rc.extend(refs.chosen);
        rr.extend(refs.rejected);
        bar.inc(batch.len() as u64);
    }
    drop(bar);
    let n = c.len();
    let host = |v: Vec<f64>| crate::Tensor::from_vec(v, [n], Device::Cpu);
    let policy = PairLogProbs { chosen: host(c)?, rejected: host(r)?, chosen_tokens: nc, rejected_tokens: nr };
    let (loss, metrics) = preference_loss(cfg, &policy, &ReferenceLogProbs { chosen: rc, rejected: rr }, Normalizer::default())?;
    Ok(PreferenceScore { loss: loss.item()?, metrics })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::LlamaConfig;
    use crate::tensor::Rng;
    use crate::DType;
    use crate::Llama;

    #[test]
    fn the_score_covers_every_full_window_whatever_the_batch() {
        let cfg = LlamaConfig::preset("tiny").unwrap();
        let model = Llama::new(cfg.clone(), DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
        let t = 8;
        // 5 full windows of 9 tokens (consecutive windows share their edge token) and 3 left over.
        let ids: Vec<u32> = (0..5 * t + 3).map(|i| (i * 7 % cfg.vocab_size) as u32).collect();
        assert_eq!(windows(ids.len(), t), 5);
        let one = mean_loss(&model, &ids, t, 1, Device::Cpu).unwrap();
        let three = mean_loss(&model, &ids, t, 3, Device::Cpu).unwrap();
        assert_eq!((one.tokens, three.tokens), (5 * t, 5 * t));
        assert!((one.loss - three.loss).abs() < 1e-5 * one.loss, "{one:?} vs {three:?}");
        // A random model scores about ln(vocab).
        assert!((one.loss - (cfg.vocab_size as f64).ln()).abs() < 1.0, "{one:?}");
        assert!((one.perplexity() - one.loss.exp()).abs() < 1e-12);
        assert!(mean_loss(&model, &ids[..t], t, 1, Device::Cpu).is_err());
    }
}

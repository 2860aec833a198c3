//! The trainer's batches, one optimizer step at a time: shuffled windows of token shards
//! (pretraining: every token trained) or packed rows of tokenized conversations (fine-tuning,
//! `ferrolm_data::chat`: targets with the ignore index, positions that restart in each
//! conversation, each row's segment bounds). A step hands this data-parallel rank its
//! micro-batches and, with them, the trained tokens of the whole step on every rank: the loss
//! of a step is the sum of the per-token cross-entropy over its trained tokens divided by that
//! count (docs/ARCHITECTURE.md, "The loss scale"), so a micro-batch with few trained tokens
//! weighs as little as it should.
//!
//! For each micro-batch both sources draw `dp x B` items (windows or rows) of one seeded order
//! and rank r takes the r-th block of B, so every rank knows the whole step's counts without a
//! collective, and a layout with the same global batch (`B x grad_accum x dp`) trains on the
//! same items in the same order.
use crate::AnyResult;
use anyhow::bail;
use ferrolm_data::chat::{PackedData, PackedRow, IGNORE_INDEX};
use ferrolm_data::preference::PreferencePair;
use ferrolm_data::{DataLoader, EpochOrder, LoaderState};
use ferrolm_nn::Packing;
use ferrolm_ops::{LossScale, Tokens};
use ferrolm_tensor::{Device, Result, Tensor};

/// The segments of `row` that hold a trained target: conversations (one without a trained
/// token is never packed), not padding.
fn conversations(row: &PackedRow) -> impl Iterator<Item = (usize, usize)> + '_ {
    row.cu_seqlens.windows(2).map(|w| (w[0] as usize, w[1] as usize)).filter(|&(a, b)| row.targets[a..b].iter().any(|&t| t != IGNORE_INDEX))
}

/// Tokens of the row's conversations (not padding).
pub fn real_tokens(row: &PackedRow) -> usize {
    conversations(row).map(|(a, b)| b - a).sum()
}

/// Whether plain causal attention computes the row's conversations exactly: at most one, at the
/// row's start (what follows it is padding, which no trained position reads).
fn is_single(row: &PackedRow) -> bool {
    let mut c = conversations(row);
    match (c.next(), c.next()) {
        (None, _) => true,
        (Some((a, _)), None) => a == 0,
        _ => false,
    }
}

/// One micro-batch of this rank.
pub struct MicroBatch {
    /// (B, T) i32 ids and aligned targets, with their host copies.
    pub inputs: Tokens,
    pub targets: Tokens,
    /// Positions and segment bounds of rows that pack several conversations; None where plain
    /// causal attention is exact (windows; rows of one conversation each, then padding).
    pub packing: Option<Packing>,
    /// Trained targets in this micro-batch.
    pub trained: u64,
    /// Preference pairs (DPO): the packed pairs and their indices in the training set; the
    /// loss is then the preference objective's (`crate::dpo`), not cross-entropy.
    pub pairs: Option<PairMicro>,
}

/// A micro-batch of preference pairs: `packed` (chosen and rejected of each pair in one packed
/// forward, `ferrolm_nn::objective::pack_pairs`) and each pair's index in the training set
/// (what precomputed reference log-probs are keyed by).
pub struct PairMicro {
    pub packed: ferrolm_nn::objective::PackedPairs,
    pub indices: Vec<usize>,
}

impl MicroBatch {
    /// The loss (f32 scalar) to backpropagate: the sum of the per-token cross-entropy over the
    /// micro-batch's trained targets times `scale` ([`StepBatches::loss_scale`]), the head's
    /// fused loss taking the factor.
    pub fn loss(&self, model: &dyn crate::nn::CausalLm, scale: f64) -> Result<Tensor> {
        model.loss_with((&self.inputs).into(), (&self.targets).into(), self.packing.as_ref(), LossScale::Sum(scale))
    }
}

/// One optimizer step's batches for this rank.
pub struct StepBatches {
    pub micro: Vec<MicroBatch>,
    /// Trained targets of the whole step, every micro-batch of every data-parallel rank.
    pub trained: u64,
    /// Real (not padding) tokens of the whole step on every rank: what tokens/s counts.
    pub tokens: u64,
    /// Preference pairs of the whole step on every rank, and their chosen completion tokens:
    /// what the preference losses are averaged over (`ferrolm_nn::objective::preference::Normalizer`).
    pub pairs: u64,
    pub chosen_tokens: u64,
}

impl StepBatches {
    /// The factor every micro-batch's summed loss is multiplied by: `dp / trained_step` (0 for a
    /// step without a trained token). The engine averages the data-parallel ranks' gradients,
    /// so the step's gradient is that of the sum over its trained tokens divided by their
    /// count, each token weighing the same whichever micro-batch or rank holds it.
    pub fn loss_scale(&self, dp: usize) -> f64 {
        match self.trained {
            0 => 0.0,
            n => dp as f64 / n as f64,
        }
    }
}

/// Where the training items come from.
pub enum Batches {
    /// Shuffled windows of token shards, the loader split over the `dp` ranks.
    Windows { loader: DataLoader, dp: usize },
    /// Packed rows in a seeded order, `batch` rows a micro-batch on each of `dp` ranks.
    Rows { data: PackedData, order: EpochOrder, batch: usize, rank: usize, dp: usize },
    /// Preference pairs in a seeded order, `batch` pairs a micro-batch on each of `dp` ranks,
    /// packed into rows of `row_tokens` tokens.
    Pairs { data: PairData, order: EpochOrder, batch: usize, rank: usize, dp: usize },
}

/// Tokenized preference pairs and how a micro-batch packs them.
#[derive(Clone, Debug)]
pub struct PairData {
    pub pairs: std::sync::Arc<Vec<PreferencePair>>,
    /// The length of a packed row (`--max-length`, else `--seq-len`).
    pub row_tokens: usize,
    pub pad_id: u32,
}

/// The completion tokens a packed sequence scores (the first token of a sequence has no
/// predecessor: with an empty prompt the completion's first token is not scored).
pub fn scored_tokens(prompt: &[u32], completion: &[u32]) -> usize {
    if prompt.is_empty() {
        completion.len().saturating_sub(1)
    } else {
        completion.len()
    }
}

impl Batches {
    /// Windows of `loader`, split over `dp` ranks (`DataLoader::for_rank`).
    pub fn windows(loader: DataLoader, dp: usize) -> Batches {
        Batches::Windows { loader, dp }
    }

    /// `data`'s rows, `batch` a micro-batch on each of `dp` ranks, in an order drawn from `seed`.
    pub fn rows(data: PackedData, batch: usize, seed: u64, rank: usize, dp: usize) -> AnyResult<Batches> {
        if batch == 0 || rank >= dp {
            bail!("rank {rank} of {dp} with {batch} rows a micro-batch");
        }
        let order = EpochOrder::new(data.num_rows() as u64, seed, "packed rows (every conversation was dropped)")?;
        Ok(Batches::Rows { data, order, batch, rank, dp })
    }

    /// `data`'s pairs, `batch` pairs a micro-batch on each of `dp` ranks, in an order drawn
    /// from `seed` (the same on every rank: each rank takes its block, as rows are split).
    pub fn pairs(data: PairData, batch: usize, seed: u64, rank: usize, dp: usize) -> AnyResult<Batches> {
        if batch == 0 || rank >= dp {
            bail!("rank {rank} of {dp} with {batch} pairs a micro-batch");
        }
        let order = EpochOrder::new(data.pairs.len() as u64, seed, "preference pairs (every pair was skipped)")?;
        Ok(Batches::Pairs { data, order, batch, rank, dp })
    }

    /// The next step: `accum` micro-batches for this rank, and the step's counts on every rank.
    pub fn next_step(&mut self, accum: usize, device: Device) -> AnyResult<StepBatches> {
        let mut micro = Vec::with_capacity(accum);
        let (mut trained_all, mut tokens_all) = (0u64, 0u64);
        let (mut pairs_all, mut chosen_all) = (0u64, 0u64);
        for _ in 0..accum {
            match self {
                Batches::Windows { loader, dp } => {
                    let b = loader.next_batch();
                    // Every rank draws a batch of this shape, every target trained.
                    let n = (b.batch * b.seq) as u64;
                    trained_all += n * *dp as u64;
                    tokens_all += n * *dp as u64;
                    let (inputs, targets) = crate::train::batch_tensors(&b, device)?;
                    micro.push(MicroBatch { inputs, targets, packing: None, trained: n, pairs: None });
                }
                Batches::Rows { data, order, batch, rank, dp } => {
                    let mut mine = Vec::with_capacity(*batch);
                    for slot in 0..*dp * *batch {
                        // Every rank's rows are counted; this rank keeps its block.
                        let r = data.row(order.next_item() as usize);
                        trained_all += r.trained_tokens() as u64;
                        tokens_all += real_tokens(&r) as u64;
                        if slot / *batch == *rank {
                            mine.push(r);
                        }
                    }
                    micro.push(rows_micro_batch(&mine, device)?);
                }
                Batches::Pairs { data, order, batch, rank, dp } => {
                    let (mut mine, mut indices) = (Vec::with_capacity(*batch), Vec::with_capacity(*batch));
                    for slot in 0..*dp * *batch {
                        let i = order.next_item() as usize;
                        let p = &data.pairs[i];
                        let chosen = scored_tokens(&p.prompt, &p.chosen) as u64;
                        let rejected = scored_tokens(&p.prompt, &p.rejected) as u64;
                        pairs_all += 1;
                        chosen_all += chosen;
                        trained_all += chosen + rejected;
                        tokens_all += (p.chosen_len() + p.rejected_len()) as u64;
                        if slot / *batch == *rank {
                            mine.push(p.clone());
                            indices.push(i);
                        }
                    }
                    let packed = ferrolm_nn::objective::pack_pairs(&mine, data.row_tokens, data.pad_id)?;
                    let (inputs, targets) = packed.tokens(device)?;
                    let packing = Some(packed.packing(device)?);
                    let trained = packed.targets.iter().filter(|&&t| t != IGNORE_INDEX).count() as u64;
                    micro.push(MicroBatch { inputs, targets, packing, trained, pairs: Some(PairMicro { packed, indices }) });
                }
            }
        }
        Ok(StepBatches { micro, trained: trained_all, tokens: tokens_all, pairs: pairs_all, chosen_tokens: chosen_all })
    }

    /// What the run trains on, as `trainer_state.json`'s `trains` records it: `windows` (token
    /// windows: pretraining, or token data), `rows` (packed conversations: chat fine-tuning) or
    /// `pairs` (preference pairs: `dpo`). A checkpoint resumes only into a run of the same kind.
    pub fn kind(&self) -> &'static str {
        match self {
            Batches::Windows { .. } => "windows",
            Batches::Rows { .. } => "rows",
            Batches::Pairs { .. } => "pairs",
        }
    }

    /// Where the order stands (saved with checkpoints; for rows, `num_windows` counts rows).
    pub fn state(&self) -> LoaderState {
        match self {
            Batches::Windows { loader, .. } => loader.state(),
            Batches::Rows { data, order, .. } => order.state(data.seq_len()),
            Batches::Pairs { data, order, .. } => order.state(data.row_tokens),
        }
    }

    /// Continues from a saved `state`; an error when it belongs to other data.
    pub fn restore(&mut self, state: &LoaderState) -> AnyResult<()> {
        match self {
            Batches::Windows { loader, .. } => loader.restore(state)?,
            Batches::Rows { data, order, .. } => order.restore(state, data.seq_len(), "packed rows")?,
            Batches::Pairs { data, order, .. } => order.restore(state, data.row_tokens, "preference pairs")?,
        }
        Ok(())
    }
}

/// A micro-batch of `rows` (each of T tokens).
fn rows_micro_batch(rows: &[PackedRow], device: Device) -> AnyResult<MicroBatch> {
    let (b, t) = (rows.len(), rows.first().map_or(0, |r| r.ids.len()));
    let ids: Vec<i32> = rows.iter().flat_map(|r| r.ids.iter().map(|&i| i as i32)).collect();
    let targets: Vec<i32> = rows.iter().flat_map(|r| r.targets.iter().copied()).collect();
    let trained = rows.iter().map(|r| r.trained_tokens() as u64).sum();
    let packing = match rows.iter().all(is_single) {
        true => None,
        false => {
            let positions: Vec<u32> = rows.iter().flat_map(|r| r.positions.iter().copied()).collect();
            Some(Packing::new(t, &positions, rows.iter().map(|r| r.cu_seqlens.clone()).collect(), device)?)
        }
    };
    Ok(MicroBatch {
        inputs: Tokens::upload(ids, [b, t], device)?,
        targets: Tokens::upload(targets, [b, t], device)?,
        packing,
        trained,
        pairs: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolm_data::chat::{pack, Example, PackOptions};

    /// An example of `len` tokens whose last `trained` tokens are labels.
    fn ex(len: usize, trained: usize, first: u32) -> Example {
        Example { ids: (first..first + len as u32).collect(), trained: (0..len).map(|j| j + trained >= len && j > 0).collect() }
    }

    #[test]
    fn counts_and_the_single_conversation_fast_path() {
        let data =
            pack(vec![ex(5, 4, 10), ex(2, 1, 20), ex(6, 3, 30)], &PackOptions { seq_len: 8, pack: true, truncate: false, pad_id: 0 })
                .unwrap();
        // Best fit decreasing: [6, 2] and [5, padding 3].
        let (two, one) = (data.row(0), data.row(1));
        assert_eq!((real_tokens(&two), two.trained_tokens(), is_single(&two)), (8, 4, false));
        assert_eq!((real_tokens(&one), one.trained_tokens(), is_single(&one)), (5, 4, true));
        let mb = rows_micro_batch(std::slice::from_ref(&one), Device::Cpu).unwrap();
        assert!(mb.packing.is_none() && mb.trained == 4);
        let mb = rows_micro_batch(&[one, two], Device::Cpu).unwrap();
        assert!(mb.packing.is_some() && mb.trained == 8);
    }

    /// Every rank sees the step's counts; rank r's micro-batch k is the block the one-rank
    /// loader of the same global batch gives; the trained tokens of every micro-batch on every
    /// rank, times the scale, are dp (the engine divides by dp).
    #[test]
    fn ranks_split_each_micro_batch_and_share_the_step_counts() {
        let examples: Vec<Example> = (1..=8).map(|l| ex(l, l - 1, 100 * l as u32)).collect();
        let data = pack(examples, &PackOptions { seq_len: 8, pack: false, truncate: false, pad_id: 0 }).unwrap();
        let mut one = Batches::rows(data.clone(), 4, 5, 0, 1).unwrap();
        let whole = one.next_step(1, Device::Cpu).unwrap();
        let ids = whole.micro[0].inputs.host().unwrap().to_vec();
        let mut total = 0.0;
        for rank in 0..2 {
            let mut b = Batches::rows(data.clone(), 1, 5, rank, 2).unwrap();
            let s = b.next_step(2, Device::Cpu).unwrap();
            assert_eq!((s.trained, s.tokens), (whole.trained, whole.tokens));
            total += s.micro.iter().map(|m| m.trained as f64 * s.loss_scale(2)).sum::<f64>();
            for k in 0..2 {
                let i = 2 * k + rank;
                assert_eq!(s.micro[k].inputs.host().unwrap(), &ids[i * 8..i * 8 + 8], "rank {rank} micro {k}");
            }
        }
        assert!((total - 2.0).abs() < 1e-12, "{total}");
    }
}

//! The objectives: what turns the model's final hidden states into a loss, owning the head. The
//! model returns hidden states (`Llama::final_hidden`); the head and its loss are one op, fused
//! and chunked (`ferrolm_ops::head_loss`, `ferrolm_ops::head_logprobs`), so the logits never
//! exist whole, for any objective.
//!
//! - `TokenCrossEntropy`: next-token cross-entropy (pretraining, SFT), the fused loss with its
//!   gradients made in the forward.
//! - `SequenceLogProbs`: per-sequence sums of completion-token log-probs of a packed batch, and
//!   their token counts, differentiable: the per-row head, then a segment sum. The preference
//!   losses (`preference`) are small functions of these sums.
//! - `pack_pairs`: a batch of `PreferencePair`s as packed rows (prompt + chosen and prompt +
//!   rejected of each pair, labels on the completion tokens only) for one forward with
//!   per-sequence attention.
//!
//! A next objective (KTO, ORPO, a reward model, GRPO's policy loss) is a small function over
//! `SequenceLogProbs`' sums, as Liger's chunked_loss puts each on one base.
pub mod preference;

use crate::llama::Packing;
use crate::module::{HeadLoss, HeadOp};
use ferrolm_data::preference::PreferencePair;
use ferrolm_ops::{LossChunks, LossScale, Tokens};
use ferrolm_tensor::{bail, DType, Device, Result, Tensor};

/// The target of tokens that are not scored (transformers' -100).
pub const IGNORE_INDEX: i32 = -100;

/// Next-token cross-entropy over the trained tokens, scaled as `scale` says (the mean, or the
/// sum times the optimizer step's factor), chunked as `chunks` says.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenCrossEntropy {
    pub ignore_index: i32,
    pub scale: LossScale,
    pub chunks: LossChunks,
}

impl TokenCrossEntropy {
    /// The loss (a scalar) of hidden states x (B, T, C) against targets (B, T) through the head
    /// `op` with weight `w` (vocab, hidden).
    pub fn loss(&self, op: &dyn HeadOp, w: &Tensor, x: &Tensor, targets: &Tokens) -> Result<Tensor> {
        op.loss(x, w, targets, &HeadLoss { ignore_index: self.ignore_index, scale: self.scale, chunks: self.chunks })
    }
}

/// Which sequence each token of a packed batch is scored for: `of_token[i]` is the index of the
/// sequence token i's target belongs to (`None`: padding, or a row the sequences do not use).
/// Only tokens whose target is not ignored count (the completion tokens).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceMap {
    pub of_token: Vec<Option<u32>>,
    pub sequences: usize,
}

/// Per-sequence log-probs of a batch: `sums` (sequences; f32, f64 for f64 models) is
/// differentiable; `tokens[s]` the completion tokens summed for sequence s.
#[derive(Clone)]
pub struct SequenceSums {
    pub sums: Tensor,
    pub tokens: Vec<usize>,
}

/// Per-sequence sums of the completion tokens' log-probs under the head, chunked as `chunks`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SequenceLogProbs {
    pub chunks: LossChunks,
}

impl SequenceLogProbs {
    /// x (B, T, C) the final hidden states, `targets` (B, T) the next token where scored (else
    /// -100), `seqs` the sequence of each token. -> each sequence's Σ log p(target) and count.
    pub fn sums(&self, op: &dyn HeadOp, w: &Tensor, x: &Tensor, targets: &Tokens, seqs: &SequenceMap) -> Result<SequenceSums> {
        let n = targets.tensor().numel();
        if seqs.of_token.len() != n {
            bail!("SequenceLogProbs", "{} tokens in the sequence map, {n} targets", seqs.of_token.len());
        }
        let o = HeadLoss { ignore_index: IGNORE_INDEX, scale: LossScale::Mean, chunks: self.chunks };
        let lp = op.logprobs(x, w, targets, &o)?; // (n)
        let host = targets.host_ids()?;
        let s = seqs.sequences;
        // The segment sum as a (sequences, n) 0/1 matrix times the log-probs: differentiable,
        // one GEMM; only scored tokens are in it.
        let mut m = vec![0f32; s * n];
        let mut tokens = vec![0usize; s];
        for (i, (q, &t)) in seqs.of_token.iter().zip(host.iter()).enumerate() {
            if let (Some(q), true) = (q, t != IGNORE_INDEX) {
                let q = *q as usize;
                if q >= s {
                    bail!("SequenceLogProbs", "token {i} is mapped to sequence {q} of {s}");
                }
                m[q * n + i] = 1.0;
                tokens[q] += 1;
            }
        }
        let m = Tensor::from_vec(m, [s, n], Device::Cpu)?.to_dtype(lp.dtype())?.to_device(lp.device())?;
        let sums = m.matmul(&lp.reshape([n, 1])?)?.reshape([s])?;
        Ok(SequenceSums { sums, tokens })
    }
}

/// A batch of preference pairs as packed rows: ids, targets (the next token on completion
/// tokens, else -100), positions restarting at 0 in each sequence and each row's `cu_seqlens`
/// (trailing padding its own last segment). Sequence i is pair i's prompt + chosen, sequence
/// pairs + i its prompt + rejected (TRL's concatenated [chosen; rejected] order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedPairs {
    pub rows: usize,
    pub row_tokens: usize,
    pub pairs: usize,
    pub ids: Vec<u32>,
    pub targets: Vec<i32>,
    pub positions: Vec<u32>,
    pub cu_seqlens: Vec<Vec<u32>>,
    pub sequences: SequenceMap,
}

impl PackedPairs {
    /// The ids and targets (rows, row_tokens) on `device`, with their host copies.
    pub fn tokens(&self, device: Device) -> Result<(Tokens, Tokens)> {
        let ids = self.ids.iter().map(|&i| i as i32).collect();
        let shape = [self.rows, self.row_tokens];
        Ok((Tokens::upload(ids, shape, device)?, Tokens::upload(self.targets.clone(), shape, device)?))
    }

    /// The per-sequence attention of the rows.
    pub fn packing(&self, device: Device) -> Result<Packing> {
        Packing::new(self.row_tokens, &self.positions, self.cu_seqlens.clone(), device)
    }
}

/// Packs `pairs` into rows of `row_tokens` tokens, sequences in order (every chosen, then every
/// rejected), each into the current row while it fits, else a new one; padding is `pad_id`. A
/// sequence longer than a row, or a pair with an empty completion, is an error naming the pair.
pub fn pack_pairs(pairs: &[PreferencePair], row_tokens: usize, pad_id: u32) -> Result<PackedPairs> {
    let p = pairs.len();
    let seqs: Vec<(usize, &[u32], &[u32])> = (0..2 * p)
        .map(|s| {
            let pr = &pairs[s % p.max(1)];
            (s % p.max(1), pr.prompt.as_slice(), if s < p { pr.chosen.as_slice() } else { pr.rejected.as_slice() })
        })
        .collect();
    for (s, &(i, prompt, comp)) in seqs.iter().enumerate() {
        let what = if s < p { "chosen" } else { "rejected" };
        if comp.is_empty() {
            bail!("pack_pairs", "pair {i}: the {what} completion is empty");
        }
        if prompt.len() + comp.len() > row_tokens {
            bail!("pack_pairs", "pair {i}: prompt + {what} is {} tokens, longer than a row of {row_tokens}", prompt.len() + comp.len());
        }
    }
    let (mut ids, mut targets, mut positions, mut of_token) = (vec![], vec![], vec![], vec![]);
    let mut cu: Vec<Vec<u32>> = vec![];
    let mut used = row_tokens; // no row open yet
    for (s, &(_, prompt, comp)) in seqs.iter().enumerate() {
        let len = prompt.len() + comp.len();
        if used + len > row_tokens {
            if !cu.is_empty() {
                pad(&mut ids, &mut targets, &mut positions, &mut of_token, cu.last_mut().expect("a row"), row_tokens - used, pad_id);
            }
            cu.push(vec![0]);
            used = 0;
        }
        let whole: Vec<u32> = prompt.iter().chain(comp).copied().collect();
        for (j, &t) in whole.iter().enumerate() {
            ids.push(t);
            positions.push(j as u32);
            of_token.push(Some(s as u32));
            // Position j predicts token j + 1 when that is a completion token.
            targets.push(match whole.get(j + 1) {
                Some(&next) if j + 1 >= prompt.len() => next as i32,
                _ => IGNORE_INDEX,
            });
        }
        used += len;
        cu.last_mut().expect("a row").push(used as u32);
    }
    if let Some(last) = cu.last_mut() {
        pad(&mut ids, &mut targets, &mut positions, &mut of_token, last, row_tokens - used, pad_id);
    }
    Ok(PackedPairs {
        rows: cu.len(),
        row_tokens,
        pairs: p,
        ids,
        targets,
        positions,
        cu_seqlens: cu,
        sequences: SequenceMap { of_token, sequences: 2 * p },
    })
}

fn pad(ids: &mut Vec<u32>, tg: &mut Vec<i32>, pos: &mut Vec<u32>, of: &mut Vec<Option<u32>>, cu: &mut Vec<u32>, n: usize, pad_id: u32) {
    if n == 0 {
        return;
    }
    ids.extend(std::iter::repeat_n(pad_id, n));
    tg.extend(std::iter::repeat_n(IGNORE_INDEX, n));
    pos.extend(0..n as u32);
    of.extend(std::iter::repeat_n(None, n));
    let end = cu.last().copied().unwrap_or(0) + n as u32;
    cu.push(end);
}

/// The policy's (or reference's) chosen and rejected sums of a packed batch of pairs.
#[derive(Clone)]
pub struct PairLogProbs {
    /// (pairs), differentiable for the policy.
    pub chosen: Tensor,
    pub rejected: Tensor,
    pub chosen_tokens: Vec<usize>,
    pub rejected_tokens: Vec<usize>,
}

impl PairLogProbs {
    /// Splits `SequenceSums` of a `PackedPairs` batch (chosen first, then rejected).
    pub fn from_sums(s: &SequenceSums, pairs: usize) -> Result<PairLogProbs> {
        if s.tokens.len() != 2 * pairs {
            bail!("PairLogProbs", "{} sequences for {pairs} pairs", s.tokens.len());
        }
        Ok(PairLogProbs {
            chosen: s.sums.narrow(0, 0, pairs)?,
            rejected: s.sums.narrow(0, pairs, pairs)?,
            chosen_tokens: s.tokens[..pairs].to_vec(),
            rejected_tokens: s.tokens[pairs..].to_vec(),
        })
    }
}

/// The `PairLogProbs` of `model` on a packed batch: one forward of every chosen and rejected
/// sequence with per-sequence attention, the head per row (chunked as the model's
/// `loss_chunks`). For a reference, call it under `no_grad` (and, for the base of a LoRA
/// policy, under `crate::lora::adapters_off()`).
pub fn pair_logprobs(model: &dyn crate::CausalLm, batch: &PackedPairs) -> Result<PairLogProbs> {
    let dev = model.device();
    let (ids, targets) = batch.tokens(dev)?;
    let x = model.hidden_states(ids, Some(&batch.packing(dev)?))?;
    let (head_op, head_weight, chunks) = model.head();
    let obj = SequenceLogProbs { chunks };
    let s = obj.sums(head_op, head_weight, &x, &targets, &batch.sequences)?;
    PairLogProbs::from_sums(&s, batch.pairs)
}

/// `t`'s values on the host in f64 (a reference's log-probs, a metric).
pub fn host_values(t: &Tensor) -> Result<Vec<f64>> {
    match t.dtype() {
        DType::F64 | DType::F32 | DType::BF16 => t.to_vec_f64(),
        other => bail!("host_values", "expected float values, got {other}"),
    }
}

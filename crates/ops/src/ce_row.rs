//! The CPU's row math of softmax cross-entropy, shared by `cross_entropy` (logits whole) and
//! `head_loss` (logits a chunk at a time), as kernels/ce_row.cuh is on the GPU: the log-sum-exp
//! of a row (max and sum of exp in 16 lanes, vectorised), and the gradient (softmax − onehot) · sc
//! of a row into another buffer or in place. One code for both ops, so that the fused head's
//! loss and gradient are bit for bit the unfused ones.
use ferrolm_tensor::cpu::simd::{self, FastExp};
use ferrolm_tensor::multiversion;

multiversion! {
    /// log-sum-exp of a row.
    pub(crate) fn row_lse[T: FastExp](row: &[T]) -> T {
        let m = simd::max(row);
        m + simd::sum_map(row, |x| (x - m).fast_exp()).ln()
    }
}

multiversion! {
    /// One row of the fused form into `d`: d = exp(x − max) summed in `row_lse`'s lanes (so the
    /// lse is bit for bit the forward's), then d = d / sum · sc and d[target] −= sc. -> the lse.
    pub(crate) fn row_lse_grad[T: FastExp](d: &mut [T], x: &[T], target: usize, sc: T) -> T {
        let m = simd::max(x);
        let l = simd::map_into_sum(d, x, |v| (v - m).fast_exp());
        let f = sc / l;
        d.iter_mut().for_each(|p| *p = *p * f);
        d[target] = d[target] - sc;
        m + l.ln()
    }
}

multiversion! {
    /// `row_lse_grad` in place over the row: the same sums in the same lanes (the chunked head's
    /// gradient overwrites its logits). -> the lse.
    pub(crate) fn row_lse_grad_in_place[T: FastExp](x: &mut [T], target: usize, sc: T) -> T {
        let m = simd::max(x);
        let l = simd::map_in_place_sum(x, |v| (v - m).fast_exp());
        let f = sc / l;
        x.iter_mut().for_each(|p| *p = *p * f);
        x[target] = x[target] - sc;
        m + l.ln()
    }
}

multiversion! {
    /// d = exp(x − lse) · sc.
    pub(crate) fn softmax_row[T: FastExp](d: &mut [T], x: &[T], lse: T, sc: T) {
        for (o, &xv) in d.iter_mut().zip(x) {
            *o = (xv - lse).fast_exp() * sc;
        }
    }
}

multiversion! {
    /// x = exp(x − lse) · sc in place (the vocabulary-parallel head, its lse over every rank).
    pub(crate) fn softmax_row_in_place[T: FastExp](x: &mut [T], lse: T, sc: T) {
        for p in x.iter_mut() {
            *p = (*p - lse).fast_exp() * sc;
        }
    }
}

multiversion! {
    /// The sum of exp(x − m) over a row (a rank's columns, under tensor parallelism).
    pub(crate) fn row_sumexp[T: FastExp](row: &[T], m: T) -> T {
        simd::sum_map(row, |x| (x - m).fast_exp())
    }
}

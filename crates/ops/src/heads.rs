//! The two memory orders of a (b, heads, t, d) tensor that attention and RoPE read and write in
//! place. A projection writes (b, t, heads * d); split into heads by a reshape and
//! permute(0, 2, 1, 3) it is a (b, heads, t, d) view whose memory is (b, t, heads, d): that is
//! `TimeMajor`. Taking it as it is, instead of copying it to the head-major order first (and the
//! output back before the next projection), saves four copies of the activations per layer in the
//! forward and four in the backward. The kernels' side is `HEAD_MAJOR` / `TIME_MAJOR` in
//! kernels/constants.cuh.
use ferrolm_cuda::consts::{HEAD_MAJOR, TIME_MAJOR};
use ferrolm_tensor::{Layout, Result, Storage, Tensor};

/// (b, heads, t, d) <-> (b, t, heads, d); its own inverse.
const SWAP_HEADS_TIME: [usize; 4] = [0, 2, 1, 3];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadLayout {
    /// (b, heads, t, d) contiguous: a head's rows are adjacent.
    HeadMajor,
    /// (b, t, heads, d) contiguous, seen as (b, heads, t, d) through permute(0, 2, 1, 3): a
    /// head's rows are heads * d elements apart.
    TimeMajor,
}

impl HeadLayout {
    /// The view `l` (rank 4, (b, heads, t, d)) in memory order: itself when head-major, its
    /// (b, t, heads, d) reading when time-major.
    pub fn memory_order(self, l: &Layout) -> Layout {
        match self {
            HeadLayout::HeadMajor => l.clone(),
            HeadLayout::TimeMajor => l.permuted(&SWAP_HEADS_TIME),
        }
    }

    /// True when the rank-4 view `l` is dense in this layout.
    pub fn fits(self, l: &Layout) -> bool {
        l.dims().len() == 4 && self.memory_order(l).is_contiguous()
    }

    /// The layout that every view of `ls` is dense in: head-major where both describe them (one
    /// head, or one position), `None` where no one layout does.
    pub fn common(ls: &[&Layout]) -> Option<HeadLayout> {
        [HeadLayout::HeadMajor, HeadLayout::TimeMajor].into_iter().find(|h| ls.iter().all(|l| h.fits(l)))
    }

    /// The kernels' code for this layout (kernels/constants.cuh).
    pub(crate) fn code(self) -> i32 {
        match self {
            HeadLayout::HeadMajor => HEAD_MAJOR,
            HeadLayout::TimeMajor => TIME_MAJOR,
        }
    }

    /// Rows of a head between its consecutive positions: 1, or the head count.
    pub(crate) fn inner(self, heads: usize) -> usize {
        match self {
            HeadLayout::HeadMajor => 1,
            HeadLayout::TimeMajor => heads,
        }
    }

    /// `x` (b, heads, t, d) dense in this layout: itself when it is, else a copy.
    pub fn arrange(self, x: &Tensor) -> Result<Tensor> {
        if self.fits(x.layout()) {
            return Ok(x.clone());
        }
        match self {
            HeadLayout::HeadMajor => x.contiguous(),
            HeadLayout::TimeMajor => x.permute(&SWAP_HEADS_TIME)?.contiguous()?.permute(&SWAP_HEADS_TIME),
        }
    }

    /// The (b, heads, t, d) tensor over `s`, a dense storage written in this layout.
    pub fn tensor(self, s: Storage, [b, heads, t, d]: [usize; 4]) -> Result<Tensor> {
        match self {
            HeadLayout::HeadMajor => Tensor::new(s, [b, heads, t, d]),
            HeadLayout::TimeMajor => Tensor::new(s, [b, t, heads, d])?.permute(&SWAP_HEADS_TIME),
        }
    }
}

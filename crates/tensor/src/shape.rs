//! Shapes, strides and the view layout (shape + strides + offset) shared by every backend.
use crate::{bail, Result};
use std::fmt;

#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    pub fn contiguous_strides(&self) -> Vec<usize> {
        let mut s = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
        }
        s
    }
    /// Numpy-style broadcast of two shapes.
    #[allow(clippy::needless_range_loop)] // i indexes three arrays with different offsets
    pub fn broadcast(op: &str, a: &Shape, b: &Shape) -> Result<Shape> {
        let r = a.rank().max(b.rank());
        let mut out = vec![0; r];
        for i in 0..r {
            let da = if i + a.rank() >= r { a.0[i + a.rank() - r] } else { 1 };
            let db = if i + b.rank() >= r { b.0[i + b.rank() - r] } else { 1 };
            out[i] = match (da, db) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => bail!(op, "shapes {a:?} and {b:?} do not broadcast"),
            };
        }
        Ok(Shape(out))
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape(d.to_vec())
    }
}
impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape(d)
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape(d.to_vec())
    }
}
impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(vec![])
    }
}

/// A view into a storage: element `idx` lives at `offset + sum(idx[i] * strides[i])`.
/// Strides of 0 express broadcasting without copying.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub shape: Shape,
    pub strides: Vec<usize>,
    pub offset: usize,
}

impl Layout {
    pub fn contiguous(shape: Shape) -> Self {
        let strides = shape.contiguous_strides();
        Layout { shape, strides, offset: 0 }
    }
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }
    /// The same elements with dims reordered: dim i of the result is dim `perm[i]` of this
    /// view (`perm` a permutation of the dims, which the caller checked).
    pub fn permuted(&self, perm: &[usize]) -> Layout {
        Layout {
            shape: perm.iter().map(|&p| self.shape.0[p]).collect::<Vec<_>>().into(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }
    /// True when the elements are exactly `offset .. offset + numel` in row-major order.
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1;
        for (&d, &s) in self.shape.0.iter().zip(&self.strides).rev() {
            if d != 1 && s != expect {
                return false;
            }
            expect *= d;
        }
        true
    }
    /// Storage index of every element, in row-major order of the view.
    pub fn indices(&self) -> StridedIter {
        StridedIter::new(self, 0, self.numel())
    }
    /// Storage indices of elements `start .. start + len` (row-major order of the view), so
    /// disjoint ranges can be walked on different threads.
    pub fn indices_range(&self, start: usize, len: usize) -> StridedIter {
        StridedIter::new(self, start, len.min(self.numel().saturating_sub(start)))
    }
    /// Layout broadcast to `target` (which must be a valid broadcast of this shape).
    #[allow(clippy::needless_range_loop)] // i indexes the target and, shifted by the padding, the source
    pub fn broadcast_to(&self, op: &str, target: &Shape) -> Result<Layout> {
        let r = target.rank();
        if self.shape.rank() > r {
            bail!(op, "cannot broadcast {:?} to {:?}", self.shape, target);
        }
        let pad = r - self.shape.rank();
        let mut strides = vec![0; r];
        for i in 0..r {
            if i < pad {
                continue;
            }
            let d = self.shape.0[i - pad];
            if d == target.0[i] {
                strides[i] = self.strides[i - pad];
            } else if d != 1 {
                bail!(op, "cannot broadcast {:?} to {:?}", self.shape, target);
            }
        }
        Ok(Layout { shape: target.clone(), strides, offset: self.offset })
    }
}

/// Iterates storage indices of a strided view in row-major order, with a fast path per row.
pub struct StridedIter {
    dims: Vec<usize>,
    strides: Vec<usize>,
    idx: Vec<usize>,
    pos: usize,
    left: usize,
}

impl StridedIter {
    fn new(l: &Layout, start: usize, len: usize) -> Self {
        let dims = l.shape.0.clone();
        let mut idx = vec![0; dims.len()];
        let (mut rest, mut pos) = (start, l.offset);
        for i in (0..dims.len()).rev() {
            if dims[i] == 0 {
                break;
            }
            idx[i] = rest % dims[i];
            rest /= dims[i];
            pos += idx[i] * l.strides[i];
        }
        StridedIter { dims, strides: l.strides.clone(), idx, pos, left: len }
    }
}

impl Iterator for StridedIter {
    type Item = usize;
    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let cur = self.pos;
        for i in (0..self.dims.len()).rev() {
            self.idx[i] += 1;
            self.pos += self.strides[i];
            if self.idx[i] < self.dims[i] {
                break;
            }
            self.pos -= self.strides[i] * self.dims[i];
            self.idx[i] = 0;
        }
        Some(cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any range of a strided walk equals the same slice of the full walk.
    #[test]
    fn indices_range_matches_full_walk() {
        let base = Layout::contiguous(Shape(vec![3, 1, 4, 5]));
        let views = [
            base.clone(),
            Layout { shape: Shape(vec![5, 4, 3]), strides: vec![1, 5, 20], offset: 2 },
            base.broadcast_to("t", &Shape(vec![2, 3, 7, 4, 5])).unwrap(),
        ];
        for l in &views {
            let full: Vec<usize> = l.indices().collect();
            for start in [0, 1, 7, full.len() / 2, full.len() - 1, full.len()] {
                for len in [0, 1, 9, 1000] {
                    let part: Vec<usize> = l.indices_range(start, len).collect();
                    assert_eq!(part, full[start..(start + len).min(full.len())], "start {start} len {len} of {l:?}");
                }
            }
        }
    }
}

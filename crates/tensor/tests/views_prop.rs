//! Property tests for strided views: random chains of permute / narrow / transpose /
//! broadcast_as / reshape-after-contiguous on random rank 1-4 shapes, checked against the same
//! index arithmetic done on a plain copied `Vec`, plus storage sharing and gradient routing.
use ferrolm_tensor::{DType, Device, Tensor};
use proptest::prelude::*;

/// Reference: a dense row-major array whose elements are indices into the base tensor.
#[derive(Clone, Debug)]
struct Dense {
    shape: Vec<usize>,
    idx: Vec<usize>,
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Multi-index of flat position `f` in `shape`.
fn unravel(mut f: usize, shape: &[usize]) -> Vec<usize> {
    let mut out = vec![0; shape.len()];
    for i in (0..shape.len()).rev() {
        out[i] = f % shape[i];
        f /= shape[i];
    }
    out
}

impl Dense {
    fn map(&self, shape: Vec<usize>, src: impl Fn(&[usize]) -> Vec<usize>) -> Dense {
        let n: usize = shape.iter().product();
        let st = strides(&self.shape);
        let idx = (0..n)
            .map(|f| {
                let i = src(&unravel(f, &shape));
                self.idx[i.iter().zip(&st).map(|(a, b)| a * b).sum::<usize>()]
            })
            .collect();
        Dense { shape, idx }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Permute(Vec<usize>),
    Narrow {
        dim: usize,
        start: usize,
        len: usize,
    },
    Transpose(usize, usize),
    /// New leading dim of size `lead` and every size-1 dim expanded to `to`.
    Broadcast {
        lead: usize,
        to: usize,
    },
    /// contiguous() then reshape to the dims in reverse order / flattened / split.
    Reshape(u8),
}

/// Draws an op valid for `shape` from the random numbers `r`.
fn pick(shape: &[usize], r: &[usize; 4]) -> Op {
    let rank = shape.len();
    match r[0] % 5 {
        0 => {
            let mut p: Vec<usize> = (0..rank).collect();
            // Fisher-Yates with r as entropy
            for i in (1..rank).rev() {
                p.swap(i, (r[1] / (i + 1) + r[2]) % (i + 1));
            }
            Op::Permute(p)
        }
        1 => {
            let dim = r[1] % rank;
            let start = r[2] % shape[dim];
            let len = 1 + r[3] % (shape[dim] - start);
            Op::Narrow { dim, start, len }
        }
        2 => Op::Transpose(r[1] % rank, r[2] % rank),
        3 if rank < 4 => Op::Broadcast { lead: 1 + r[1] % 3, to: 1 + r[2] % 3 },
        _ => Op::Reshape((r[1] % 3) as u8),
    }
}

fn apply(t: &Tensor, d: &Dense, op: &Op) -> (Tensor, Dense) {
    match op {
        Op::Permute(p) => {
            let shape = p.iter().map(|&i| d.shape[i]).collect();
            let dd = d.map(shape, |ix| {
                let mut s = vec![0; p.len()];
                for (k, &pi) in p.iter().enumerate() {
                    s[pi] = ix[k];
                }
                s
            });
            (t.permute(p).unwrap(), dd)
        }
        Op::Narrow { dim, start, len } => {
            let mut shape = d.shape.clone();
            shape[*dim] = *len;
            let dd = d.map(shape, |ix| {
                let mut s = ix.to_vec();
                s[*dim] += start;
                s
            });
            (t.narrow(*dim, *start, *len).unwrap(), dd)
        }
        Op::Transpose(a, b) => {
            let mut shape = d.shape.clone();
            shape.swap(*a, *b);
            let dd = d.map(shape, |ix| {
                let mut s = ix.to_vec();
                s.swap(*a, *b);
                s
            });
            (t.transpose(*a, *b).unwrap(), dd)
        }
        Op::Broadcast { lead, to } => {
            let mut shape = vec![*lead];
            shape.extend(d.shape.iter().map(|&x| if x == 1 { *to } else { x }));
            let old = d.shape.clone();
            let dd = d.map(shape.clone(), |ix| ix[1..].iter().zip(&old).map(|(&i, &o)| if o == 1 { 0 } else { i }).collect());
            (t.broadcast_as(shape).unwrap(), dd)
        }
        Op::Reshape(kind) => {
            let n: usize = d.shape.iter().product();
            let shape: Vec<usize> = match kind {
                0 => d.shape.iter().rev().cloned().collect(),
                1 => vec![n],
                _ => {
                    // split the first dim that has a factor, else move a 1 in front
                    let mut s = d.shape.clone();
                    match s.iter().position(|&x| x % 2 == 0) {
                        Some(i) if s.len() < 4 => {
                            s[i] /= 2;
                            s.insert(i, 2);
                        }
                        _ if s.len() < 4 => s.insert(0, 1),
                        _ => s = vec![n],
                    }
                    s
                }
            };
            let c = t.contiguous().unwrap();
            assert!(c.is_contiguous());
            if t.is_contiguous() {
                assert!(c.shares_storage(t), "contiguous() of a contiguous view must not copy");
            } else {
                assert!(!c.shares_storage(t), "contiguous() of a non-contiguous view must copy");
            }
            let r = c.reshape(shape.clone()).unwrap();
            assert!(r.shares_storage(&c), "reshape of a contiguous tensor is a view");
            // Same row-major element order: the index list carries over unchanged.
            (r, Dense { shape, idx: d.idx.clone() })
        }
    }
}

fn shape_strategy() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..5, 1..=4)
}

fn ops_strategy() -> impl Strategy<Value = Vec<[usize; 4]>> {
    prop::collection::vec(prop::array::uniform4(0usize..1000), 1..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn view_chains_match_index_math(shape in shape_strategy(), draws in ops_strategy()) {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
        let base = Tensor::from_vec(data.clone(), shape.clone(), Device::Cpu).unwrap();
        let mut t = base.clone();
        let mut d = Dense { shape: shape.clone(), idx: (0..n).collect() };
        let mut copied = false;
        for r in &draws {
            let op = pick(&d.shape, r);
            let (t2, d2) = apply(&t, &d, &op);
            if matches!(op, Op::Reshape(_)) && !t.is_contiguous() {
                copied = true;
            }
            t = t2;
            d = d2;
            prop_assert_eq!(t.dims(), &d.shape[..], "shape after {:?}", op);
            let got = t.to_vec::<f32>().unwrap();
            let want: Vec<f32> = d.idx.iter().map(|&i| data[i]).collect();
            prop_assert_eq!(got, want, "values after {:?}", op);
            prop_assert_eq!(t.shares_storage(&base), !copied, "storage sharing after {:?}", op);
        }
        // contiguous() agrees with to_vec and is contiguous
        let c = t.contiguous().unwrap();
        prop_assert!(c.is_contiguous());
        prop_assert_eq!(c.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
    }

    /// Backward through a view chain scatters (adds) each view element's weight into the base
    /// element it reads, which the index reference says directly.
    #[test]
    fn view_chain_gradients_route_to_base(shape in shape_strategy(), draws in ops_strategy()) {
        let n: usize = shape.iter().product();
        let base = Tensor::from_vec((0..n).map(|i| i as f64).collect::<Vec<_>>(), shape.clone(), Device::Cpu).unwrap();
        base.set_requires_grad(true).unwrap();
        let mut t = base.clone();
        let mut d = Dense { shape: shape.clone(), idx: (0..n).collect() };
        for r in &draws {
            let op = pick(&d.shape, r);
            let (t2, d2) = apply(&t, &d, &op);
            t = t2;
            d = d2;
        }
        let m = d.idx.len();
        let w: Vec<f64> = (0..m).map(|i| ((i * 7919) % 13) as f64 - 6.0).collect();
        let wt = Tensor::from_vec(w.clone(), d.shape.clone(), Device::Cpu).unwrap();
        t.mul(&wt).unwrap().sum_all().unwrap().backward().unwrap();
        let mut want = vec![0.0; n];
        for (k, &i) in d.idx.iter().enumerate() {
            want[i] += w[k];
        }
        prop_assert_eq!(base.grad().unwrap().to_vec::<f64>().unwrap(), want);
    }

    /// Element-wise ops on arbitrary strided views equal the same op on contiguous copies.
    #[test]
    fn strided_elementwise_and_reduce(shape in shape_strategy(), draws in ops_strategy(), dimsel in 0usize..16) {
        let n: usize = shape.iter().product();
        let base = Tensor::from_vec((0..n).map(|i| (i as f64 * 0.37).sin()).collect::<Vec<_>>(), shape.clone(), Device::Cpu).unwrap();
        let mut t = base.clone();
        let mut d = Dense { shape, idx: (0..n).collect() };
        for r in &draws {
            let op = pick(&d.shape, r);
            let (t2, d2) = apply(&t, &d, &op);
            t = t2;
            d = d2;
        }
        let c = t.contiguous().unwrap();
        prop_assert_eq!(t.exp().unwrap().to_vec::<f64>().unwrap(), c.exp().unwrap().to_vec::<f64>().unwrap());
        let rev: Vec<usize> = (0..t.rank()).rev().collect();
        prop_assert_eq!(t.mul(&t.permute(&rev).unwrap().permute(&rev).unwrap()).unwrap().to_vec::<f64>().unwrap(), c.sqr().unwrap().to_vec::<f64>().unwrap());
        let dims: Vec<usize> = (0..t.rank()).filter(|i| dimsel & (1 << i) != 0).collect();
        let a = t.sum(&dims, true).unwrap().to_vec::<f64>().unwrap();
        let b = c.sum(&dims, true).unwrap().to_vec::<f64>().unwrap();
        prop_assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            prop_assert!((x - y).abs() < 1e-12);
        }
        let a = t.max(&dims, false).unwrap().to_vec::<f64>().unwrap();
        prop_assert_eq!(a, c.max(&dims, false).unwrap().to_vec::<f64>().unwrap());
        let _ = DType::F64;
    }
}

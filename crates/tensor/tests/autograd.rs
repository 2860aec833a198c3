//! Autograd behaviour: gradient hooks (once per backward, in backward order, after
//! accumulation), gradient accumulation across backward calls, no_grad and detach.
mod common;
use common::*;
use ferrolm_tensor::{is_grad_enabled, no_grad, set_grad_enabled, DType, Rng, Tensor};
use std::sync::{Arc, Mutex};

type Log = Arc<Mutex<Vec<(String, Vec<f64>)>>>;

fn hook(p: &Tensor, name: &str, log: &Log) {
    let (name, log) = (name.to_string(), log.clone());
    p.register_hook(move |g| log.lock().unwrap().push((name.clone(), g.to_vec_f64().unwrap())));
}

fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    x.matmul(&w.t().unwrap()).unwrap().add(b).unwrap()
}

/// Three linear layers (tanh-free: silu between) with parameters created in `order`.
fn three_layers(order: [usize; 3]) -> (Vec<(Tensor, Tensor)>, Tensor) {
    let g = &mut Rng::new(7);
    let mut layers: Vec<Option<(Tensor, Tensor)>> = vec![None, None, None];
    for &l in &order {
        layers[l] = Some((param(&randn(&[5, 5], g)), param(&randn(&[5], g))));
    }
    let x = randn(&[3, 5], g);
    (layers.into_iter().map(Option::unwrap).collect(), x)
}

fn forward(layers: &[(Tensor, Tensor)], x: &Tensor) -> Tensor {
    let mut h = x.clone();
    for (i, (w, b)) in layers.iter().enumerate() {
        h = linear(&h, w, b);
        if i + 1 < layers.len() {
            h = h.silu().unwrap();
        }
    }
    h.sqr().unwrap().mean_all().unwrap()
}

#[test]
fn hooks_fire_once_in_backward_order() {
    // Same result whether the first or the last layer's parameters were created first:
    // the order is the backward's, not creation's.
    for order in [[0, 1, 2], [2, 1, 0], [1, 2, 0]] {
        let (layers, x) = three_layers(order);
        let log: Log = Arc::default();
        for (i, (w, b)) in layers.iter().enumerate() {
            hook(w, &format!("w{i}"), &log);
            hook(b, &format!("b{i}"), &log);
        }
        // The last layer's hook runs while backward is still going: the first layer has no
        // gradient yet at that moment.
        let (w0, seen) = (layers[0].0.clone(), Arc::new(Mutex::new(None)));
        let s2 = seen.clone();
        layers[2].0.register_hook(move |_| *s2.lock().unwrap() = Some(w0.grad().is_none()));
        forward(&layers, &x).backward().unwrap();
        let names: Vec<String> = log.lock().unwrap().iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(names.len(), 6, "{order:?}: each hook fires exactly once: {names:?}");
        let pos = |n: &str| names.iter().position(|x| x == n).unwrap();
        assert!(pos("w2") < pos("w1") && pos("w1") < pos("w0"), "{order:?}: weights out of backward order: {names:?}");
        assert!(pos("b2") < pos("b1") && pos("b1") < pos("b0"), "{order:?}: biases out of backward order: {names:?}");
        assert_eq!(*seen.lock().unwrap(), Some(true), "{order:?}: last layer's hook fired after the first layer's gradient existed");
        // each hook saw the final gradient
        for (n, g) in log.lock().unwrap().iter() {
            let i: usize = n[1..].parse().unwrap();
            let p = if n.starts_with('w') { &layers[i].0 } else { &layers[i].1 };
            assert_eq!(g, &p.grad().unwrap().to_vec_f64().unwrap(), "{n}");
        }
    }
}

#[test]
fn shared_parameter_hook_fires_once_with_accumulated_grad() {
    let g = &mut Rng::new(8);
    let (w, b) = (param(&randn(&[4, 4], g)), param(&randn(&[4], g)));
    let x = randn(&[2, 4], g);
    let log: Log = Arc::default();
    hook(&w, "w", &log);
    let y = linear(&linear(&x, &w, &b).silu().unwrap(), &w, &b).sqr().unwrap().sum_all().unwrap();
    y.backward().unwrap();
    let l = log.lock().unwrap();
    assert_eq!(l.len(), 1, "a parameter used twice fires once");
    assert_eq!(l[0].1, w.grad().unwrap().to_vec_f64().unwrap());
    // it is the sum of both uses: compare with two separate copies of the weights
    let (wa, wb) = (param(&w.detach().contiguous().unwrap()), param(&w.detach().contiguous().unwrap()));
    let (ba, bb) = (param(&b.detach()), param(&b.detach()));
    let _ = (&ba, &bb);
    linear(&linear(&x, &wa, &b.detach()).silu().unwrap(), &wb, &b.detach()).sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let sum = wa.grad().unwrap().add(&wb.grad().unwrap()).unwrap().to_vec_f64().unwrap();
    assert!(rel_err(&l[0].1, &sum) < 1e-12);
}

#[test]
fn grads_accumulate_across_backward_calls() {
    let (layers, x) = three_layers([0, 1, 2]);
    let log: Log = Arc::default();
    hook(&layers[0].0, "w0", &log);
    forward(&layers, &x).backward().unwrap();
    let once: Vec<Vec<f64>> = layers.iter().map(|(w, _)| w.grad().unwrap().to_vec_f64().unwrap()).collect();
    forward(&layers, &x).backward().unwrap();
    for ((w, _), g1) in layers.iter().zip(&once) {
        let g2 = w.grad().unwrap().to_vec_f64().unwrap();
        let want: Vec<f64> = g1.iter().map(|v| 2.0 * v).collect();
        assert_eq!(g2, want, "two identical backwards accumulate to twice the gradient");
    }
    let l = log.lock().unwrap();
    assert_eq!(l.len(), 2, "hooks fire once per backward");
    assert_eq!(l[1].1, layers[0].0.grad().unwrap().to_vec_f64().unwrap(), "the hook sees the accumulated gradient");
    drop(l);
    for (w, b) in &layers {
        w.zero_grad();
        b.zero_grad();
    }
    forward(&layers, &x).backward().unwrap();
    assert_eq!(layers[0].0.grad().unwrap().to_vec_f64().unwrap(), once[0], "zero_grad resets");
}

#[test]
fn no_grad_and_detach() {
    let g = &mut Rng::new(9);
    let p = param(&randn(&[3, 3], g));
    assert!(is_grad_enabled());
    {
        let _g = no_grad();
        assert!(!is_grad_enabled());
        for y in [p.mul(&p).unwrap(), p.matmul(&p).unwrap(), p.exp().unwrap(), p.t().unwrap(), p.sum_all().unwrap()] {
            assert!(!y.requires_grad() && y.is_leaf());
        }
        {
            let _on = set_grad_enabled(true);
            assert!(p.exp().unwrap().requires_grad(), "grads re-enabled inside no_grad");
        }
        assert!(!is_grad_enabled(), "inner guard restores the outer state");
    }
    assert!(is_grad_enabled(), "guard restores grad mode");
    assert!(p.exp().unwrap().requires_grad());

    // detach: same storage, no history; gradient flows only through the attached use
    let d = p.detach();
    assert!(d.shares_storage(&p) && !d.requires_grad() && d.is_leaf());
    p.mul(&d).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(p.grad().unwrap().to_vec_f64().unwrap(), p.to_vec_f64().unwrap(), "d(p * detach(p))/dp = p");
    // a fully detached result cannot be backpropagated
    assert!(p.exp().unwrap().detach().sum_all().unwrap().backward().is_err());
    // ops on non-grad inputs record nothing
    let c = randn(&[3, 3], g);
    assert!(!c.exp().unwrap().requires_grad());
    let _ = DType::F64;
}

#[test]
fn backward_from_a_leaf_and_through_unused_branches() {
    let g = &mut Rng::new(10);
    let p = param(&randn(&[1], g));
    p.backward().unwrap();
    assert_eq!(p.grad().unwrap().to_vec_f64().unwrap(), vec![1.0]);
    // branches that do not reach the loss do not get (or break) gradients
    let q = param(&randn(&[4], g));
    let r = param(&randn(&[4], g));
    let _unused = r.exp().unwrap();
    let parts = q.split(&[1, 3], 0).unwrap();
    parts[1].sum_all().unwrap().backward().unwrap();
    assert_eq!(q.grad().unwrap().to_vec_f64().unwrap(), vec![0.0, 1.0, 1.0, 1.0]);
    assert!(r.grad().is_none());
}

/// A weight used through `w.t()` (a linear layer) gets its gradient in its own memory order:
/// dense, with no transposed copy to make, and equal to X^T G read back transposed. So does an
/// input used through `x.t()`; a broadcast operand keeps the summed gradient.
#[test]
fn transposed_operands_get_dense_gradients() {
    let g = &mut Rng::new(11);
    let (x, w) = (param(&randn(&[6, 4], g)), param(&randn(&[3, 4], g)));
    let cot = randn(&[6, 3], g);
    x.matmul(&w.t().unwrap()).unwrap().mul(&cot).unwrap().sum_all().unwrap().backward().unwrap();
    let gw = w.grad().unwrap();
    assert!(gw.is_contiguous(), "the weight's gradient is a strided view: {:?}", gw.layout());
    let want = cot.t().unwrap().matmul(&x.detach()).unwrap(); // (3, 4) = G^T X
    assert_eq!(gw.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    // Through x.t() on the left: (x^T) (6, 4)^T = (4, 6) times (6, 3).
    let (a, b) = (param(&randn(&[6, 4], g)), param(&randn(&[6, 3], g)));
    let cot = randn(&[4, 3], g);
    a.t().unwrap().matmul(&b).unwrap().mul(&cot).unwrap().sum_all().unwrap().backward().unwrap();
    let ga = a.grad().unwrap();
    assert!(ga.is_contiguous(), "the left operand's gradient is a strided view: {:?}", ga.layout());
    let want = b.detach().matmul(&cot.t().unwrap()).unwrap(); // (6, 4) = B G^T
    assert_eq!(ga.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
}

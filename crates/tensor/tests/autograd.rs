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

/// The linear op (`Tensor::linear`) against the same math in plain ops: an x read by three
/// linear layers gets the sum of their gradients (each layer's backward adds its dX onto the sum
/// so far, `GradCtx::take_partial`, in the engine's order, so on the CPU the result is bitwise
/// the composed one), and each weight gets G^T X.
#[test]
fn linear_backward_sums_into_its_input_in_the_engines_order() {
    let g = &mut Rng::new(12);
    let x = param(&randn(&[2, 3, 4], g));
    let ws: Vec<Tensor> = (0..3).map(|_| param(&randn(&[5, 4], g))).collect();
    let cots: Vec<Tensor> = (0..3).map(|_| randn(&[2, 3, 5], g)).collect();
    let run = |fused: bool| -> (Vec<f64>, Vec<Vec<f64>>) {
        x.zero_grad();
        ws.iter().for_each(Tensor::zero_grad);
        let mut loss: Option<Tensor> = None;
        for (w, c) in ws.iter().zip(&cots) {
            let y = match fused {
                true => x.linear(w).unwrap(),
                false => x.reshape([6, 4]).unwrap().matmul(&w.t().unwrap()).unwrap().reshape([2, 3, 5]).unwrap(),
            };
            let l = y.mul(c).unwrap().sum_all().unwrap();
            loss = Some(match loss {
                Some(a) => a.add(&l).unwrap(),
                None => l,
            });
        }
        // x also reaches the loss directly: a contribution that is not a linear layer's.
        loss.unwrap().add(&x.sqr().unwrap().sum_all().unwrap()).unwrap().backward().unwrap();
        (x.grad().unwrap().to_vec_f64().unwrap(), ws.iter().map(|w| w.grad().unwrap().to_vec_f64().unwrap()).collect())
    };
    let (gx, gw) = run(true);
    let (rx, rw) = run(false);
    assert_eq!(gx, rx, "x's gradient differs from the composed ops'");
    assert_eq!(gw, rw, "the weights' gradients differ from the composed ops'");
    assert_eq!(
        gw[0],
        cots[0].reshape([6, 5]).unwrap().t().unwrap().matmul(&x.detach().reshape([6, 4]).unwrap()).unwrap().to_vec_f64().unwrap()
    );
}

/// A leaf's gradient destination (`set_grad_dest`): a weight read by one linear layer gets its
/// gradient written into the view it offers (here f32, a slice of a larger buffer, as in a
/// gradient bucket) and its sink receives that very view; a weight read by two layers, and a
/// weight whose offer answers `None`, get theirs as values. The values are G^T X either way,
/// and nothing outside the slice is written.
#[test]
fn a_weight_gradient_lands_in_its_destination() {
    let g = &mut Rng::new(13);
    let x = param(&randn(&[3, 4], g));
    let (w1, w2, w3) = (param(&randn(&[5, 4], g)), param(&randn(&[5, 4], g)), param(&randn(&[5, 4], g)));
    let bucket = Tensor::full([2 + 20 + 3], 7.0, DType::F32, CPU).unwrap();
    let asked = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let offer = |name: &'static str, w: &Tensor, view: Option<Tensor>| {
        let asked = asked.clone();
        w.set_grad_dest(Some(Arc::new(move || {
            asked.lock().unwrap().push(name);
            Ok(view.clone())
        })));
    };
    let slice = bucket.narrow(0, 2, 20).unwrap().reshape([5, 4]).unwrap();
    offer("w1", &w1, Some(slice.clone()));
    offer("w2", &w2, Some(Tensor::zeros([5, 4], DType::F32, CPU).unwrap()));
    offer("w3", &w3, None);
    // (weight, arrived in its destination, values) per sink call.
    type Arrivals = Arc<Mutex<Vec<(&'static str, bool, Vec<f64>)>>>;
    let got: Arrivals = Arc::default();
    for (name, w) in [("w1", &w1), ("w2", &w2), ("w3", &w3)] {
        let (got, slice) = (got.clone(), slice.clone());
        w.set_grad_sink(Some(Arc::new(move |gr: &Tensor| {
            got.lock().unwrap().push((name, gr.same_view(&slice), gr.to_dtype(DType::F64).unwrap().to_vec_f64().unwrap()))
        })));
    }
    let (c1, c2, c3, c4) = (randn(&[3, 5], g), randn(&[3, 5], g), randn(&[3, 5], g), randn(&[3, 5], g));
    let loss = [(&w1, &c1), (&w2, &c2), (&w2, &c3), (&w3, &c4)]
        .iter()
        .map(|(w, c)| x.linear(w).unwrap().mul(c).unwrap().sum_all().unwrap())
        .reduce(|a, b| a.add(&b).unwrap())
        .unwrap();
    loss.backward().unwrap();
    let xd = x.detach();
    let gtx = |c: &Tensor| c.t().unwrap().matmul(&xd).unwrap();
    let want = [("w1", gtx(&c1)), ("w2", gtx(&c2).add(&gtx(&c3)).unwrap()), ("w3", gtx(&c4))];
    let got = got.lock().unwrap();
    assert_eq!(got.len(), 3, "one gradient per weight: {:?}", got.iter().map(|g| g.0).collect::<Vec<_>>());
    for (name, w) in want {
        let (_, in_place, v) = got.iter().find(|g| g.0 == name).unwrap();
        assert_eq!(*in_place, name == "w1", "{name}: arrived in place: {in_place}");
        let w = w.to_vec_f64().unwrap();
        assert!(v.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + b.abs())), "{name}: {v:?} vs {w:?}");
    }
    // w2 has two consumers: its offer is never asked for.
    assert_eq!(*asked.lock().unwrap(), ["w3", "w1"], "which offers were asked (in backward order)");
    let b = bucket.to_vec_f64().unwrap();
    assert!(b[..2].iter().chain(&b[22..]).all(|&v| v == 7.0), "written outside the slice: {b:?}");
}

/// The same inside an activation-checkpointed segment (`recompute`): the recomputed linear
/// layer writes the weight's gradient into its destination, and the sink outside sees it.
#[test]
fn a_recomputed_linear_layer_writes_its_weight_gradient_in_place() {
    let g = &mut Rng::new(14);
    let x = param(&randn(&[3, 4], g));
    let w = param(&randn(&[5, 4], g));
    let dest = Tensor::zeros([5, 4], DType::F64, CPU).unwrap();
    let d = dest.clone();
    w.set_grad_dest(Some(Arc::new(move || Ok(Some(d.clone())))));
    let seen: Arc<Mutex<Option<bool>>> = Arc::default();
    let (s, d) = (seen.clone(), dest.clone());
    w.set_grad_sink(Some(Arc::new(move |gr: &Tensor| *s.lock().unwrap() = Some(gr.same_view(&d)))));
    let c = randn(&[3, 5], g);
    let wc = w.clone();
    let y = ferrolm_tensor::recompute(std::slice::from_ref(&x), move |xs| xs[0].linear(&wc)?.silu()).unwrap();
    y.mul(&c).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(*seen.lock().unwrap(), Some(true), "the gradient did not arrive in its destination");
    // Against plain ops.
    let (x2, w2) = (param(&x.detach().contiguous().unwrap()), param(&w.detach().contiguous().unwrap()));
    x2.matmul(&w2.t().unwrap()).unwrap().silu().unwrap().mul(&c).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(dest.to_vec_f64().unwrap(), w2.grad().unwrap().to_vec_f64().unwrap());
    assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), x2.grad().unwrap().to_vec_f64().unwrap());
}

/// An op that takes the gradient its input has so far (`GradCtx::take_partial`) must return
/// that input's total: one that returns none fails the backward pass, naming the op.
#[test]
fn a_backward_that_takes_a_partial_sum_must_return_it() {
    let g = &mut Rng::new(15);
    let x = param(&randn(&[4], g));
    let y = x.mul_scalar(2.0).unwrap();
    let out = Tensor::from_op_ctx(
        y.detach(),
        "greedy",
        &[&y],
        Box::new(|_g, ctx| {
            let _ = ctx.take_partial(0)?;
            Ok(vec![None])
        }),
    );
    let e = out.sum_all().unwrap().add(&y.sum_all().unwrap()).unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("greedy backward") && e.contains("returned no gradient"), "{e}");
}

/// Without a sink a leaf's gradient accumulates in `.grad()` over backward passes: its
/// destination is used only while `.grad()` is empty, so the second pass adds to the first
/// instead of overwriting it.
#[test]
fn a_destination_never_overwrites_an_accumulated_gradient() {
    let g = &mut Rng::new(16);
    let (x, w) = (randn(&[3, 4], g), param(&randn(&[5, 4], g)));
    let dest = Tensor::zeros([5, 4], DType::F64, CPU).unwrap();
    let d = dest.clone();
    w.set_grad_dest(Some(Arc::new(move || Ok(Some(d.clone())))));
    for _ in 0..2 {
        x.linear(&w).unwrap().sum_all().unwrap().backward().unwrap();
    }
    let once = Tensor::ones([3, 5], DType::F64, CPU).unwrap().t().unwrap().matmul(&x).unwrap().to_vec_f64().unwrap();
    let twice: Vec<f64> = once.iter().map(|v| 2.0 * v).collect();
    assert_eq!(w.grad().unwrap().to_vec_f64().unwrap(), twice);
    assert_eq!(dest.to_vec_f64().unwrap(), once, "the first pass wrote its destination, the second did not");
}

/// `linear_plus` is `res + x.linear(w)`: on the CPU bitwise (the same sum in the same order),
/// forward and backward, with res also read by another op.
#[test]
fn linear_plus_is_the_sum_it_replaces() {
    let g = &mut Rng::new(17);
    let (x, w, r) = (param(&randn(&[2, 3, 4], g)), param(&randn(&[5, 4], g)), param(&randn(&[2, 3, 5], g)));
    let run = |fused: bool| {
        for t in [&x, &w, &r] {
            t.zero_grad();
        }
        let y = match fused {
            true => x.linear_plus(&w, &r).unwrap(),
            false => r.add(&x.linear(&w).unwrap()).unwrap(),
        };
        y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        [y.detach(), x.grad().unwrap(), w.grad().unwrap(), r.grad().unwrap()].map(|t| t.to_vec_f64().unwrap())
    };
    assert_eq!(run(true), run(false));
}

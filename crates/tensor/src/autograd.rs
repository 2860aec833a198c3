//! Reverse-mode autograd. Each op output keeps a `Node`: its inputs and a closure mapping the
//! output gradient to input gradients. `backward` walks the graph in reverse creation order
//! (Kahn's algorithm over consumer counts), so a leaf is reached exactly when its gradient is
//! final; its hooks fire then, once per pass, while the rest of backward continues.
use crate::{Result, Tensor};
use std::cell::Cell;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

pub type BackwardFn = Box<dyn Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync>;
/// A backward that also takes what the engine offers besides the output gradient (`GradCtx`).
pub type CtxBackwardFn = Box<dyn Fn(&Tensor, &mut GradCtx) -> Result<Vec<Option<Tensor>>> + Send + Sync>;
pub type Hook = Arc<dyn Fn(&Tensor) + Send + Sync>;
/// Where a leaf's gradient may be written in place (see `Tensor::set_grad_dest`): a dense view
/// of the leaf's shape, in any float dtype, or `None` (the gradient comes as a value).
pub type GradDest = Arc<dyn Fn() -> Result<Option<Tensor>> + Send + Sync>;

pub enum Backward {
    Plain(BackwardFn),
    Ctx(CtxBackwardFn),
}

pub struct Node {
    pub name: &'static str,
    /// The op's inputs and its backward with what it saved, taken when backward runs through the
    /// node: what only the graph held (the activations) is freed as backward goes, not when the
    /// loss is dropped (PyTorch's `retain_graph=False`). `None` once taken: a second backward
    /// through the node is refused.
    work: Mutex<Option<Work>>,
}

struct Work {
    inputs: Vec<Tensor>,
    backward: Backward,
}

impl Node {
    /// The inputs, while backward has not run through the node.
    fn inputs(&self) -> Option<Vec<Tensor>> {
        self.work.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|w| w.inputs.clone())
    }
    fn ran_already(&self) -> crate::Error {
        crate::Error::new(
            format!("{} backward", self.name),
            "backward ran twice through this graph, and the first freed what it saved: compute the loss again",
        )
    }
}

/// What the engine offers a `CtxBackwardFn` for input `i`, so its gradient needs no kernel of its
/// own to be summed or stored:
/// - `take_partial(i)`: the contributions already arrived for the input, summed in arrival
///   order. An op that adds them into its result (a GEMM's addend) returns the total for that
///   input, which replaces them: the engine's add is saved and the order of the sum is kept.
/// - `dest(i)`: for a leaf that this op is the only consumer of, the view its gradient lands in
///   (a slice of an f32 gradient bucket). An op that writes its result there (a GEMM's output)
///   returns that view, and the leaf's sink sees it arrive in place: no cast, no copy.
///
/// - `grad_is_one()`: the output gradient is exactly 1 (the op's output is the root of
///   `backward()`), so an op that made its input gradients in its forward for a root gradient
///   of 1 (the fused head + loss) hands them over without reading or scaling by it.
///
/// All are optional to use: an op that ignores them gets the engine's plain behaviour. Ops use
/// them through the helpers below, named by the gradient convention of each result (llm.c's:
/// parameter gradients `+=` into their destination, activations `=`, residual gradients `+=`):
/// `accumulate`, `accumulate_into`, `addend` (`Addend`), `param_dest` (`ParamDest`), `param_into`.
pub struct GradCtx {
    partial: Vec<Option<Vec<Tensor>>>,
    taken: Vec<bool>,
    dest: Vec<Option<GradDest>>,
    unit: bool,
}

impl GradCtx {
    /// The sum of the gradient contributions input `i` has received so far, if any; taking it
    /// makes this op's gradient for `i` the total.
    pub fn take_partial(&mut self, i: usize) -> Result<Option<Tensor>> {
        match self.partial.get_mut(i).and_then(Option::take) {
            Some(parts) => {
                self.taken[i] = true;
                sum_grads(parts)
            }
            None => Ok(None),
        }
    }
    /// Where input `i`'s gradient may be written in place, if it has such a destination.
    pub fn dest(&mut self, i: usize) -> Result<Option<Tensor>> {
        match self.dest.get_mut(i).and_then(Option::take) {
            Some(f) => f(),
            None => Ok(None),
        }
    }
    /// True when the output gradient is the seed 1 of `backward()` (this op made the root).
    pub fn grad_is_one(&self) -> bool {
        self.unit
    }

    // ---- the gradient conventions (llm.c's): parameter gradients `+=` into their bucket's
    // slice, activation gradients `=` (a plain return), residual gradients `+=` onto what the
    // input has so far. An op's backward states its math and calls these; they decide where the
    // result lands.

    /// Input `i`'s gradient `+=` this op's contribution `d`, composed: what arrived first, then
    /// `d` (the engine's order), with no kernel when nothing arrived.
    pub fn accumulate(&mut self, i: usize, d: Tensor) -> Result<Tensor> {
        self.addend(i, |_| false)?.finish(d, false)
    }

    /// Input `i`'s gradient `+=` through the op's own kernel: `f` gets what the input has so far,
    /// whatever its layout and even while it is still being produced, and must add it into what
    /// it returns (a GEMM's addend: `matmul_into` fuses it or composes the add itself), the total.
    pub fn accumulate_into(&mut self, i: usize, f: impl FnOnce(Option<&Tensor>) -> Result<Tensor>) -> Result<Tensor> {
        let sum = self.take_partial(i)?;
        f(sum.as_ref())
    }

    /// What input `i` has so far, for a kernel to add into its result where `fits` says the
    /// kernel takes it as it is (dtype, shape, layout); `Addend::finish` composes the sum
    /// otherwise. Taking it obliges the op to return a gradient for `i` (`finish` makes it).
    pub fn addend(&mut self, i: usize, fits: impl Fn(&Tensor) -> bool) -> Result<Addend> {
        let sum = self.take_partial(i)?;
        let fits = sum.as_ref().is_some_and(|a| !a.is_pending() && fits(a));
        Ok(Addend { sum, fits })
    }

    /// Where parameter `i`'s gradient goes (`ParamDest`): its gradient destination (a slice of
    /// an f32 bucket) for a kernel to write where `fits` says it can, else a value `land` puts
    /// there (or returns, where there is no destination).
    pub fn param_dest(&mut self, i: usize, fits: impl Fn(&Tensor) -> bool) -> Result<ParamDest> {
        let view = self.dest(i)?;
        let fits = view.as_ref().is_some_and(fits);
        Ok(ParamDest { view, fits })
    }

    /// Parameter `i`'s gradient from `f`, which writes it into the destination it is given (a
    /// GEMM's output, which writes what it cannot produce in place itself) or returns a value.
    pub fn param_into(&mut self, i: usize, f: impl FnOnce(Option<&Tensor>) -> Result<Tensor>) -> Result<Tensor> {
        let d = self.param_dest(i, |_| true)?;
        let v = f(d.fused())?;
        d.land(Some(v))
    }
}

/// What an input's gradient has so far, offered to the kernel of an op's backward as its addend
/// (`GradCtx::addend`): residual gradients `+=`.
pub struct Addend {
    sum: Option<Tensor>,
    fits: bool,
}

impl Addend {
    /// The sum so far, when the kernel takes it as it is.
    pub fn fused(&self) -> Option<&Tensor> {
        self.sum.as_ref().filter(|_| self.fits)
    }
    /// The input's gradient from this op's contribution `d`: `d` itself when the kernel added
    /// the sum (`fused`: the kernel ran with what `fused()` offered), else sum + d, in the
    /// engine's order.
    pub fn finish(self, d: Tensor, fused: bool) -> Result<Tensor> {
        match self.sum {
            Some(a) if !(fused && self.fits) => a.add(&d),
            _ => Ok(d),
        }
    }
}

/// Where a parameter's gradient goes (`GradCtx::param_dest`, or `ParamDest::new` in a forward
/// that forms it): parameter gradients land in their bucket's slice.
#[derive(Default)]
pub struct ParamDest {
    view: Option<Tensor>,
    fits: bool,
}

impl ParamDest {
    /// A destination asked for outside a backward (`Tensor::grad_dest`), taken as it is.
    pub fn new(view: Option<Tensor>) -> ParamDest {
        let fits = view.is_some();
        ParamDest { view, fits }
    }
    /// The destination, when the kernel can write it as it is.
    pub fn fused(&self) -> Option<&Tensor> {
        self.view.as_ref().filter(|_| self.fits)
    }
    /// The gradient, handed over: `None` when the kernel wrote it into `fused()` (that view is
    /// returned); a value already in the destination (the same view) as it is; else the value
    /// assigned into the destination (cast to its dtype) or, without one, returned.
    pub fn land(self, value: Option<Tensor>) -> Result<Tensor> {
        match value {
            Some(v) => self.land_as(v, None),
            None => match self.fused() {
                Some(_) => Ok(self.view.expect("fused is a view")),
                None => crate::bail!("gradient destination", "the kernel wrote no gradient and was given no destination"),
            },
        }
    }
    /// As `land` for a value, which, without a destination, is handed over in `dtype` (the
    /// parameter's) when given.
    pub fn land_as(self, v: Tensor, dtype: Option<crate::DType>) -> Result<Tensor> {
        match self.view {
            Some(t) if v.same_view(&t) => Ok(v),
            Some(t) => {
                let v = if v.shape() == t.shape() { v } else { v.reshape(t.shape().clone())? };
                t.assign(&v)?;
                Ok(t)
            }
            None => match dtype {
                Some(dt) => v.to_dtype(dt),
                None => Ok(v),
            },
        }
    }
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Disables graph recording on this thread until the guard drops (inference, optimizer steps).
pub struct GradGuard(bool);
impl Drop for GradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.0));
    }
}
pub fn no_grad() -> GradGuard {
    set_grad_enabled(false)
}
pub fn set_grad_enabled(on: bool) -> GradGuard {
    GradGuard(GRAD_ENABLED.with(|g| g.replace(on)))
}

impl Tensor {
    /// Wraps an op result: records `backward` when grads are on and an input needs them.
    pub(crate) fn record(out: Tensor, name: &'static str, inputs: &[&Tensor], backward: BackwardFn) -> Tensor {
        Tensor::record_node(out, name, inputs, Backward::Plain(backward))
    }

    pub(crate) fn record_node(out: Tensor, name: &'static str, inputs: &[&Tensor], backward: Backward) -> Tensor {
        if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
            return out;
        }
        let work = Work { inputs: inputs.iter().map(|t| (*t).clone()).collect(), backward };
        let node = Arc::new(Node { name, work: Mutex::new(Some(work)) });
        out.view(out.0.layout.clone(), Some(node))
    }
}

/// Sums gradient contributions in arrival order (a left fold, as eager accumulation would).
/// Contributions of different float dtypes (an op's f32 gradient destination and a bf16
/// gradient of a tied weight's other consumer) are summed in the wider one.
fn sum_grads(parts: Vec<Tensor>) -> Result<Option<Tensor>> {
    let mut it = parts.into_iter();
    let Some(mut acc) = it.next() else { return Ok(None) };
    for g in it {
        acc = match acc.dtype() == g.dtype() {
            true => acc.add(&g)?,
            false => {
                let wide = if acc.dtype().size_in_bytes() >= g.dtype().size_in_bytes() { acc.dtype() } else { g.dtype() };
                acc.to_dtype(wide)?.add(&g.to_dtype(wide)?)?
            }
        };
    }
    Ok(Some(acc))
}

/// Core traversal: seeds `root` with `seed` and calls `on_leaf(leaf, grad)` exactly once per
/// leaf that requires grad, at the moment its gradient is complete.
///
/// Gradient contributions are kept as lists and summed only when their tensor is processed,
/// so a pending contribution (a collective's result still in flight) is not waited on when it
/// arrives. Among the tensors whose gradients are complete, the newest one with no pending
/// contribution goes first; only when every ready tensor waits on communication is the newest
/// of them taken (and waited on). The choice depends on which values are pending, never on
/// timing, so a run is deterministic; with nothing pending it is plain newest-first order.
/// `unit_seed`: `seed` is exactly 1 (`backward()`), which the root's op is told (`GradCtx::grad_is_one`).
pub(crate) fn traverse(root: &Tensor, seed: Tensor, unit_seed: bool, on_leaf: &mut dyn FnMut(&Tensor, Tensor) -> Result<()>) -> Result<()> {
    let _g = no_grad();
    // Consumer counts of every tensor reachable from root that requires grad.
    let mut deps: HashMap<usize, usize> = HashMap::new();
    let mut by_id: HashMap<usize, Tensor> = HashMap::new();
    let mut stack = vec![root.clone()];
    by_id.insert(root.id(), root.clone());
    while let Some(t) = stack.pop() {
        if let Some(node) = &t.0.grad_fn {
            for i in node.inputs().ok_or_else(|| node.ran_already())?.iter().filter(|i| i.requires_grad()) {
                *deps.entry(i.id()).or_insert(0) += 1;
                if by_id.insert(i.id(), i.clone()).is_none() {
                    stack.push(i.clone());
                }
            }
        }
    }
    // A leaf read by exactly one op may have its gradient written in place by that op.
    let single: std::collections::HashSet<usize> = deps.iter().filter(|&(_, &n)| n == 1).map(|(&id, _)| id).collect();
    let mut grads: HashMap<usize, Vec<Tensor>> = HashMap::from([(root.id(), vec![seed])]);
    let mut ready: BTreeSet<usize> = BTreeSet::from([root.id()]);
    // What a ready tensor's gradient still waits for: communication in flight, or only local
    // work deferred into it (a weight gradient).
    let comm = |grads: &HashMap<usize, Vec<Tensor>>, id: usize| {
        grads.get(&id).is_some_and(|v| v.iter().any(|g| g.is_pending() && !g.is_deferred()))
    };
    let any = |grads: &HashMap<usize, Vec<Tensor>>, id: usize| grads.get(&id).is_some_and(|v| v.iter().any(Tensor::is_pending));
    loop {
        // 1. the newest tensor whose gradient is complete; 2. deferred local work (it runs while
        // the collectives launched by 1 are in flight); 3. the newest, waiting for it.
        let pick = ready
            .iter()
            .rev()
            .find(|&&id| !any(&grads, id))
            .or_else(|| ready.iter().rev().find(|&&id| !comm(&grads, id)))
            .or_else(|| ready.last());
        let id = match pick {
            Some(&id) => id,
            None => break,
        };
        ready.remove(&id);
        let t = by_id.remove(&id).expect("ready tensor is in the graph");
        let g = sum_grads(grads.remove(&id).unwrap_or_default())?;
        let Some(node) = &t.0.grad_fn else {
            if let Some(g) = g {
                if g.is_deferred() {
                    g.wait()?; // the scheduler chose this moment to run the deferred work
                }
                // A collective's result is handed over still pending: the leaf's consumer
                // (an optimizer, a sharding engine) waits where it reads it.
                on_leaf(&t, g)?;
            }
            continue;
        };
        // A node that received no gradient still releases its inputs (their other consumers
        // may have sent them one); it just contributes nothing.
        let name = node.name;
        let Some(Work { inputs, backward }) = node.work.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Err(node.ran_already());
        };
        let wrap = |e: crate::Error| crate::Error::new(format!("{name} backward"), e.to_string());
        let gins = match (g, &backward) {
            (None, _) => Vec::new(),
            (Some(g), Backward::Plain(f)) => f(&g).map_err(wrap)?,
            (Some(g), Backward::Ctx(f)) => {
                let mut ctx = offer(&inputs, &mut grads, &single);
                ctx.unit = unit_seed && id == root.id();
                let r = f(&g, &mut ctx);
                // Contributions the op did not take go back, ahead of its own (arrival order).
                for (inp, parts) in inputs.iter().zip(ctx.partial) {
                    if let Some(parts) = parts {
                        let e = grads.entry(inp.id()).or_default();
                        let later = std::mem::replace(e, parts);
                        e.extend(later);
                    }
                }
                let r = r.map_err(wrap)?;
                if let Some(i) = (0..ctx.taken.len()).find(|&i| ctx.taken[i] && r.get(i).is_none_or(Option::is_none)) {
                    crate::bail!(format!("{name} backward"), "took input {i}'s gradient so far but returned no gradient for it");
                }
                r
            }
        };
        drop(backward); // what the op saved
        let mut gins = gins.into_iter();
        for inp in inputs.iter() {
            let gi = gins.next().flatten();
            if !inp.requires_grad() {
                continue;
            }
            if let Some(gi) = gi {
                if gi.shape() != inp.shape() {
                    crate::bail!(format!("{name} backward"), "gradient shape {:?} for input {:?}", gi.shape(), inp.shape());
                }
                grads.entry(inp.id()).or_default().push(gi);
            }
            let d = deps.get_mut(&inp.id()).expect("counted input");
            *d -= 1;
            if *d == 0 {
                if inp.is_leaf() && !any(&grads, inp.id()) {
                    // A leaf's gradient is final now: deliver it (and fire its hooks) at once
                    // instead of after every op with a larger id, so hooks run in backward order
                    // while the rest of backward goes on. A gradient still pending (deferred work,
                    // or a collective) joins the ready set and is scheduled like any other.
                    by_id.remove(&inp.id());
                    if let Some(gl) = sum_grads(grads.remove(&inp.id()).unwrap_or_default())? {
                        on_leaf(inp, gl)?;
                    }
                } else {
                    ready.insert(inp.id());
                }
            }
        }
    }
    Ok(())
}

/// What a `CtxBackwardFn` is offered (see `GradCtx`): per input that requires grad (its first
/// occurrence), the contributions it has so far when none is pending (they are moved out of
/// `grads`; the caller puts back what is not taken), and the destination of a leaf with one
/// consumer and nothing arrived yet.
fn offer(inputs: &[Tensor], grads: &mut HashMap<usize, Vec<Tensor>>, single: &std::collections::HashSet<usize>) -> GradCtx {
    let n = inputs.len();
    let mut ctx = GradCtx { partial: vec![None; n], taken: vec![false; n], dest: vec![None; n], unit: false };
    for (i, inp) in inputs.iter().enumerate() {
        if !inp.requires_grad() || inputs[..i].iter().any(|o| o.id() == inp.id()) {
            continue;
        }
        // Not over a `.grad()` it would be added to (no sink: accumulation across passes).
        let fresh = inp.0.sink.lock().unwrap_or_else(|e| e.into_inner()).is_some() || inp.grad().is_none();
        if inp.is_leaf() && single.contains(&inp.id()) && !grads.contains_key(&inp.id()) && fresh {
            ctx.dest[i] = inp.0.dest.lock().unwrap_or_else(|e| e.into_inner()).clone();
        }
        if grads.get(&inp.id()).is_some_and(|v| !v.is_empty() && !v.iter().any(Tensor::is_pending)) {
            ctx.partial[i] = grads.remove(&inp.id());
        }
    }
    ctx
}

/// Backpropagates from a one-element `root` (seed 1), accumulating into leaf `.grad()`s.
pub fn backward(root: &Tensor) -> Result<()> {
    if root.numel() != 1 {
        crate::bail!("backward", "root must have one element, it has shape {:?}; use backward_with", root.shape());
    }
    let seed = Tensor::ones(root.shape().clone(), root.dtype(), root.device())?;
    accumulate(root, seed, true)
}

/// Backpropagates `seed` (of the root's shape) from `root`, accumulating into leaf `.grad()`s.
pub fn backward_with(root: &Tensor, seed: Tensor) -> Result<()> {
    accumulate(root, seed, false)
}

fn accumulate(root: &Tensor, seed: Tensor, unit_seed: bool) -> Result<()> {
    if !root.requires_grad() {
        crate::bail!("backward", "tensor does not require grad (no parameter reaches it, or it was made under no_grad)");
    }
    traverse(root, seed, unit_seed, &mut |leaf, g| {
        let sink = leaf.0.sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(sink) = sink {
            sink(&g);
            return Ok(());
        }
        let total = match leaf.grad() {
            Some(prev) => prev.add(&g)?,
            None => g,
        };
        leaf.set_grad(Some(total.clone()));
        let hooks = leaf.0.hooks.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for h in hooks {
            h(&total);
        }
        Ok(())
    })
}

/// Activation checkpointing: runs `f(inputs)` keeping none of its intermediate activations;
/// backward runs `f` again and backpropagates through the recomputed segment. Parameters that
/// `f` uses (found by tracing one recorded forward) get their gradients like in a plain run.
/// `f` must be deterministic; it gives bitwise the same gradients as running it directly.
pub fn recompute<F>(inputs: &[Tensor], f: F) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    if !is_grad_enabled() {
        return f(inputs);
    }
    let fresh = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        xs.iter()
            .map(|x| {
                let d = x.detach();
                if x.requires_grad() {
                    d.set_requires_grad(true)?;
                }
                Ok(d)
            })
            .collect()
    };
    // Trace once to learn which outside leaves (parameters) the segment reads; the graph and
    // its activations are dropped as soon as the output is detached.
    let xs = fresh(inputs)?;
    let y = f(&xs)?;
    if !y.requires_grad() {
        return Ok(y);
    }
    let local: Vec<usize> = xs.iter().map(|x| x.id()).collect();
    let mut params: Vec<Tensor> = Vec::new();
    {
        let mut seen = std::collections::HashSet::new();
        let mut stack = vec![y.clone()];
        while let Some(t) = stack.pop() {
            if !seen.insert(t.id()) {
                continue;
            }
            match &t.0.grad_fn {
                Some(n) => stack.extend(n.inputs().unwrap_or_default().into_iter().filter(|i| i.requires_grad())),
                None if !local.contains(&t.id()) => params.push(t.clone()),
                None => {}
            }
        }
    }
    params.sort_by_key(|p| p.id());
    let out = y.detach();
    drop((y, xs));
    let n_in = inputs.len();
    let all: Vec<Tensor> = inputs.iter().cloned().chain(params.iter().cloned()).collect();
    let saved_inputs = inputs.to_vec();
    let saved_params = params.clone();
    let backward: BackwardFn = Box::new(move |g| {
        let _on = set_grad_enabled(true);
        let xs = fresh(&saved_inputs)?;
        let y = f(&xs)?;
        let mut got: HashMap<usize, Tensor> = HashMap::new();
        traverse(&y, g.clone(), false, &mut |leaf, gl| {
            got.insert(leaf.id(), gl);
            Ok(())
        })?;
        let mut res: Vec<Option<Tensor>> = xs.iter().map(|x| got.remove(&x.id())).collect();
        res.extend(saved_params.iter().map(|p| got.remove(&p.id())));
        Ok(res)
    });
    debug_assert_eq!(all.len(), n_in + params.len());
    let refs: Vec<&Tensor> = all.iter().collect();
    Ok(Tensor::record(out, "recompute", &refs, backward))
}

#[cfg(test)]
mod tests {
    //! The gradient helpers' conventions: `+=` onto what arrived (in its order, fused or
    //! composed), parameter gradients landing in their destination.
    use super::*;
    use crate::{DType, Device};

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_vec(v.to_vec(), [v.len()], Device::Cpu).unwrap()
    }
    fn ctx(partial: Option<Tensor>, dest: Option<Tensor>) -> GradCtx {
        let dest: Option<GradDest> = dest.map(|d| Arc::new(move || Ok(Some(d.clone()))) as GradDest);
        GradCtx { partial: vec![partial.map(|p| vec![p])], taken: vec![false], dest: vec![dest], unit: false }
    }

    #[test]
    fn accumulate_adds_what_arrived_first() {
        let mut c = ctx(Some(t(&[1.0, 2.0])), None);
        assert_eq!(c.accumulate(0, t(&[10.0, 20.0])).unwrap().to_vec_f32().unwrap(), [11.0, 22.0]);
        assert!(c.taken[0], "taking the sum obliges the op to return the total");
        let mut none = ctx(None, None);
        assert_eq!(none.accumulate(0, t(&[3.0])).unwrap().to_vec_f32().unwrap(), [3.0]);
        assert!(!none.taken[0]);
    }

    #[test]
    fn accumulate_into_hands_the_sum_to_the_kernel_and_returns_its_total() {
        let mut c = ctx(Some(t(&[1.0, 2.0])), None);
        let got = c
            .accumulate_into(0, |acc| {
                let acc = acc.expect("what arrived is offered");
                acc.add(&t(&[10.0, 20.0]))
            })
            .unwrap();
        // The kernel's result is the total: nothing is added again.
        assert_eq!(got.to_vec_f32().unwrap(), [11.0, 22.0]);
        assert!(c.taken[0]);
        let mut none = ctx(None, None);
        assert_eq!(none.accumulate_into(0, |acc| Ok(t(&[acc.map_or(3.0, |_| -1.0)]))).unwrap().to_vec_f32().unwrap(), [3.0]);
    }

    #[test]
    fn an_addend_the_kernel_took_is_not_added_again() {
        let mut c = ctx(Some(t(&[1.0])), None);
        let a = c.addend(0, |_| true).unwrap();
        assert!(a.fused().is_some());
        // The kernel added it: its result is the total.
        assert_eq!(a.finish(t(&[5.0]), true).unwrap().to_vec_f32().unwrap(), [5.0]);
        // One the kernel cannot take, or a backend that did not fuse: composed.
        let mut c = ctx(Some(t(&[1.0])), None);
        let a = c.addend(0, |_| false).unwrap();
        assert!(a.fused().is_none());
        assert_eq!(a.finish(t(&[5.0]), true).unwrap().to_vec_f32().unwrap(), [6.0]);
        let mut c = ctx(Some(t(&[1.0])), None);
        assert_eq!(c.addend(0, |_| true).unwrap().finish(t(&[5.0]), false).unwrap().to_vec_f32().unwrap(), [6.0]);
    }

    #[test]
    fn a_parameter_gradient_lands_in_its_destination() {
        let slot = Tensor::zeros([2], DType::F32, Device::Cpu).unwrap();
        // Written in place by the kernel: the view itself is handed over.
        let mut c = ctx(None, Some(slot.clone()));
        let d = c.param_dest(0, |_| true).unwrap();
        assert!(d.fused().is_some_and(|v| v.same_view(&slot)));
        assert!(d.land(None).unwrap().same_view(&slot));
        // A value where the kernel could not write: assigned into the destination.
        let mut c = ctx(None, Some(slot.clone()));
        let d = c.param_dest(0, |_| false).unwrap();
        assert!(d.fused().is_none());
        let got = d.land(Some(t(&[4.0, 5.0]))).unwrap();
        assert!(got.same_view(&slot));
        assert_eq!(slot.to_vec_f32().unwrap(), [4.0, 5.0]);
        // No destination: the value, in the parameter's dtype when asked.
        let mut c = ctx(None, None);
        let d = c.param_dest(0, |_| true).unwrap();
        assert!(d.land(None).is_err(), "nothing written and nowhere to write it");
        let v = ParamDest::default().land_as(t(&[1.0]), Some(DType::F64)).unwrap();
        assert_eq!(v.dtype(), DType::F64);
        // param_into: the GEMM writes the destination it is given.
        let mut c = ctx(None, Some(slot.clone()));
        let got = c
            .param_into(0, |dest| {
                let dest = dest.expect("offered");
                dest.assign(&t(&[7.0, 8.0]))?;
                Ok(dest.clone())
            })
            .unwrap();
        assert!(got.same_view(&slot));
        assert_eq!(slot.to_vec_f32().unwrap(), [7.0, 8.0]);
    }
}

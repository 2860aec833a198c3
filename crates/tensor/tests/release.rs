//! Backward frees what each op saved once it has run through the op, with the loss still held
//! (the autograd takes the op's inputs and closure out of the graph), and refuses a second
//! backward through the freed graph. Alone in its binary: it reads the process's tensor bytes.
use ferrolm_tensor::{live_bytes, DType, Device, Rng, Tensor};
use std::sync::{Arc, Mutex};

const N: usize = 256;
const LAYERS: usize = 8;

#[test]
fn backward_frees_the_activations_as_it_goes_and_refuses_a_second_run() {
    let mut rng = Rng::new(7);
    let mat = |rng: &mut Rng| Tensor::randn([N, N], 0.05, DType::F32, Device::Cpu, rng).unwrap();
    let x = mat(&mut rng);
    let ws: Vec<Tensor> = (0..LAYERS)
        .map(|_| {
            let w = mat(&mut rng);
            w.set_requires_grad(true).unwrap();
            w
        })
        .collect();
    // When the first layer's gradient is final, backward has run through every other op.
    let at_first_grad = Arc::new(Mutex::new(0usize));
    let seen = at_first_grad.clone();
    ws[0].register_hook(move |_| *seen.lock().unwrap() = live_bytes());
    let before = live_bytes();
    let mut h = x.clone();
    for w in &ws {
        h = h.matmul(w).unwrap().silu().unwrap(); // saves the matmul's input and the silu's
    }
    let loss = h.sum_all().unwrap();
    drop(h);
    let activations = live_bytes() - before;
    let (matrix, grads) = (N * N * 4, LAYERS * N * N * 4);
    assert!(activations >= 2 * LAYERS * matrix - matrix, "the forward saved {activations} bytes: the test measures nothing");
    loss.backward().unwrap();
    let held = *at_first_grad.lock().unwrap() - before;
    // Then: the gradients, the first layer's inputs and the gradient flowing into it.
    assert!(
        held <= grads + 4 * matrix,
        "with the loss alive, backward held {held} bytes at the first layer's gradient: the gradients are {grads}, \
         the forward saved {activations}"
    );
    let again = loss.backward().unwrap_err().to_string();
    assert!(again.contains("compute the loss again"), "a second backward: {again}");
}

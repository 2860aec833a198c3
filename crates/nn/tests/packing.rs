//! Packed rows ("Packing is exact", issue 42): several conversations laid one after another in
//! each row, positions restarting at 0 in each, attention kept inside each. On the CPU in f32 a
//! packed batch's loss and gradients equal the sum of its conversations run one by one (rel
//! 1e-6), for Llama, Ladder and with activation checkpointing; a conversation's logits do not
//! change with what sits next to it in its row (to the bit), nor from its logits run alone.
use ferrolm_nn::{Llama, Packing};
use ferrolm_ops::{LossScale, Tokens};
use ferrolm_tensor::{DType, Device, Rng, Tensor};
use ferrolm_testing::{max_rel, tiny_gqa32};

const CPU: Device = Device::Cpu;
const IGNORE: i32 = -100;

/// A conversation: its ids and aligned targets (some ignored, as outside assistant turns).
#[derive(Clone)]
struct Conv {
    ids: Vec<i32>,
    targets: Vec<i32>,
}

fn conv(len: usize, r: &mut Rng) -> Conv {
    let ids: Vec<i32> = (0..len).map(|_| r.below(64) as i32).collect();
    let targets = (0..len).map(|i| if i + 1 == len || r.below(3) == 0 { IGNORE } else { r.below(64) as i32 }).collect();
    Conv { ids, targets }
}

/// Rows of `t` tokens holding the given conversations in order, each row padded at its end
/// (padding is its own segment, never trained).
struct Packed {
    ids: Tokens,
    targets: Tokens,
    packing: Packing,
    /// (row, start) of each conversation.
    at: Vec<(usize, usize)>,
}

fn pack(rows: &[Vec<&Conv>], t: usize) -> Packed {
    let (mut ids, mut targets, mut positions, mut cu, mut at) = (vec![], vec![], vec![], vec![], vec![]);
    for (r, convs) in rows.iter().enumerate() {
        let mut row_cu = vec![0u32];
        for c in convs {
            at.push((r, row_cu.last().copied().unwrap() as usize));
            ids.extend(&c.ids);
            targets.extend(&c.targets);
            positions.extend(0..c.ids.len() as u32);
            row_cu.push(row_cu.last().unwrap() + c.ids.len() as u32);
        }
        let pad = t - *row_cu.last().unwrap() as usize;
        if pad > 0 {
            ids.extend(std::iter::repeat_n(0, pad));
            targets.extend(std::iter::repeat_n(IGNORE, pad));
            positions.extend(0..pad as u32);
            row_cu.push(t as u32);
        }
        cu.push(row_cu);
    }
    let b = rows.len();
    Packed {
        ids: Tokens::upload(ids, vec![b, t], CPU).unwrap(),
        targets: Tokens::upload(targets, vec![b, t], CPU).unwrap(),
        packing: Packing::new(t, &positions, cu, CPU).unwrap(),
        at,
    }
}

fn grads(m: &Llama) -> Vec<(String, Vec<f32>)> {
    m.parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap().to_vec::<f32>().unwrap())).collect()
}

fn zero_grads(m: &Llama) {
    for (_, p) in m.parameters() {
        p.zero_grad();
    }
}

/// Lengths that cross each other's ends, one of length 1, rows of 3 and 2 conversations with
/// padding, and a row filled exactly.
fn conversations(r: &mut Rng) -> (Vec<Conv>, Vec<Vec<usize>>, usize) {
    let convs: Vec<Conv> = [7, 1, 9, 12, 5, 4, 16].iter().map(|&l| conv(l, r)).collect();
    (convs, vec![vec![0, 1, 2], vec![3, 4], vec![5, 6]], 20)
}

#[test]
fn a_packed_batch_equals_its_conversations_one_by_one() {
    for (name, extra, ckpt) in [
        ("llama", "", false),
        ("llama checkpointed", "", true),
        ("ladder", r#","model_type":"llamaLadder","ladder_layers":2"#, false),
        ("mixed ladder checkpointed", r#","model_type":"llamaLadder","ladder_layers":[1]"#, true),
        // Sliding windows (shorter than most conversations) inside each packed conversation.
        ("mistral window 4", r#","model_type":"mistral","sliding_window":4"#, false),
        ("qwen2 window 3 checkpointed", QWEN2_WINDOW, true),
        ("gemma3 window 3", GEMMA3_WINDOW, false),
    ] {
        let mut m = Llama::new(tiny_gqa32(extra), DType::F32, CPU, &mut Rng::new(5)).unwrap();
        m.set_activation_checkpointing(ckpt);
        let (convs, rows, t) = conversations(&mut Rng::new(6));
        let p = pack(&rows.iter().map(|r| r.iter().map(|&i| &convs[i]).collect()).collect::<Vec<_>>(), t);
        // Sums over the trained tokens (the trainer's scale, `LossScale::Sum`), packed and one by
        // one: the head makes their gradients with no factor applied after it.
        let loss = m.loss_with(&p.ids, &p.targets, Some(&p.packing), LossScale::Sum(1.0)).unwrap();
        let sum = loss.item().unwrap();
        loss.backward().unwrap();
        let packed = grads(&m);
        zero_grads(&m);
        let mut want = 0.0;
        for c in &convs {
            let len = c.ids.len();
            let ids = Tensor::from_vec(c.ids.clone(), vec![1, len], CPU).unwrap();
            let tg = Tensor::from_vec(c.targets.clone(), vec![1, len], CPU).unwrap();
            let l = m.loss_with(&ids, &tg, None, LossScale::Sum(1.0)).unwrap();
            want += l.item().unwrap();
            l.backward().unwrap(); // accumulates over the conversations
        }
        let e = (sum - want).abs() / want.abs();
        assert!(e < 1e-6, "{name}: packed loss sum {sum} vs {want} one by one: rel {e:e}");
        for ((n, g), (_, w)) in packed.iter().zip(grads(&m)) {
            let e = max_rel(g, &w);
            assert!(e < 1e-6, "{name}: gradient of {n}: rel {e:e}");
        }
    }
}

/// A Qwen2 whose layer 1 slides with window 3, layer 0 full (max_window_layers 1).
const QWEN2_WINDOW: &str = r#","model_type":"qwen2","use_sliding_window":true,"sliding_window":3,"max_window_layers":1"#;

/// A Gemma 3 whose layer 0 slides with window 3 (its local RoPE base), layer 1 full.
const GEMMA3_WINDOW: &str = r#","model_type":"gemma3_text","head_dim":8,"query_pre_attn_scalar":8,"sliding_window":3,
    "layer_types":["sliding_attention","full_attention"],"rope_local_base_freq":100.0"#;

/// With sliding windows, a conversation's logits in a packed row are its logits alone: the
/// window counts from the conversation's own start, never reaching into its neighbour.
#[test]
fn a_windowed_conversations_logits_do_not_depend_on_its_neighbours() {
    for extra in [QWEN2_WINDOW, r#","model_type":"mistral","sliding_window":2"#, GEMMA3_WINDOW] {
        let m = Llama::new(tiny_gqa32(extra), DType::F32, CPU, &mut Rng::new(9)).unwrap();
        assert!(m.config().layer_windows().iter().any(|w| w.is_some()), "{extra}");
        let r = &mut Rng::new(10);
        let a = conv(9, r);
        let alone = m.forward(&Tensor::from_vec(a.ids.clone(), vec![1, 9], CPU).unwrap()).unwrap().to_vec::<f32>().unwrap();
        let others: Vec<Conv> = [5, 2].iter().map(|&l| conv(l, r)).collect();
        for rows in [vec![vec![&others[0], &a, &others[1]]], vec![vec![&others[1]], vec![&a, &others[0]]]] {
            let p = pack(&rows, 16);
            let logits = m.forward_packed(&p.ids, &p.packing).unwrap();
            let which = rows.iter().flatten().position(|c| std::ptr::eq(*c, &a)).unwrap();
            let (row, start) = p.at[which];
            let got = logits.narrow(0, row, 1).unwrap().narrow(1, start, 9).unwrap().contiguous().unwrap().to_vec::<f32>().unwrap();
            let e = max_rel(&got, &alone);
            assert!(e < 1e-6, "{extra}: at ({row}, {start}) the conversation's logits differ from alone: rel {e:e}");
        }
    }
}

/// A conversation's logits in a packed row are its logits alone (`forward` of it by itself), to
/// the bit, whatever its neighbours and wherever it sits in the row.
#[test]
fn neighbours_do_not_change_a_conversations_logits() {
    let m = Llama::new(tiny_gqa32(r#","model_type":"llamaLadder","ladder_layers":[0]"#), DType::F32, CPU, &mut Rng::new(7)).unwrap();
    let r = &mut Rng::new(8);
    let a = conv(6, r);
    let alone = m.forward(&Tensor::from_vec(a.ids.clone(), vec![1, 6], CPU).unwrap()).unwrap().to_vec::<f32>().unwrap();
    let others: Vec<Conv> = [3, 10, 1, 8].iter().map(|&l| conv(l, r)).collect();
    let layouts: Vec<Vec<Vec<&Conv>>> = vec![
        vec![vec![&a, &others[0]], vec![&others[1]]],
        vec![vec![&others[1], &a], vec![&others[0]]],
        vec![vec![&others[2]], vec![&others[0], &a, &others[2]]],
        vec![vec![&others[3], &others[2], &a]],
    ];
    for (i, rows) in layouts.iter().enumerate() {
        let p = pack(rows, 16);
        let logits = m.forward_packed(&p.ids, &p.packing).unwrap();
        let v = logits.dim(2);
        let which = rows.iter().flatten().position(|c| std::ptr::eq(*c, &a)).unwrap();
        let (row, start) = p.at[which];
        let got = logits.narrow(0, row, 1).unwrap().narrow(1, start, 6).unwrap().contiguous().unwrap().to_vec::<f32>().unwrap();
        assert_eq!(got.len(), 6 * v);
        let same = got.iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "layout {i}: the conversation's logits differ from its logits alone (max |d| {})", max_diff(&got, &alone));
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn bad_packings_are_refused() {
    let m = Llama::new(tiny_gqa32(""), DType::F32, CPU, &mut Rng::new(9)).unwrap();
    let ids = Tokens::upload(vec![1; 8], vec![2, 4], CPU).unwrap();
    let err = |p: ferrolm_tensor::Result<Packing>| p.unwrap_err().to_string();
    assert!(err(Packing::new(4, &[0, 1, 2], vec![vec![0, 4]], CPU)).contains("3 positions for 1 rows of 4 tokens"));
    assert!(err(Packing::new(4, &[0; 4], vec![vec![0, 3]], CPU)).contains("cu_seqlens must run from 0 to the row length 4"));
    let one_row = Packing::new(4, &[0, 1, 0, 1], vec![vec![0, 2, 4]], CPU).unwrap();
    let e = m.forward_packed(&ids, &one_row).unwrap_err().to_string();
    assert!(e.contains("ids must be i32 (1, 4) for a packing of 1 rows of 4 tokens"), "{e}");
    let far = Packing::new(4, &[0, 1, 2, 40, 0, 1, 2, 3], vec![vec![0, 4], vec![0, 4]], CPU).unwrap();
    let e = m.forward_packed(&ids, &far).unwrap_err().to_string();
    assert!(e.contains("packed position 40 exceeds max_position_embeddings 32"), "{e}");
    // Rows longer than the model's positions are fine while each sequence fits.
    let long: Vec<u32> = (0..40).map(|i| i % 20).collect();
    let p = Packing::new(40, &long, vec![vec![0, 20, 40]], CPU).unwrap();
    let ids = Tokens::upload(vec![3; 40], vec![1, 40], CPU).unwrap();
    assert_eq!(m.forward_packed(&ids, &p).unwrap().dims(), [1, 40, 64]);
}

mod common;

use std::collections::HashSet;

use common::{write_shard, Scratch};
use ferrolm_data::{eval_batches, Batch, DataLoader, LoaderState};

/// Two shards whose token at position p is its own "address", so windows are recognisable.
fn shards(dir: &Scratch) -> Vec<std::path::PathBuf> {
    vec![
        write_shard(dir.path(), "train_000000.bin", &(0..400).collect::<Vec<_>>()),
        write_shard(dir.path(), "train_000001.bin", &(1000..1250).collect::<Vec<_>>()),
    ]
}

fn take(loader: &mut DataLoader, n: usize) -> Vec<Batch> {
    (0..n).map(|_| loader.next_batch()).collect()
}

#[test]
fn targets_are_inputs_shifted_by_one() {
    let dir = Scratch::new("ld-shift");
    let mut l = DataLoader::open(&shards(&dir), 4, 16, 1).unwrap();
    for b in take(&mut l, 10) {
        assert_eq!((b.batch, b.seq, b.inputs.len(), b.targets.len()), (4, 16, 64, 64));
        for (x, y) in b.inputs.iter().zip(&b.targets) {
            assert_eq!(x + 1, *y); // tokens are consecutive ints within a shard
        }
    }
}

#[test]
fn same_seed_same_batches_different_seed_different() {
    let dir = Scratch::new("ld-seed");
    let paths = shards(&dir);
    let a = take(&mut DataLoader::open(&paths, 3, 8, 42).unwrap(), 20);
    let b = take(&mut DataLoader::open(&paths, 3, 8, 42).unwrap(), 20);
    let c = take(&mut DataLoader::open(&paths, 3, 8, 43).unwrap(), 20);
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn an_epoch_visits_every_window_once() {
    let dir = Scratch::new("ld-epoch");
    let mut l = DataLoader::open(&shards(&dir), 1, 16, 7).unwrap();
    // (400-1)/16 + (250-1)/16 = 24 + 15 windows
    assert_eq!(l.num_windows(), 39);
    let firsts: HashSet<i32> = take(&mut l, 39).iter().map(|b| b.inputs[0]).collect();
    assert_eq!(firsts.len(), 39);
    assert_eq!(l.epoch(), 0);
    let second: Vec<i32> = take(&mut l, 39).iter().map(|b| b.inputs[0]).collect();
    assert_eq!(l.epoch(), 1);
    assert_eq!(second.iter().copied().collect::<HashSet<_>>(), firsts, "same windows, new order");
}

#[test]
fn restore_replays_the_same_batches_across_epochs() {
    let dir = Scratch::new("ld-restore");
    let paths = shards(&dir);
    let mut a = DataLoader::open(&paths, 5, 8, 9).unwrap();
    take(&mut a, 13); // 65 windows of 80: mid first epoch
    let saved: LoaderState = serde_json::from_str(&serde_json::to_string(&a.state()).unwrap()).unwrap();
    let expected = take(&mut a, 40); // crosses into later epochs

    let mut b = DataLoader::open(&paths, 5, 8, 0).unwrap(); // seed comes from the state
    b.restore(&saved).unwrap();
    assert_eq!(take(&mut b, 40), expected);

    let mut wrong_seq = DataLoader::open(&paths, 5, 16, 9).unwrap();
    assert!(wrong_seq.restore(&saved).is_err());
}

#[test]
fn ranks_see_disjoint_windows() {
    let dir = Scratch::new("ld-rank");
    let paths = shards(&dir);
    let r0 = take(&mut DataLoader::open(&paths, 2, 16, 5).unwrap().for_rank(0, 2).unwrap(), 5);
    let r1 = take(&mut DataLoader::open(&paths, 2, 16, 5).unwrap().for_rank(1, 2).unwrap(), 5);
    let all = take(&mut DataLoader::open(&paths, 4, 16, 5).unwrap(), 5);
    for ((x, y), z) in r0.iter().zip(&r1).zip(&all) {
        let joined: Vec<i32> = x.inputs.iter().chain(&y.inputs).copied().collect();
        assert_eq!(joined, z.inputs, "ranks split the global batch in order");
    }
    assert!(DataLoader::open(&paths, 2, 16, 5).unwrap().for_rank(2, 2).is_err());
}

#[test]
fn eval_batches_cover_every_window_in_order() {
    let dir = Scratch::new("ld-eval");
    let batches: Vec<Batch> = eval_batches(&shards(&dir), 10, 16).unwrap().collect();
    let sizes: Vec<usize> = batches.iter().map(|b| b.batch).collect();
    assert_eq!(sizes, vec![10, 10, 10, 9]);
    let firsts: Vec<i32> = batches.iter().flat_map(|b| b.inputs.chunks(16).map(|r| r[0])).collect();
    let expected: Vec<i32> = (0..24).map(|k| k * 16).chain((0..15).map(|k| 1000 + k * 16)).collect();
    assert_eq!(firsts, expected);
}

#[test]
fn too_little_data_is_an_error_not_a_panic() {
    let dir = Scratch::new("ld-short");
    let short = write_shard(dir.path(), "s.bin", &(0..16).collect::<Vec<_>>());
    let err = DataLoader::open(&[&short], 2, 16, 0).err().unwrap().to_string();
    assert!(err.contains("not enough data"), "{err}");
    assert!(DataLoader::open(&[&short], 2, 15, 0).is_ok()); // exactly T+1 tokens
    let empty = write_shard(dir.path(), "e.bin", &[]);
    assert!(eval_batches(&[&empty], 2, 4).is_err());
    let none: [&str; 0] = [];
    assert!(DataLoader::open(&none, 2, 4, 0).is_err());
    assert!(DataLoader::open(&[dir.path().join("nope.bin")], 2, 4, 0).is_err());
    assert!(DataLoader::open(&[&short], 0, 4, 0).is_err());
}

//! Shared by the run-safety and CLI tests: a small prepared data set, a tiny model, short
//! training options, and a log capture.
#![allow(dead_code)]
use ferrolm::data::{list_shards, prepare_text_dir, Tokenizer};
use ferrolm::nn::LlamaConfig;
use ferrolm::train::{TrainOptions, Trainer};
use ferrolm::{DType, Device, Llama};
use ferrolm_tensor::Rng;
use ferrolm_testing::{gate, Need};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// The bundled data folder (`tokenizer.json`, `corpus/`), found at run time so that a test
/// binary run on another machine or from another folder (the GPU runner runs them from `.gpu/`,
/// with `data/` beside `bin/`) finds it: `$FERROLM_DATA_DIR` when set, else `./data`, else the
/// first `data/` holding `tokenizer.json` up from the binary's folder, then up from the working
/// directory, and only last the build machine's `CARGO_MANIFEST_DIR/data`.
pub fn data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERROLM_DATA_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let holds = |d: &Path| d.join("tokenizer.json").is_file();
    if holds(Path::new("data")) {
        return PathBuf::from("data");
    }
    let exe_dir = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf));
    let cwd = std::env::current_dir().ok();
    for start in [exe_dir, cwd].into_iter().flatten() {
        if let Some(d) = start.ancestors().map(|a| a.join("data")).find(|d| holds(d)) {
            return d;
        }
    }
    root().join("data")
}

/// `rel` inside the bundled data folder (`data_dir`).
pub fn data_path(rel: &str) -> PathBuf {
    data_dir().join(rel)
}

pub fn tokenizer_path() -> PathBuf {
    data_path("tokenizer.json")
}

/// A fresh, empty temporary directory unique to this test.
pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrolm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Shards of the sonnets (10% validation) in `dir/shards`: (train, val, vocab size).
pub fn shards(dir: &Path) -> (Vec<PathBuf>, Vec<PathBuf>, usize) {
    shards_with(dir, 0.1)
}

/// A test's scratch folder for the parallel runs: shards of the sonnets (`val_fraction`
/// validation) in `data`, and in `cfg` a config with 4 heads / 2 kv heads (kv < tp at tp 4),
/// untied, its vocabulary rounded up to a multiple of 4. Removed when the test passes, kept for a
/// look when it fails.
pub struct ParallelDir {
    pub dir: PathBuf,
    pub data: PathBuf,
    pub cfg: PathBuf,
}

impl ParallelDir {
    pub fn new(name: &str, val_fraction: f64) -> ParallelDir {
        let dir = tmp(name);
        let (train, _, vocab) = shards_with(&dir, val_fraction);
        let data = train[0].parent().unwrap().to_path_buf();
        let cfg = dir.join("config.json");
        let mut c = config(vocab.div_ceil(4) * 4, 2);
        c.tie_word_embeddings = false;
        std::fs::write(&cfg, c.to_json_string()).unwrap();
        ParallelDir { dir, data, cfg }
    }
}

impl Drop for ParallelDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

pub fn shards_with(dir: &Path, val_fraction: f64) -> (Vec<PathBuf>, Vec<PathBuf>, usize) {
    let tok = Tokenizer::from_file(tokenizer_path()).unwrap();
    let out = dir.join("shards");
    prepare_text_dir(data_path("corpus/sonnets.txt"), &tok, &out, val_fraction, 1 << 20).unwrap();
    (list_shards(&out, "train").unwrap(), list_shards(&out, "val").unwrap(), tok.vocab_size())
}

pub fn config(vocab: usize, layers: usize) -> LlamaConfig {
    LlamaConfig::from_json_str(&format!(
        r#"{{"model_type":"llama","vocab_size":{vocab},"hidden_size":32,"intermediate_size":64,"num_hidden_layers":{layers},
            "num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":64,"tie_word_embeddings":true}}"#
    ))
    .unwrap()
}

/// A tiny Llama checkpoint in `dir/model` (the [`config`] shape with positions for 128-token
/// rows) with the bundled tokenizer and chat template: what the chat fine-tuning tests train.
pub fn chat_model(dir: &Path) -> PathBuf {
    let tok = Tokenizer::from_file(tokenizer_path()).unwrap();
    chat_model_of(dir, LlamaConfig { max_position_embeddings: 128, ..config(tok.vocab_size(), 2) })
}

/// [`chat_model`] of another shape: a fresh `cfg` Llama (seed 1) in `dir/model`, with the
/// bundled tokenizer and chat template.
pub fn chat_model_of(dir: &Path, cfg: LlamaConfig) -> PathBuf {
    let ck = checkpoint(&dir.join("model"), cfg);
    std::fs::copy(data_path("chat_template.jinja"), ck.join("chat_template.jinja")).unwrap();
    ck
}

/// A fresh `cfg` Llama (f32, seed 1) saved in `ck` with the bundled tokenizer.json: a
/// checkpoint the tools take as `--model`.
pub fn checkpoint(ck: &Path, cfg: LlamaConfig) -> PathBuf {
    Llama::new(cfg, DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap().save_pretrained(ck).unwrap();
    std::fs::copy(tokenizer_path(), ck.join("tokenizer.json")).unwrap();
    ck.to_path_buf()
}

/// Token data for `--data`: the folder of [`shards_with`] (`val_fraction` held out) in
/// `dir/shards`, and the vocabulary size.
pub fn token_data(dir: &Path, val_fraction: f64) -> (PathBuf, usize) {
    let (train, _, vocab) = shards_with(dir, val_fraction);
    (train[0].parent().unwrap().to_path_buf(), vocab)
}

/// The first `n` lines of the bundled JSON-lines file `name` (`data/name`) in `dir/name`.
pub fn bundled_lines(dir: &Path, name: &str, n: usize) -> PathBuf {
    let text = std::fs::read_to_string(data_path(name)).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text.lines().take(n).map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    path
}

/// The first `bytes` bytes of the sonnets in `dir/few_sonnets.txt`: a text `eval --text` scores
/// in a few windows.
pub fn few_sonnets(dir: &Path, bytes: usize) -> PathBuf {
    let text = dir.join("few_sonnets.txt");
    std::fs::write(&text, &std::fs::read_to_string(data_path("corpus/sonnets.txt")).unwrap()[..bytes]).unwrap();
    text
}

/// The JSON file `path`; panics naming it where it cannot be read or parsed.
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Mean loss of `model` on the first windows of the sonnets.
pub fn sonnet_loss(model: &Llama) -> f64 {
    let tok = Tokenizer::from_file(tokenizer_path()).unwrap();
    let text = std::fs::read_to_string(data_path("corpus/sonnets.txt")).unwrap();
    let ids = tok.encode(&text[..4000], false).unwrap();
    ferrolm::eval::mean_loss(model, &ids, 16, 4, Device::Cpu).unwrap().loss
}

pub fn model(vocab: usize) -> Llama {
    Llama::new(config(vocab, 2), DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap()
}

pub fn opts(steps: usize) -> TrainOptions {
    TrainOptions {
        steps,
        batch_size: 2,
        seq_len: 16,
        grad_accum: 1,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 1,
        weight_decay: 0.1,
        grad_clip: 1.0,
        eval_every: 0,
        eval_batches: 2,
        save_every: 0,
        log_every: 100,
        seed: 7,
    }
}

pub fn trainer(dir: &Path, out: &str, o: TrainOptions) -> Trainer {
    let (train, val, vocab) = shards(dir);
    Trainer::new(model(vocab), &train, &val, o, &dir.join(out)).unwrap().with_tokenizer(&tokenizer_path())
}

/// Every file under `dir` with its bytes, sorted: two snapshots are equal when nothing was
/// added, removed or rewritten.
pub fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

pub fn latest(run: &Path) -> String {
    std::fs::read_to_string(run.join("checkpoints/latest")).unwrap().trim().to_string()
}

pub fn checkpoint_names(run: &Path) -> Vec<String> {
    let mut v: Vec<String> = match std::fs::read_dir(run.join("checkpoints")) {
        Ok(rd) => rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n != "latest").collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

#[derive(Clone, Default)]
pub struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuf {
    type Writer = LogBuf;
    fn make_writer(&'a self) -> LogBuf {
        self.clone()
    }
}

/// Runs `f` with this thread's log lines (info and up) captured: (its result, the log text).
pub fn capture_logs<R>(f: impl FnOnce() -> R) -> (R, String) {
    let buf = LogBuf::default();
    let sub = ferrolm::logging::subscriber(tracing_subscriber::EnvFilter::new("info"), buf.clone());
    let r = tracing::subscriber::with_default(sub, f);
    let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    (r, text)
}

/// `pretrain_llama`'s flags for a short CPU run of `cfg` on `data` into `out` (sequences of 16
/// tokens), followed by `extra`.
pub fn pretrain_args(data: &Path, cfg: &Path, out: &Path, extra: &[&str]) -> ferrolm::cli::pretrain::PretrainArgs {
    let paths = [flag("data", data), flag("config", cfg), flag("out", out)];
    ferrolm::cli::parse_from(args(&["pretrain_llama", "--device=cpu", "--seq-len=16"], &paths, extra)).unwrap()
}

/// `--name=PATH`.
pub fn flag(name: &str, path: &Path) -> String {
    format!("--{name}={}", path.display())
}

/// A command line: `head`, then `paths` (see [`flag`]), then `extra`.
pub fn args(head: &[&str], paths: &[String], extra: &[&str]) -> Vec<String> {
    head.iter().map(|s| s.to_string()).chain(paths.iter().cloned()).chain(extra.iter().map(|s| s.to_string())).collect()
}

/// A training tool's command line: `head`, then `--model=ck --data=data --out=out`, then `extra`.
pub fn run_args(head: &[&str], ck: &Path, data: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    args(head, &[flag("model", ck), flag("data", data), flag("out", out)], extra)
}

/// The `loss` of each line of `run`/metrics.jsonl that has one, in order (none when the file
/// is missing: the caller's comparison then reports the empty curve).
pub fn losses(run: &Path) -> Vec<f64> {
    values_of(&std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default(), "loss")
}

/// The number `key` of each line of `run`/metrics.jsonl that has one, in order; panics, naming
/// the file, where it cannot be read (a run that wrote no metrics is a failure here).
pub fn metric(run: &Path, key: &str) -> Vec<f64> {
    let path = run.join("metrics.jsonl");
    values_of(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())), key)
}

/// The number `key` of each JSON line of `text` that has one.
fn values_of(text: &str, key: &str) -> Vec<f64> {
    text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get(key)?.as_f64()).collect()
}

/// Two loss curves of the same length that agree step by step within `tol` relative to `b`.
pub fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (s, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * y.abs(), "{what}: step {}: {x} vs {y}", s + 1);
    }
}

/// Each of `layouts` (a run name and its flags) trains as one device does (`--batch-size=4`):
/// the step losses within 1e-5. `run(name, flags)` trains a run and returns its losses.
pub fn layouts_follow_one_device(run: impl Fn(&str, &[&str]) -> Vec<f64>, layouts: &[(&str, &[&str])]) {
    let one = run("one", &["--batch-size=4"]);
    for (out, flags) in layouts {
        close(&run(out, flags), &one, 1e-5, out);
    }
}

/// `generate` of four tokens after "Shall I" by the checkpoint `ck` on the CPU, with `extra`'s
/// flags.
pub fn generate_a_few(ck: &Path, extra: &[&str]) -> anyhow::Result<()> {
    let head = ["generate", "--device=cpu", "--prompt=Shall I", "--max-new-tokens=4"];
    let g: ferrolm::cli::generate::GenerateArgs = ferrolm::cli::parse_from(args(&head, &[flag("model", ck)], extra)).unwrap();
    ferrolm::cli::generate::run(g)
}

/// The `run(name, flags)` that [`layouts_follow_one_device`] takes: `train(out, flags)` trains
/// `dir/name` with `common` and then `flags`, and its losses are returned.
pub fn runs_in<'a>(
    dir: &'a Path,
    common: &'a [&'a str],
    train: impl Fn(&Path, &[&str]) -> anyhow::Result<()> + 'a,
) -> impl Fn(&str, &[&str]) -> Vec<f64> + 'a {
    move |name, flags| {
        let out = dir.join(name);
        let all: Vec<&str> = common.iter().chain(flags).copied().collect();
        train(&out, &all).unwrap();
        losses(&out)
    }
}

/// `cuda:0` once [`cuda0`] has registered it; `None` when the test skips.
pub fn cuda0_device() -> Option<Device> {
    cuda0().then_some(Device::Cuda(0))
}

/// Registers `cuda:0`: the GPU if there is one, else the emulator. False (the test says on
/// stderr that it skipped) only when neither is available, through `ferrolm_testing::gate`
/// (`Need::Device`: a failure instead under FERROLM_REQUIRE_EMU=1 or FERROLM_REQUIRE_GPU=1, which
/// also refuses the emulator in place of a GPU).
pub fn cuda0() -> bool {
    let gpu = ferrolm_cuda::device_count() > 0;
    if !gpu {
        gate::no_gpu_visible();
        std::env::set_var("FERROLM_CUDA_EMULATOR", "1");
    }
    match ferrolm::init_cuda(0) {
        Ok(()) => true,
        Err(e) if gpu => panic!("a GPU is visible but the CUDA backend did not start: {e}"),
        Err(e) => {
            gate::skip(Need::Device, format!("no CUDA device and no emulator ({e})"));
            false
        }
    }
}

/// Token shards of the sonnets in a scratch folder, shared by a test binary's runs.
pub struct Data {
    pub dir: PathBuf,
    pub train: Vec<PathBuf>,
    pub val: Vec<PathBuf>,
    pub vocab: usize,
}

/// [`shards`] of the sonnets in `tmp(name)`.
pub fn data(name: &str) -> Data {
    let dir = tmp(name);
    let (train, val, vocab) = shards(&dir);
    Data { dir, train, val, vocab }
}

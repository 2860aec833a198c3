//! Hugging Face PEFT's adapter format, both ways: `adapter_config.json` (`peft_type` `LORA`, `r`,
//! `lora_alpha`, `target_modules`, ...) and `adapter_model.safetensors`, whose tensors are named
//! `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` and so on
//! (`PeftModel.from_pretrained(base, dir)` loads what `save_adapter` writes).
//!
//! Reading follows PEFT's own matching (`check_target_module_exists`): `target_modules` as a list
//! (a module whose name is an entry, or ends with `.` + an entry) or as a regular expression
//! matched against the whole name; `exclude_modules` the same way; `layers_to_transform` (with
//! `layers_pattern`) for list entries matched by suffix. What ferrolm does not implement is
//! refused, naming the field: DoRA, `bias` other than `none`, `modules_to_save`, per-module
//! ranks or alphas, adapters on the embedding or the head, and any tensor or shape that does not
//! fit the base model.
use super::{factor_name, merged_weight, LoraConfig, Proj};
use crate::config::LlamaConfig;
use crate::module::Factor;
use crate::safetensors_io::{
    f32_to_stored, load_float_safetensors, model_weight_files, prepare_dir, rewrite_stored, save_safetensors, stored_to_f32, write_atomic,
    TensorMap,
};
use crate::Llama;
use ferrolm_tensor::{DType, Device, Error, Result, Rng, Tensor};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// What PEFT's `PeftModelForCausalLM` puts before a transformers parameter name.
pub const PREFIX: &str = "base_model.model.";

/// Whether `dir` holds a PEFT adapter (its `adapter_config.json`).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// Writes `adapter_config.json` and `adapter_model.safetensors` (f32) into `dir` for the
/// adapters `tensors` (full, with `factor_name`s) of `cfg`, trained on the base model
/// `base` (its path, PEFT's `base_model_name_or_path`). Files are written atomically.
pub fn save_adapter(dir: &Path, cfg: &LoraConfig, base: &str, tensors: &[(String, Tensor)]) -> Result<()> {
    let named: Vec<(String, Tensor)> = tensors.iter().map(|(n, t)| (format!("{PREFIX}{n}"), t.clone())).collect();
    let path = prepare_dir(dir, ADAPTER_WEIGHTS)?;
    save_safetensors(&path, &named, Some(DType::F32))?;
    write_atomic(&dir.join(ADAPTER_CONFIG), config_json(cfg, base).as_bytes())
}

/// `adapter_config.json` for `cfg`, with the fields PEFT writes (defaults for the ones ferrolm
/// has no use for), keys sorted as PEFT sorts them.
pub fn config_json(cfg: &LoraConfig, base: &str) -> String {
    let targets: Vec<&str> = cfg.targets.iter().map(|p| p.module()).collect();
    let alpha = if cfg.alpha.fract() == 0.0 && cfg.alpha.abs() < 1e15 { json!(cfg.alpha as i64) } else { json!(cfg.alpha) };
    let v = json!({
        "alpha_pattern": {},
        "base_model_name_or_path": base,
        "bias": "none",
        "exclude_modules": null,
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": cfg.layers,
        "lora_alpha": alpha,
        "lora_bias": false,
        "lora_dropout": cfg.dropout,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": cfg.rank,
        "rank_pattern": {},
        "revision": null,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": cfg.rslora,
    });
    let mut s = serde_json::to_string_pretty(&v).expect("a JSON value serialises");
    s.push('\n');
    s
}

/// How `target_modules` or `exclude_modules` picks module names.
enum Matcher {
    /// A list: a name that is an entry or ends with `.entry`.
    List(Vec<String>),
    /// A string: a regular expression the whole name must match.
    Regex(regex::Regex),
}

impl Matcher {
    fn parse(v: &Value, field: &str, err: &dyn Fn(String) -> Error) -> Result<Option<Matcher>> {
        match v {
            Value::Null => Ok(None),
            Value::String(s) => {
                let re = regex::Regex::new(&format!("^(?:{s})$"))
                    .map_err(|e| err(format!("field `{field}`: {s:?} is not a regular expression: {e}")))?;
                Ok(Some(Matcher::Regex(re)))
            }
            Value::Array(a) => {
                let names = a.iter().map(|x| x.as_str().map(str::to_string)).collect::<Option<Vec<_>>>();
                names.map(|n| Some(Matcher::List(n))).ok_or_else(|| err(format!("field `{field}` must hold strings, got {v}")))
            }
            other => Err(err(format!("field `{field}` must be a list of module names or a regular expression, got {other}"))),
        }
    }

    /// How `key` matches: None, by its whole name (an exact list entry or the regex), or by a
    /// list entry it ends with (only then does `layers_to_transform` apply, as in PEFT).
    fn find(&self, key: &str) -> Option<bool> {
        match self {
            Matcher::Regex(re) => re.is_match(key).then_some(false),
            Matcher::List(l) if l.iter().any(|t| t == key) => Some(false),
            Matcher::List(l) => l.iter().any(|t| key.ends_with(&format!(".{t}"))).then_some(true),
        }
    }

    /// The list entries no name in `keys` matches.
    fn unmatched<'a>(&'a self, keys: &[String]) -> Vec<&'a str> {
        match self {
            Matcher::Regex(_) => Vec::new(),
            Matcher::List(l) => {
                l.iter().filter(|t| !keys.iter().any(|k| k == *t || k.ends_with(&format!(".{t}")))).map(String::as_str).collect()
            }
        }
    }
}

/// Every module name of a model of config `base`, as transformers' `named_modules` gives them
/// (the parameters' modules from its spec), and which linear layer each is (None: not one
/// ferrolm adapts).
fn module_names(base: &LlamaConfig) -> Vec<(String, Option<(usize, Proj)>)> {
    let mut out: Vec<(String, Option<(usize, Proj)>)> =
        ["", "model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
            .iter()
            .map(|n| (n.to_string(), None))
            .collect();
    for l in 0..base.num_hidden_layers {
        for m in ["", ".self_attn", ".mlp", ".mlp.act_fn"] {
            out.push((format!("model.layers.{l}{m}"), None));
        }
        for s in base.layer_specs(l) {
            if out.last().is_some_and(|(m, _)| m == s.module()) {
                continue; // a bias after its weight
            }
            let site = Proj::ALL.into_iter().find(|p| p.is(s.lora_target)).map(|p| (l, p));
            out.push((s.module().to_string(), site));
        }
    }
    out
}

/// Reads the PEFT adapter in `dir` for a base model of config `base` (`dir` is only named in
/// errors): its settings, and its factors as f32 on `device` under their `factor_name`s. Every
/// field ferrolm cannot honour, every tensor that is missing, extra or of the wrong shape is an
/// error naming the file and the field or tensor.
pub fn read_adapter(dir: &Path, base: &LlamaConfig, device: Device) -> Result<(LoraConfig, TensorMap)> {
    let cfg_path = dir.join(ADAPTER_CONFIG);
    let cerr = |m: String| Error::new("lora adapter", format!("{}: {m}", cfg_path.display()));
    if !cfg_path.is_file() {
        return Err(Error::new("lora adapter", format!("{} has no {ADAPTER_CONFIG}: not a PEFT adapter directory", dir.display())));
    }
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| cerr(format!("cannot read: {e}")))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| cerr(format!("invalid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| cerr("not a JSON object".into()))?;
    let (cfg, sites) = parse_config(obj, base, &cerr)?;

    let w_path = dir.join(ADAPTER_WEIGHTS);
    let werr = |m: String| Error::new("lora adapter", format!("{}: {m}", w_path.display()));
    if !w_path.is_file() {
        let hint = if dir.join("adapter_model.bin").is_file() {
            " (adapter_model.bin, a pickle, is not read: save with safe_serialization)"
        } else {
            ""
        };
        return Err(werr(format!("missing{hint}")));
    }
    let mut file = load_float_safetensors(&w_path, DType::F32, device)?;
    let based = obj
        .get("base_model_name_or_path")
        .and_then(Value::as_str)
        .map(|b| format!(" (its base_model_name_or_path is {b:?})"))
        .unwrap_or_default();
    let (shapes, mut out) = (base.linear_shapes(), TensorMap::new());
    for &(l, p) in &sites {
        let Some(&(_, (o, i))) = shapes.iter().find(|(t, _)| p.is(Some(t))) else {
            return Err(werr(format!("this base has no {} layer", p.module())));
        };
        for (f, want) in [(Factor::A, [cfg.rank, i]), (Factor::B, [o, cfg.rank])] {
            let name = factor_name(l, p, f);
            let key = format!("{PREFIX}{name}");
            let t = file
                .remove(&key)
                .ok_or_else(|| werr(format!("missing tensor `{key}`: adapter_config.json's target_modules adapt {}", p.module())))?;
            // The base's side fits but the rank does not: adapter_config.json's `r` disagrees
            // with the factors beside it (an edited or mismatched config), not another base.
            let (rank_dim, base_dim) = match f {
                Factor::A => (0, 1),
                Factor::B => (1, 0),
            };
            if t.dims().len() == 2 && t.dims()[base_dim] == want[base_dim] && t.dims()[rank_dim] != cfg.rank {
                return Err(werr(format!(
                    "tensor `{key}` has shape {:?}, rank {}, but {ADAPTER_CONFIG} has `r` {}: the config and the weights \
                     disagree (set `r` to the rank the adapter was trained with)",
                    t.dims(),
                    t.dims()[rank_dim],
                    cfg.rank
                )));
            }
            if t.dims() != want {
                return Err(werr(format!(
                    "tensor `{key}` has shape {:?}, but r = {} on this base's {} ({o} x {i}) needs {want:?}: an adapter for another base model{based}?",
                    t.dims(),
                    cfg.rank,
                    p.module()
                )));
            }
            out.insert(name, t);
        }
    }
    if let Some(extra) = file.keys().next() {
        let why = if extra.contains("lora_magnitude_vector") {
            "a DoRA magnitude (DoRA is not supported)".to_string()
        } else {
            format!("not an adapter factor of a module adapter_config.json's target_modules select on this base{based}")
        };
        return Err(werr(format!("unexpected tensor `{extra}`: {why}")));
    }
    Ok((cfg, out))
}

/// The adapter's settings and the (layer, projection) pairs it adapts on this base.
fn parse_config(obj: &Map<String, Value>, base: &LlamaConfig, err: &dyn Fn(String) -> Error) -> Result<(LoraConfig, Vec<(usize, Proj)>)> {
    let get = |k: &str| obj.get(k).unwrap_or(&Value::Null);
    let set = |k: &str| match get(k) {
        Value::Null | Value::Bool(false) => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::String(s) => !s.is_empty(),
        _ => true,
    };
    match get("peft_type").as_str() {
        Some("LORA") => {}
        other => {
            return Err(err(format!(
                "field `peft_type` is {}, not \"LORA\": only LoRA adapters are read",
                other.map_or("missing".into(), |s| format!("{s:?}"))
            )))
        }
    }
    if get("use_dora").as_bool() == Some(true) {
        return Err(err("field `use_dora` is true: DoRA adapters are not supported".into()));
    }
    match get("bias") {
        Value::Null => {}
        Value::String(s) if s == "none" => {}
        b => return Err(err(format!("field `bias` is {b}: only \"none\" is supported (ferrolm's linear layers have no bias)"))),
    }
    let refuse = [
        ("modules_to_save", "fully trained extra modules are not supported"),
        ("rank_pattern", "per-module ranks are not supported"),
        ("alpha_pattern", "per-module alphas are not supported"),
        ("fan_in_fan_out", "it is for Conv1D layers (GPT-2), a Llama has none"),
        ("lora_bias", "a bias on lora_B is not supported"),
        ("target_parameters", "adapters on parameters are not supported"),
        ("trainable_token_indices", "trainable token embeddings are not supported"),
        ("layer_replication", "layer replication is not supported"),
        ("use_qalora", "QALoRA is not supported"),
        ("alora_invocation_tokens", "activated LoRA is not supported"),
    ];
    for (k, why) in refuse {
        if set(k) {
            return Err(err(format!("field `{k}` is {}: {why}", get(k))));
        }
    }
    match get("task_type") {
        Value::Null => {}
        Value::String(s) if s == "CAUSAL_LM" => {}
        t => return Err(err(format!("field `task_type` is {t}: only \"CAUSAL_LM\" adapters fit a causal language model"))),
    }
    let rank = match get("r") {
        Value::Number(n) if n.as_u64().is_some_and(|r| r >= 1) => n.as_u64().unwrap_or(0) as usize,
        r => return Err(err(format!("field `r` must be a positive integer, got {r}"))),
    };
    let num = |k: &str, default: f64| -> Result<f64> {
        match get(k) {
            Value::Null => Ok(default),
            v => v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| err(format!("field `{k}` must be a number, got {v}"))),
        }
    };
    let alpha = num("lora_alpha", 8.0)?; // PEFT's default
    let dropout = num("lora_dropout", 0.0)?;
    if !(0.0..1.0).contains(&dropout) {
        return Err(err(format!("field `lora_dropout` must be in [0, 1), got {dropout}")));
    }
    let rslora = match get("use_rslora") {
        Value::Null => false,
        v => v.as_bool().ok_or_else(|| err(format!("field `use_rslora` must be true or false, got {v}")))?,
    };

    // Which modules the adapter sits on, as PEFT decides it for this base.
    let n = base.num_hidden_layers;
    let targets = match Matcher::parse(get("target_modules"), "target_modules", err)? {
        Some(m) => m,
        None => Matcher::List(vec!["q_proj".into(), "v_proj".into()]), // PEFT's default for a Llama
    };
    let exclude = Matcher::parse(get("exclude_modules"), "exclude_modules", err)?;
    let layer_filter = layer_filter(get("layers_to_transform"), get("layers_pattern"), err)?;
    let modules = module_names(base);
    let names: Vec<String> = modules.iter().map(|(k, _)| k.clone()).collect();
    let mut sites = Vec::new();
    for (key, site) in &modules {
        if exclude.as_ref().is_some_and(|e| e.find(key).is_some()) {
            continue;
        }
        let Some(by_suffix) = targets.find(key) else { continue };
        if by_suffix {
            if let Some(f) = &layer_filter {
                if !f(key) {
                    continue;
                }
            }
        }
        match site {
            Some(s) => sites.push(*s),
            None => {
                return Err(err(format!(
                    "field `target_modules` selects `{key}`, which is not one of the linear layers ferrolm adapts (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj in each block)"
                )))
            }
        }
    }
    if sites.is_empty() {
        let missing = targets.unmatched(&names);
        let list = if missing.is_empty() { String::new() } else { format!(" ({} not found)", missing.join(", ")) };
        return Err(err(format!("field `target_modules` selects no linear layer of this base model{list}: an adapter for another base?")));
    }
    sites.sort();
    // ferrolm's adapters are the same projections in each adapted block.
    let projs: BTreeSet<Proj> = sites.iter().map(|s| s.1).collect();
    let layers: BTreeSet<usize> = sites.iter().map(|s| s.0).collect();
    if sites.len() != projs.len() * layers.len() {
        return Err(err(format!(
            "field `target_modules` adapts different projections in different blocks ({}): ferrolm adapts the same ones in every adapted block",
            sites.iter().map(|(l, p)| format!("{l}.{}", p.module())).collect::<Vec<_>>().join(", ")
        )));
    }
    let cfg = LoraConfig {
        rank,
        alpha,
        dropout,
        targets: projs.into_iter().collect(),
        rslora,
        layers: (layers.len() != n).then(|| layers.into_iter().collect()),
    };
    Ok((cfg, sites))
}

type LayerFilter = Box<dyn Fn(&str) -> bool>;

/// PEFT's `layers_to_transform` (an index or a list) with `layers_pattern`: whether a module
/// name's block index (the first `<pattern>.<N>.` in it) is selected. None: every block.
fn layer_filter(layers: &Value, pattern: &Value, err: &dyn Fn(String) -> Error) -> Result<Option<LayerFilter>> {
    let wanted: Vec<usize> = match layers {
        Value::Null => return Ok(None),
        Value::Array(a) if a.is_empty() => return Ok(None),
        Value::Number(n) => {
            vec![n.as_u64().ok_or_else(|| err(format!("field `layers_to_transform` must hold layer indices, got {layers}")))? as usize]
        }
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_u64().map(|i| i as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| err(format!("field `layers_to_transform` must hold layer indices, got {layers}")))?,
        other => return Err(err(format!("field `layers_to_transform` must be an index or a list of them, got {other}"))),
    };
    let patterns: Vec<String> = match pattern {
        Value::Null => Vec::new(),
        Value::String(s) if s.is_empty() => Vec::new(),
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect(),
        other => return Err(err(format!("field `layers_pattern` must be a string or a list, got {other}"))),
    };
    let res: Vec<regex::Regex> = match patterns.is_empty() {
        true => vec![regex::Regex::new(r"^.*?\.[^.]*\.(\d+)\.").expect("a valid pattern")],
        false => patterns
            .iter()
            .map(|p| {
                regex::Regex::new(&format!(r"^(?:|.*?\.){p}\.(\d+)\.")).map_err(|e| err(format!("field `layers_pattern`: {p:?}: {e}")))
            })
            .collect::<Result<_>>()?,
    };
    Ok(Some(Box::new(move |key: &str| {
        let idx = res.iter().find_map(|re| re.captures(key)).and_then(|c| c.get(1)).and_then(|m| m.as_str().parse::<usize>().ok());
        idx.is_some_and(|i| wanted.contains(&i))
    })))
}

impl Llama {
    /// Adds the PEFT adapter in `dir` (read with `read_adapter`, checked against this model) to
    /// the model, frozen base and trainable factors, as `add_lora` would with its values.
    pub fn load_adapter(&mut self, dir: &Path) -> Result<LoraConfig> {
        let (cfg, tensors) = read_adapter(dir, self.config(), self.device())?;
        // The values are replaced below; the generator only fills what they replace.
        self.add_lora(&cfg, &mut Rng::new(0))?;
        let _g = ferrolm_tensor::no_grad();
        self.visit_adapters_mut(&mut |p, t| {
            let src = tensors.get(p.name).ok_or_else(|| Error::new("load_adapter", format!("no tensor for {}", p.name)))?;
            t.assign(src)
        })?;
        Ok(cfg)
    }

    /// Writes this model's adapters (whole, on one rank) to `dir` in PEFT's format; `base` is
    /// the base model's path, PEFT's `base_model_name_or_path`.
    pub fn save_adapter(&self, dir: &Path, base: &str) -> Result<()> {
        let cfg = self.lora_config().ok_or_else(|| Error::new("save_adapter", "the model has no LoRA adapters"))?;
        save_adapter(dir, cfg, base, &self.adapters())
    }
}

/// Folds the PEFT adapter in `adapter` into the stored weights of the Hugging Face model
/// directory `base` (config `cfg`) and writes the weight files into the directory `out`: each
/// file as the base stores it (its name, tensors, dtypes, shapes and metadata; the shards and
/// their index), each adapted weight W replaced by W + s B A, computed in f32 from W's stored
/// value (`merged_weight`, as `Llama::merge_lora`) and rounded once to W's stored dtype. One
/// weight at a time: memory holds a file's adapted weights, not the model. Returns the adapter's
/// settings and the file names written.
pub fn merge_adapter_files(base: &Path, cfg: &LlamaConfig, adapter: &Path, out: &Path) -> Result<(LoraConfig, Vec<String>)> {
    let (lora, mut factors) = read_adapter(adapter, cfg, Device::Cpu)?;
    let scale = lora.scale();
    let mut sites: BTreeMap<String, (Tensor, Tensor)> = BTreeMap::new();
    for l in 0..cfg.num_hidden_layers {
        for p in Proj::ALL {
            if let (Some(a), Some(b)) = (factors.remove(&factor_name(l, p, Factor::A)), factors.remove(&factor_name(l, p, Factor::B))) {
                sites.insert(format!("model.layers.{l}.{}.weight", p.path()), (a, b));
            }
        }
    }
    let mut written = Vec::new();
    let _g = ferrolm_tensor::no_grad();
    for file in model_weight_files(base)? {
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let ferr = |m: String| Error::new("merge", format!("{}: {m}", file.display()));
        rewrite_stored(&file, &out.join(&name), &mut |t| {
            let Some((a, b)) = sites.remove(t.name) else { return Ok(None) };
            let want = [b.dim(0), a.dim(1)];
            if t.shape != want {
                return Err(ferr(format!("weight `{}` has shape {:?}, but the adapter's factors need {want:?}", t.name, t.shape)));
            }
            let w = stored_to_f32(t.dtype, t.data).map_err(|e| ferr(format!("weight `{}`: {e}", t.name)))?;
            let m = merged_weight(&Tensor::from_vec(w, t.shape.to_vec(), Device::Cpu)?, &a, &b, scale)?;
            f32_to_stored(t.dtype, &m.to_vec_f32()?).map(Some).map_err(|e| ferr(format!("weight `{}`: {e}", t.name)))
        })?;
        written.push(name);
    }
    let index = base.join("model.safetensors.index.json");
    if !base.join("model.safetensors").is_file() && index.is_file() {
        let to = out.join("model.safetensors.index.json");
        std::fs::copy(&index, &to).map_err(|e| Error::new("merge", format!("cannot copy {} to {}: {e}", index.display(), to.display())))?;
        written.push("model.safetensors.index.json".to_string());
    }
    if let Some(missing) = sites.keys().next() {
        return Err(Error::new(
            "merge",
            format!("{}: no stored weight `{missing}`, which the adapter {} adapts", base.display(), adapter.display()),
        ));
    }
    Ok((lora, written))
}

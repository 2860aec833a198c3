//! The modelling code that lets transformers load a Ladder checkpoint: `config.json` names it in
//! `auto_map` (`configuration_llama_ladder.LlamaLadderConfig`,
//! `modeling_llama_ladder.LlamaLadderForCausalLM`), and every writer of a Ladder checkpoint puts
//! these two files beside it, so `AutoModelForCausalLM.from_pretrained(dir,
//! trust_remote_code=True)` works with nothing else to fetch. The files are ferrolm's own, on
//! transformers' Llama modules; `scripts/make_ladder_fixtures.py` checks them against the Ladder
//! fixtures' references (logits, loss, KV-cached generation).
use crate::config::LlamaConfig;
use crate::safetensors_io::write_atomic;
use ferrolm_tensor::Result;
use std::path::Path;

/// `configuration_llama_ladder.py`: `LlamaLadderConfig`, a Llama config plus `ladder_layers`.
pub const CONFIGURATION_PY: &str = include_str!("ladder_hf/configuration_llama_ladder.py");
/// `modeling_llama_ladder.py`: `LlamaLadderForCausalLM`, the Ladder residual order over
/// transformers' Llama modules.
pub const MODELING_PY: &str = include_str!("ladder_hf/modeling_llama_ladder.py");

/// The files, by name.
pub const FILES: [(&str, &str); 2] = [("configuration_llama_ladder.py", CONFIGURATION_PY), ("modeling_llama_ladder.py", MODELING_PY)];

/// How a user loads such a checkpoint in transformers, for logs and errors.
pub const HOW_TO_LOAD: &str = "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)";

/// Writes the modelling files into `dir` when `cfg` is a Ladder model of a Llama (its
/// `config.json`'s `auto_map` names them); nothing for a plain model or another family's Ladder.
pub fn write_remote_code(dir: &Path, cfg: &LlamaConfig) -> Result<()> {
    // The files compute Llama blocks: a Ladder model of another family gets none (and its
    // config no auto_map).
    if cfg.ladder_layers.is_none() || cfg.family != crate::config::Family::Llama {
        return Ok(());
    }
    for (name, text) in FILES {
        write_atomic(&dir.join(name), text.as_bytes())?;
    }
    Ok(())
}

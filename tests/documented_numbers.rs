//! The figures the guides quote that do not depend on how long a run trains, recomputed from
//! the commands the guides show (tests/documented_commands.rs runs those commands shrunk, so it
//! cannot check what they print): LORA.md's trainable share of its worked example,
//! FINETUNING.md's packing of the bundled chat file, PREFERENCE.md's summary of the bundled
//! preference pairs, and LORA.md's memory tables. Each test first finds the command in the
//! guide, so a changed command fails here until its figures are regenerated.
mod common;
use common::*;
use ferrolm::cli::finetune::FinetuneArgs;
use ferrolm::cli::parse_from;
use ferrolm::data::Tokenizer;
use ferrolm::nn::{Llama, LlamaConfig, LoraConfig, Proj};
use ferrolm::{DType, Device};
use ferrolm_tensor::Rng;

fn guide(name: &str) -> String {
    let path = root().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The guide's text with each line's leading spaces and a trailing `\` taken out, so a command
/// wrapped over lines reads as one.
fn joined(text: &str) -> String {
    text.lines().map(|l| l.trim().trim_end_matches('\\').trim_end()).collect::<Vec<_>>().join(" ")
}

/// The tokenizer the README's first run trains with, and its model (the `tiny` preset sized to
/// that tokenizer, as `pretrain_llama` sizes a preset).
fn readme_model() -> (Tokenizer, Llama) {
    let tokenizer = Tokenizer::from_file(tokenizer_path()).unwrap();
    let cfg = LlamaConfig { vocab_size: tokenizer.vocab_size(), ..LlamaConfig::preset("tiny").unwrap() };
    let model = Llama::new(cfg, DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
    (tokenizer, model)
}

#[test]
fn lora_guides_trainable_share_is_its_commands() {
    let text = guide("docs/LORA.md");
    let command =
        "--model runs/pretrain_llama --chat-template data/chat_template.jinja --lora-rank 8 --steps 60 --merge-lora --out runs/lora";
    assert!(joined(&text).contains(command), "docs/LORA.md's worked example is no longer `finetune {command}`: update this test");
    let (_, mut model) = readme_model();
    model.add_lora(&LoraConfig::new(8, None, 0.0, Proj::ALL.to_vec(), false).unwrap(), &mut Rng::new(2)).unwrap();
    let said = ferrolm::cli::lora::describe(&model);
    let figure = said.split(" (rank").next().unwrap();
    assert!(text.contains(&format!("`{figure}`")), "docs/LORA.md should quote `{figure}` (the run reports {said:?})");
}

#[test]
fn finetuning_guides_packing_is_its_commands() {
    let text = guide("docs/FINETUNING.md");
    let command = "--model runs/pretrain_llama --chat-template data/chat_template.jinja --data data/chat.jsonl --steps 80 --out runs/chat";
    assert!(joined(&text).contains(command), "docs/FINETUNING.md's worked example is no longer `finetune {command}`: update this test");
    let args: FinetuneArgs = parse_from(
        ["finetune"]
            .into_iter()
            .map(String::from)
            .chain(command.split(' ').map(|w| w.replace("data/", &format!("{}/", data_dir().display())))),
    )
    .unwrap();
    let (tokenizer, _) = readme_model();
    let opts = args.chat.options(false);
    let data = args.train.data.clone().unwrap();
    let loaded = ferrolm::chat::load(&data, None, &tokenizer, &opts, args.train.seq_len, args.train.seed).unwrap();
    let s = loaded.train.stats();
    let figure = format!(
        "packed: {} conversations in {} rows of {} tokens: packing efficiency {:.1}% ...; {} over-long dropped",
        s.packed,
        s.rows,
        s.seq_len,
        100.0 * s.efficiency(),
        s.dropped_too_long
    );
    assert!(joined(&text).contains(&format!("`{figure}`")), "docs/FINETUNING.md should quote `{figure}` ({})", s.summary());
}

/// PREFERENCE.md's summary line of the bundled pairs (and the README's count of them) is what
/// PREFERENCE.md's `eval --preference` command prints: data/prefs.jsonl through the fine-tuned
/// checkpoint's template (the bundled one, which the README's fine-tuning run saves with it) and
/// tokenizer, cut at the model's max_position_embeddings (eval's default --max-length).
#[test]
fn preference_guides_summary_is_its_commands() {
    use ferrolm::data::preference::{load_preference_pairs, PreferenceOptions};
    let text = guide("docs/PREFERENCE.md");
    let command = "--preference data/prefs.jsonl --model runs/finetune --ref-model runs/pretrain_llama";
    assert!(joined(&text).contains(command), "docs/PREFERENCE.md no longer runs `eval {command}`: update this test");
    let (tokenizer, model) = readme_model();
    let template = ferrolm::chat::template(None, Some(&data_dir().join("chat_template.jinja")), &tokenizer).unwrap().0;
    let opts = PreferenceOptions {
        max_length: Some(model.config().max_position_embeddings),
        ..PreferenceOptions::new(&tokenizer, Some(&template))
    };
    let inputs = ferrolm::data::resolve_inputs(&data_dir().join("prefs.jsonl")).unwrap();
    let (pairs, stats) = load_preference_pairs(&inputs, &opts, &mut |_, _, _| {}).unwrap();
    let summary = stats.summary();
    assert!(!pairs.is_empty());
    assert!(joined(&text).contains(&summary), "docs/PREFERENCE.md should quote `{summary}`");
    // The README's DPO example says how many pairs the file holds.
    let readme = format!("`data/prefs.jsonl` ({} pairs made from", pairs.len());
    assert!(joined(&guide("README.md")).contains(&readme), "README.md should say {readme:?}");
}

/// docs/LORA.md's memory tables are `lora_memory`'s at its defaults (rank 16, 2048 tokens: the
/// command the guide shows has no flags), every row: full fine-tuning, LoRA and QLoRA of Llama 3
/// 8B, and QLoRA beside the published figures; docs/BENCHMARKS.md, "LoRA memory", quotes the
/// first table. Regenerate them with `cargo run --release --example lora_memory`.
#[test]
fn lora_memory_tables_are_the_tools() {
    let command = "cargo run --release --example lora_memory`";
    let lines = ferrolm::planner::memory::lora_memory_tables(16, 2048).unwrap();
    let rows: Vec<&String> = lines.iter().filter(|l| l.starts_with('|')).collect();
    let first: Vec<&String> = lines.iter().take_while(|l| !l.is_empty()).filter(|l| l.starts_with('|')).collect();
    assert!(rows.len() >= 9 + 5 && first.len() == 8, "the tool's tables changed shape: {lines:#?}");
    for (doc, want) in [("docs/LORA.md", &rows), ("docs/BENCHMARKS.md", &first)] {
        let text = guide(doc);
        assert!(text.contains(command), "{doc} no longer shows `{command}: update this test");
        let missing: Vec<&&String> = want.iter().filter(|l| !text.lines().any(|t| t == l.as_str())).collect();
        assert!(missing.is_empty(), "{doc} should quote lora_memory's rows (regenerate the table); missing:\n{missing:#?}");
    }
}

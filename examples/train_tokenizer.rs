//! Train the byte-level BPE `tokenizer.json` shipped in `data/` (`--help` lists the flags; the
//! logic is `ferrolm::cli::prepare`).
//!
//!   cargo run --release --example train_tokenizer -- --corpus data/corpus --vocab-size 4096 --out data/tokenizer.json
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::prepare::train_tokenizer)
}

//! Tokenize text into train/validation token shards (`--help` lists the flags; the logic is
//! `ferrolm::cli::prepare`).
//!
//!   cargo run --release --example prepare_data -- --input data/corpus --tokenizer data/tokenizer.json --out runs/shakespeare
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::prepare::prepare_data)
}

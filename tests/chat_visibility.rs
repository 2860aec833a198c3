//! What a user sees of the conversations a run trains or scores (issue 50, items 3, 6 and 10):
//! the counts of conversations read, trained or scored, dropped as longer than `--seq-len`, cut
//! by `--truncate` and skipped, at info level in `finetune` and in `eval --chat`'s last line;
//! `--show-example N`, which prints the first N conversations with exactly the tokens the loss
//! trains marked and exits before the weights or `--out`; and the epoch count of a run whose
//! steps draw more rows than the data packs into.
mod common;
#[path = "common/tools.rs"]
mod tools;
use common::*;
use ferrolm::chat::{ChatCounts, ChatOptions, Marks};
use ferrolm::cli::parse_from;
use ferrolm::data::chat::{encode_sample, parse_record, DataFormat, Example, Json, TrainOn};
use ferrolm::data::{DocFraming, Tokenizer};
use std::path::{Path, PathBuf};

#[test]
fn tool_process() {
    tools::child_entry();
}

const SEQ: usize = 64;

fn conv(user: &str, assistant: Option<&str>) -> String {
    let mut m = vec![serde_json::json!({"role": "user", "content": user})];
    if let Some(a) = assistant {
        m.push(serde_json::json!({"role": "assistant", "content": a}));
    }
    serde_json::json!({ "messages": m }).to_string()
}

/// The crafted data, in file order: conversations of 19 to 30 tokens (6), of more than 64
/// tokens whose assistant starts early (3: `--truncate` keeps them cut), one of more than 64
/// tokens whose first 64 hold no assistant token (dropped either way), one with no assistant
/// message (trains nothing) and one bad record.
fn records() -> Vec<String> {
    let long = ["Long live the king."; 12].join(" ");
    vec![
        conv("Who's there?", Some("Nay, answer me. Stand and unfold yourself.")),
        conv("Hi", Some(&long)),
        conv(&long, Some("Yes.")),
        conv("Is it the king?", None),
        r#"{"nothing": 1}"#.to_string(),
        conv("Bernardo?", Some("He.")),
        conv("You come most carefully upon your hour.", Some("'Tis now struck twelve. Get thee to bed, Francisco.")),
        conv("Hello", Some(&long)),
        conv("For this relief much thanks.", Some("Have you had quiet guard?")),
        conv("Not a mouse stirring.", Some("Well, good night.")),
        conv("Again", Some(&long)),
        conv("I think I hear them.", Some("Stand, ho! Who is there?")),
    ]
}

/// A tiny Llama checkpoint (positions for 128 tokens) with the bundled tokenizer and template,
/// and the crafted data: `chat.jsonl` (every record) and `good.jsonl` (without the bad one).
fn setup(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let ck = chat_model(dir);
    let all = records();
    let data = dir.join("chat.jsonl");
    std::fs::write(&data, all.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let good = dir.join("good.jsonl");
    std::fs::write(&good, all.iter().filter(|l| !l.contains("nothing")).map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    (ck, data, good)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn options(truncate: bool) -> ChatOptions {
    ChatOptions {
        format: DataFormat::Auto,
        chat_template: None,
        train_on: TrainOn::Assistant,
        pack: true,
        truncate,
        val_data: None,
        val_fraction: 0.0,
        skip_bad_records: true,
    }
}

/// The lengths of the crafted data are what the tests assume.
fn check_lengths(ck: &Path) -> Vec<Option<Example>> {
    let tok = Tokenizer::from_file(ck.join("tokenizer.json")).unwrap();
    let (tpl, _) = ferrolm::chat::template(Some(ck), None, &tok).unwrap();
    let framing = DocFraming::of(&tok).unwrap();
    let ex: Vec<Option<Example>> = records()
        .iter()
        .map(|r| {
            let sample = parse_record(&Json::parse(r).unwrap(), DataFormat::Auto).ok()?;
            Some(encode_sample(&sample, Some(&tpl), &tok, &framing, TrainOn::Assistant).unwrap())
        })
        .collect();
    let lens: Vec<usize> = ex.iter().map(|e| e.as_ref().map_or(0, |e| e.len())).collect();
    for i in [0, 5, 6, 8, 9, 11] {
        assert!(lens[i] <= SEQ, "record {i}: {lens:?}");
    }
    for i in [1, 2, 7, 10] {
        assert!(lens[i] > SEQ, "record {i}: {lens:?}");
    }
    let e2 = ex[2].as_ref().unwrap();
    assert_eq!(e2.trained[..SEQ].iter().filter(|&&t| t).count(), 0, "record 2 trains nothing in its first {SEQ} tokens");
    assert_eq!(ex[3].as_ref().unwrap().trained_targets(), 0, "record 3 trains nothing");
    ex
}

#[test]
fn finetune_logs_what_became_of_every_conversation_with_and_without_truncate() {
    let dir = tmp("chat-visibility-counts");
    let (ck, data, _) = setup(&dir);
    check_lengths(&ck);
    let tok = Tokenizer::from_file(ck.join("tokenizer.json")).unwrap();
    for (truncate, kept, dropped, cut) in [(false, 6, 4, 0), (true, 9, 1, 3)] {
        let loaded = ferrolm::chat::load(&data, Some(&ck), &tok, &options(truncate), SEQ, 7).unwrap();
        let want = ChatCounts { read: 12, kept, dropped, cut, bad: 1, untrained: 1, held_out: 0, seq_len: SEQ };
        assert_eq!(loaded.counts, want, "--truncate {truncate}");
        let rows = loaded.train.num_rows();
        // The tool logs the same at info level, and the epoch count of its steps.
        let out = dir.join(format!("run-{truncate}"));
        let mut argv = vec![
            "finetune".to_string(),
            "--device=cpu".into(),
            "--steps=2".into(),
            "--batch-size=8".into(),
            "--eval-every=0".into(),
            "--val-fraction=0".into(),
            "--skip-bad-records".into(),
            format!("--seq-len={SEQ}"),
            flag("model", &ck),
            flag("data", &data),
            flag("out", &out),
        ];
        if truncate {
            argv.push("--truncate".into());
        }
        let a: ferrolm::cli::finetune::FinetuneArgs = parse_from(argv).unwrap();
        let (r, logs) = capture_logs(|| ferrolm::cli::finetune::finetune(a));
        r.unwrap();
        let line = format!(
            "info: data {}: 12 conversations read: {kept} trained, {dropped} dropped (longer than --seq-len {SEQ}), {cut} cut \
             (--truncate: their first {SEQ} tokens kept), 1 bad records skipped, 1 with no trained token skipped\n",
            data.display()
        );
        assert!(logs.contains(&line), "--truncate {truncate}: no line\n{line}in the log:\n{logs}");
        assert!(rows < 8, "{rows} rows: the warning needs fewer rows than a step");
        let epochs = format!("2 steps x 8 rows = 16 rows = {:.1} epochs of {rows} packed rows", 16.0 / rows as f64);
        assert!(logs.contains(&epochs), "no line {epochs:?} in\n{logs}");
        assert!(logs.contains("warning: one step draws 8 rows") && logs.contains(&format!("the data packs into {rows} rows")), "{logs}");
    }
    // A held-out share is counted too, and its conversations have their own line.
    let mut o = options(false);
    o.val_fraction = 0.25;
    let (loaded, logs) = capture_logs(|| ferrolm::chat::load(&data, Some(&ck), &tok, &o, SEQ, 7).unwrap());
    let (c, v) = (loaded.counts, loaded.val_counts.unwrap());
    assert_eq!(c.held_out, 3, "0.25 of 10 conversations");
    assert_eq!(c.kept + c.dropped + c.held_out + c.bad + c.untrained, c.read);
    assert_eq!((v.read, v.kept + v.dropped, v.cut), (3, 3, 0));
    assert!(logs.contains(", 3 held out for validation") && logs.contains("info: validation (held out of "), "{logs}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn eval_chat_says_how_many_conversations_it_scored_dropped_cut_and_skipped() {
    let dir = tmp("chat-visibility-eval");
    let (ck, _, good) = setup(&dir);
    let eval = |extra: &[&str]| {
        let a: ferrolm::cli::eval::EvalArgs =
            parse_from(args(&["eval", "--device=cpu", "--dtype=f32", "--seq-len=64"], &[flag("model", &ck), flag("chat", &good)], extra))
                .unwrap();
        capture_logs(|| ferrolm::cli::eval::evaluate(a))
    };
    let (r, logs) = eval(&[]);
    let score = r.unwrap();
    let c = score.chat.unwrap();
    assert_eq!((c.read, c.kept, c.dropped, c.cut, c.bad, c.untrained), (11, 6, 4, 0, 0, 1));
    assert!(score.line().ends_with(&format!("tokens {} conversations 6 dropped 4 cut 0 skipped 1", score.tokens)), "{}", score.line());
    assert!(logs.contains("11 conversations read: 6 scored, 4 dropped (longer than --seq-len 64), 0 cut"), "{logs}");
    let (r, _) = eval(&["--truncate"]);
    let cut = r.unwrap();
    assert!(cut.line().ends_with("conversations 9 dropped 1 cut 3 skipped 1"), "{}", cut.line());
    assert!(cut.tokens > score.tokens);
    // The tool's last line on stdout keeps the documented prefix and carries the counts.
    let o = tools::run_in(&dir, &[], &["eval", "--device=cpu", "--dtype=f32", "--seq-len=64", "--model", s(&ck), "--chat", s(&good)]);
    let (stdout, stderr) = tools::text(&o);
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    let last = stdout.lines().last().unwrap_or_default();
    let fields: Vec<&str> = last.split(' ').collect();
    assert_eq!(fields.len(), 14, "{last}");
    assert_eq!([fields[0], fields[2], fields[4]], ["loss", "ppl", "tokens"], "{last}");
    assert!(fields[1].parse::<f64>().is_ok() && fields[3].parse::<f64>().is_ok());
    assert_eq!(fields[5].parse::<usize>().unwrap(), score.tokens);
    assert_eq!(&fields[6..], ["conversations", "6", "dropped", "4", "cut", "0", "skipped", "1"], "{last}");
    // --text's last line is unchanged.
    let text = data_path("corpus/sonnets.txt");
    let t: ferrolm::cli::eval::EvalArgs =
        parse_from(["eval", "--device=cpu", "--seq-len=16", "--model", s(&ck), "--text", s(&text)]).unwrap();
    let line = ferrolm::cli::eval::evaluate(t).unwrap().line();
    assert_eq!(line.split(' ').count(), 6, "{line}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The expected `--show-example` text of `ex`: each maximal run of the tokens the loss trains
/// (the mask of `encode_sample`, whose first token no position predicts) between `[[` and `]]`.
fn bracketed(ex: &Example, tok: &Tokenizer) -> String {
    let trained = |i: usize| i > 0 && ex.trained[i];
    let mut out = String::new();
    let mut start = 0;
    for i in 1..=ex.len() {
        if i == ex.len() || trained(i) != trained(start) {
            let text = tok.decode(&ex.ids[start..i]).unwrap();
            out += &if trained(start) { format!("[[{text}]]") } else { text };
            start = i;
        }
    }
    out
}

#[test]
fn show_example_marks_exactly_the_trained_tokens_and_exits_before_weights_and_out() {
    let dir = tmp("chat-visibility-show");
    let (ck, data, good) = setup(&dir);
    let ex = check_lengths(&ck);
    let tok = Tokenizer::from_file(ck.join("tokenizer.json")).unwrap();
    // No weights to load: --show-example never reads them.
    std::fs::remove_file(ck.join("model.safetensors")).unwrap();
    let out = dir.join("never");
    for truncate in [false, true] {
        let mut argv = vec!["finetune", "--seq-len=64", "--show-example", "5", "--skip-bad-records", "--model", s(&ck), "--data", s(&data)];
        argv.extend(["--out", s(&out)]);
        if truncate {
            argv.push("--truncate");
        }
        let o = tools::run_in(&dir, &[], &argv);
        let (stdout, stderr) = tools::text(&o);
        assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
        assert!(!out.exists(), "--show-example created --out");
        let place = |i: usize| format!("{}:{}", data.display(), i + 1);
        for i in [0, 1, 2] {
            let e = ex[i].as_ref().unwrap();
            let head = format!("example {} of 5: {}: {} tokens, {} trained: ", i + 1, place(i), e.len(), e.trained_targets());
            let text = bracketed(e, &tok);
            assert!(stdout.contains(&head), "no {head:?} in\n{stdout}");
            assert!(stdout.contains(&format!("\n{text}\n")), "example {i}: no\n{text}\nin\n{stdout}");
        }
        assert!(stdout.contains("[[") && stdout.contains("]]") && !stdout.contains('\x1b'), "{stdout}");
        let long = ex[1].as_ref().unwrap();
        let kept_trained = (1..SEQ).filter(|&i| long.trained[i]).count();
        let fate1 = if truncate {
            format!("cut: --truncate keeps its first 64 tokens (--seq-len), {kept_trained} of them trained; the rest is not trained")
        } else {
            "dropped: longer than --seq-len 64 (--truncate would keep its first 64 tokens)".to_string()
        };
        assert!(stdout.contains(&format!(" trained: {fate1}\n")), "{stdout}");
        assert!(stdout.contains(" trained: kept (fits --seq-len 64)\n"), "{stdout}");
        let fate2 =
            if truncate { "dropped: its first 64 tokens, all that --truncate keeps, hold no trained token" } else { "dropped: longer" };
        assert!(stdout.contains(&format!("example 3 of 5: {}: ", place(2))) && stdout.contains(fate2), "{stdout}");
        assert!(
            stdout.contains(&format!("example 4 of 5: {}: ", place(3)))
                && stdout.contains("skipped: --train-on assistant trains no token of it")
        );
        assert!(stdout.contains(&format!("example 5 of 5: {}: bad record: ", place(4))) && stdout.contains("skipped (--skip-bad-records)"));
        assert!(!stdout.contains("example 6 of"), "{stdout}");
        assert!(stdout.contains("nothing trained (--show-example)"), "{stdout}");
    }
    // More than the file holds: all of them, said so; eval --chat shows the same way.
    let o = tools::run_in(
        &dir,
        &[],
        &["eval", "--seq-len=64", "--show-example=20", "--model", s(&ck), "--chat", s(&good), "--train-on", "all"],
    );
    let (stdout, stderr) = tools::text(&o);
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(stdout.contains("example 11 of 20: ") && stdout.contains(": 11 records, all shown"), "{stdout}");
    assert!(!stdout.contains("skipped: "), "--train-on all trains every conversation: {stdout}");
    // finetune_ladder shares the flag; token data has no conversations to show.
    let o = tools::run_in(&dir, &[], &["finetune_ladder", "--ladder-layers=1", "--show-example=1", "--model", s(&ck), "--data", s(&good)]);
    assert_eq!(o.status.code(), Some(0), "{:?}", tools::text(&o));
    assert!(tools::text(&o).0.contains("example 1 of 1: "));
    let o = tools::run_in(&dir, &[], &["finetune_ladder", "--ladder-layers=1", "--show-example=1", "--model", s(&ck), "--out", s(&out)]);
    let (_, stderr) = tools::text(&o);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--show-example shows conversations") && stderr.contains("token data"), "{stderr}");
    assert!(!out.exists());
    // --show-example 0 is a flag error (exit 2), as is --show-example without --chat in eval.
    let o = tools::run_in(&dir, &[], &["finetune", "--show-example=0", "--model", s(&ck), "--data", s(&data)]);
    assert_eq!(o.status.code(), Some(2), "{:?}", tools::text(&o));
    assert!(tools::text(&o).1.contains("--show-example"), "{:?}", tools::text(&o));
    let text = data_path("corpus/sonnets.txt");
    let e =
        parse_from::<ferrolm::cli::eval::EvalArgs, _, _>(["eval", "--model", "m", "--text", s(&text), "--seq-len=8", "--show-example=1"]);
    let e = e.unwrap_err().to_string();
    assert!(e.contains("--show-example") && e.contains("--text"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn marks_escape_literal_brackets_and_colour_on_a_terminal() {
    let tok = Tokenizer::from_file(tokenizer_path()).unwrap();
    let ids = tok.encode("say [[x]] \\ now", false).unwrap();
    let n = ids.len();
    let ex = Example { trained: (0..n).map(|i| i >= n / 2).collect(), ids };
    let b = ferrolm::chat::mark_trained(&ex, &tok, Marks::Brackets).unwrap();
    // Unescaping gives the text back, and the only unescaped brackets are the two markers.
    let (mut plain, mut markers, mut it) = (String::new(), Vec::new(), b.chars().peekable());
    while let Some(c) = it.next() {
        match c {
            '\\' => plain.push(it.next().unwrap()),
            '[' | ']' => {
                assert_eq!(it.next(), Some(c), "{b}");
                markers.push(c);
            }
            c => plain.push(c),
        }
    }
    assert_eq!(plain, "say [[x]] \\ now");
    assert_eq!(markers, ['[', ']'], "{b}");
    let c = ferrolm::chat::mark_trained(&ex, &tok, Marks::Colour).unwrap();
    let first = tok.decode(&ex.ids[..n / 2]).unwrap();
    assert_eq!(c, format!("{first}\x1b[1;32m{}\x1b[0m", tok.decode(&ex.ids[n / 2..]).unwrap()));
}

//! A sample -> token ids and which of them are trained (`--train-on assistant|last|all`).
//!
//! The rendered text is tokenized without special tokens, as `apply_chat_template` does, and
//! the tokens' offsets (what the tokenizer reports, as `char_to_token` reads them) decide:
//! - Where the template has `{% generation %}` blocks: transformers' `return_assistant_tokens_mask`
//!   exactly: for each block, every token from the one holding its first character through the
//!   one holding its last (to the end of the text when the last is not found or is token 0; a
//!   block whose first character no token holds stops the walk, as it does there).
//! - Otherwise, an assistant message's characters are those that rendering the conversation up
//!   to and including it adds beyond rendering it up to the message before with
//!   `add_generation_prompt=true`; a token is trained when its first character is one of them.
//!   For an assistant message that opens the conversation (ShareGPT data opening with a `gpt`
//!   turn), "up to the message before" is zero messages rendered with
//!   `add_generation_prompt=true`, so BOS, a default system prompt and the assistant's header
//!   are not trained. Most real templates cannot render zero messages (they read
//!   `messages[0]`); where that fails or is not a prefix, the message's characters are those
//!   after the longest common prefix of its rendering and the renderings of two lone assistant
//!   messages whose contents differ in their first character (`A`, `B`).
//!   Where the shorter rendering is not a prefix of the longer (Mistral v0.3 writes the system
//!   prompt into the last user turn, so only when a user message is last), the added
//!   characters are those after the longest tail of the shorter rendering found in the longer;
//!   where the longer is not a prefix of the whole conversation's rendering, they are found in
//!   it after the previous assistant message's. The end-of-turn token the template writes
//!   inside that span is trained, so the model learns to stop.
//!
//! `assistant` trains every assistant message (after a prompt/completion record's prompt),
//! `last` only the last one, `all` every token. Text samples train every token.

use std::ops::Range;

use super::records::{Conversation, Sample};
use super::template::ChatTemplate;
use super::{Message, Role};
use crate::framing::DocFraming;
use crate::tokenizer::Tokenizer;

/// Which tokens a conversation trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum TrainOn {
    /// Every assistant message.
    #[default]
    Assistant,
    /// Only the last assistant message.
    Last,
    /// Every token.
    All,
}

named_values!(TrainOn, "--train-on", [Assistant => "assistant", Last => "last", All => "all"]);

/// One tokenized sample: `ids`, and `trained[i]` whether token `i` is a label (the target of
/// position `i - 1`; `trained[0]` has no position predicting it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub trained: Vec<bool>,
}

impl Example {
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Positions whose next token is trained: the tokens the loss counts.
    pub fn trained_targets(&self) -> usize {
        self.trained.iter().skip(1).filter(|&&t| t).count()
    }
}

/// Tokenizes `sample`: text is framed as pretraining frames documents (`framing`) and fully
/// trained; a conversation is rendered by `template` and masked by `train_on`. The error is a
/// message without the record's location.
pub fn encode_sample(
    sample: &Sample,
    template: Option<&ChatTemplate>,
    tokenizer: &Tokenizer,
    framing: &DocFraming,
    train_on: TrainOn,
) -> Result<Example, String> {
    match sample {
        Sample::Text(text) => {
            let body = tokenizer.encode(text, false).map_err(|e| e.to_string())?;
            let ids: Vec<u32> = framing.prefix.iter().chain(&body).chain(&framing.suffix).copied().collect();
            Ok(Example { trained: vec![true; ids.len()], ids })
        }
        Sample::Chat(conv) => {
            let template = template.ok_or("a chat record needs a chat template")?;
            encode_conversation(conv, template, tokenizer, train_on)
        }
    }
}

/// Each token's byte range in the text, as the tokenizer reports it.
type Offsets = Vec<(usize, usize)>;

/// The ids a model continues from to answer `conv` (`generate --chat`): the conversation
/// rendered with `add_generation_prompt=true` and tokenized without special tokens, as
/// `apply_chat_template(..., add_generation_prompt=True)` gives them.
pub fn encode_prompt(conv: &Conversation, template: &ChatTemplate, tokenizer: &Tokenizer) -> Result<Vec<u32>, String> {
    let text = template.render(&conv.messages, true)?.text;
    tokenizer.encode(&text, false).map_err(|e| e.to_string())
}

/// The token ids of `text` and their offsets.
fn tokenize(tokenizer: &Tokenizer, text: &str) -> Result<(Vec<u32>, Offsets), String> {
    let enc = tokenizer.inner().encode(text, false).map_err(|e| format!("tokenizer: encode failed: {e}"))?;
    Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
}

/// The assistant messages `train_on` trains, by index.
fn trained_messages(conv: &Conversation, train_on: TrainOn) -> Vec<usize> {
    let eligible: Vec<usize> = (conv.prompt_len..conv.messages.len()).filter(|&i| conv.messages[i].role() == Role::Assistant).collect();
    match train_on {
        TrainOn::Last => eligible.last().copied().into_iter().collect(),
        _ => eligible,
    }
}

fn encode_conversation(conv: &Conversation, template: &ChatTemplate, tokenizer: &Tokenizer, train_on: TrainOn) -> Result<Example, String> {
    let full = template.render(&conv.messages, false)?;
    let (ids, offsets) = tokenize(tokenizer, &full.text)?;
    let mut trained = vec![false; ids.len()];
    if train_on == TrainOn::All {
        trained.iter_mut().for_each(|t| *t = true);
        return Ok(Example { ids, trained });
    }
    let wanted = trained_messages(conv, train_on);
    if template.has_generation() {
        let assistants = conv.messages.iter().filter(|m| m.role() == Role::Assistant).count();
        let blocks: Vec<Range<usize>> = if full.generation.len() == assistants {
            // One block per assistant message, in order: keep the wanted messages' blocks.
            let mut k = 0;
            let mut keep = Vec::new();
            for (i, m) in conv.messages.iter().enumerate() {
                if m.role() == Role::Assistant {
                    if wanted.contains(&i) {
                        keep.push(full.generation[k].clone());
                    }
                    k += 1;
                }
            }
            keep
        } else if train_on == TrainOn::Last {
            full.generation.last().cloned().into_iter().collect()
        } else {
            full.generation.clone()
        };
        mark_generation_blocks(&offsets, &blocks, &mut trained);
    } else {
        for span in message_spans(conv, template, &full.text, &wanted)? {
            for (t, &(start, _)) in offsets.iter().enumerate() {
                if span.contains(&start) {
                    trained[t] = true;
                }
            }
        }
    }
    Ok(Example { ids, trained })
}

/// The first token whose byte range holds `pos` (the tokenizers library's `char_to_token`).
fn token_at(offsets: &[(usize, usize)], pos: usize) -> Option<usize> {
    offsets.iter().position(|&(s, e)| s <= pos && pos < e)
}

/// What `upto` adds beyond `before`: its rest after `before` when that is a prefix, else its
/// rest after the longest tail of `before` (in characters) found in it, at its first occurrence.
fn added_chars<'a>(before: &str, upto: &'a str) -> Option<&'a str> {
    if let Some(rest) = upto.strip_prefix(before) {
        return Some(rest);
    }
    let starts: Vec<usize> = before.char_indices().map(|(i, _)| i).collect();
    let n = starts.len();
    // Tails that occur in `upto` are closed under shortening: binary search the longest.
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if upto.contains(&before[starts[n - mid]..]) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    if lo == 0 {
        return None;
    }
    let tail = &before[starts[n - lo]..];
    upto.find(tail).map(|at| &upto[at + tail.len()..])
}

/// Two lone assistant messages that differ in their first character: where their renderings
/// part is where an opening assistant message's own text starts.
const PROBES: [&str; 2] = ["A", "B"];

/// What an assistant message that opens the conversation adds to `upto` (its rendering): the
/// rest after the template's rendering of zero messages with `add_generation_prompt=true` (BOS,
/// a default system prompt, the assistant's header) when that renders and is a prefix of `upto`;
/// otherwise (most real templates read `messages[0]`, and Jinja2 fails there) the rest after the
/// longest common prefix of `upto` and the renderings of the lone [`PROBES`].
fn opening_added<'a>(template: &ChatTemplate, upto: &'a str) -> Result<&'a str, String> {
    if let Ok(before) = template.render(&[], true) {
        if let Some(rest) = upto.strip_prefix(before.text.as_str()) {
            return Ok(rest);
        }
    }
    let mut common = upto.len();
    for probe in PROBES {
        let text = template.render(&[Message::new(Role::Assistant, probe)], false).map_err(|e| {
            format!(
                "the conversation opens with an assistant message, and the chat template renders neither zero messages \
                 nor a lone assistant message ({e}), so what precedes the message cannot be told apart from it: \
                 add {{% generation %}} blocks to the template, or use --train-on all"
            )
        })?;
        common = common_prefix_len(&upto[..common], &text.text);
    }
    Ok(&upto[common..])
}

/// Bytes of the longest common prefix of `a` and `b` that ends on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices().zip(b.chars()).find(|&((_, x), y)| x != y).map_or_else(|| a.len().min(b.len()), |((i, _), _)| i)
}

/// transformers' `return_assistant_tokens_mask` over `blocks` (see the module docs). Empty
/// blocks mark nothing.
fn mark_generation_blocks(offsets: &[(usize, usize)], blocks: &[Range<usize>], trained: &mut [bool]) {
    for b in blocks.iter().filter(|b| !b.is_empty()) {
        let Some(start) = token_at(offsets, b.start) else { break };
        let end = match token_at(offsets, b.end - 1) {
            Some(e) if e != 0 => e + 1,
            _ => trained.len(),
        };
        trained[start..end.max(start)].iter_mut().for_each(|t| *t = true);
    }
}

/// The byte ranges of `full` that the messages `wanted` add (see the module docs).
fn message_spans(conv: &Conversation, template: &ChatTemplate, full: &str, wanted: &[usize]) -> Result<Vec<Range<usize>>, String> {
    let mut spans = Vec::with_capacity(wanted.len());
    let mut search_from = 0;
    for &i in wanted {
        let upto = template.render(&conv.messages[..=i], false)?.text;
        let added = if i == 0 {
            Some(opening_added(template, &upto)?)
        } else {
            added_chars(&template.render(&conv.messages[..i], true)?.text, &upto)
        };
        let Some(added) = added else {
            return Err(format!(
                "the chat template renders messages[..={i}] with nothing of its rendering of messages[..{i}] in it, \
                 so the assistant's tokens cannot be told apart: add {{% generation %}} blocks to the template, or use --train-on all"
            ));
        };
        let span = if full.starts_with(&upto) {
            upto.len() - added.len()..upto.len()
        } else {
            let at = full.get(search_from..).and_then(|rest| rest.find(added)).ok_or_else(|| {
                format!("the text messages[{i}] adds when rendered alone does not appear in the whole conversation's rendering")
            })?;
            search_from + at..search_from + at + added.len()
        };
        search_from = span.end;
        spans.push(span);
    }
    Ok(spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_masks_follow_transformers() {
        // Tokens: [0,2) [2,4) [4,4) [4,6) [6,8)
        let offsets = [(0, 2), (2, 4), (4, 4), (4, 6), (6, 8)];
        let mut m = vec![false; 5];
        mark_generation_blocks(&offsets, &[Range { start: 3, end: 5 }], &mut m);
        assert_eq!(m, [false, true, true, true, false]);
        let mut m = vec![false; 5];
        mark_generation_blocks(&offsets, &[Range { start: 0, end: 1 }], &mut m); // last token 0: to the end, as there
        assert_eq!(m, [true; 5]);
        let mut m = vec![false; 5];
        mark_generation_blocks(&offsets, &[9..10, 0..2], &mut m); // unmapped start stops the walk
        assert_eq!(m, [false; 5]);
    }

    #[test]
    fn an_opening_assistant_message_trains_none_of_what_precedes_it() {
        let t = |src: &str| ChatTemplate::new(src, "t", vec![("bos_token".into(), "<s>".into())]).unwrap();
        let upto = |t: &ChatTemplate| t.render(&[Message::new(Role::Assistant, "Hi.")], false).unwrap().text;
        // Zero messages render: BOS, the default system prompt and the header are the prefix.
        let chatml = t("{{ bos_token }}{% if not messages or messages[0].role != 'system' %}[sys:default]{% endif %}\
             {% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}");
        let u = upto(&chatml);
        assert_eq!(u, "<s>[sys:default]<assistant>Hi.</>");
        assert_eq!(opening_added(&chatml, &u), Ok("Hi.</>"));
        // A template that reads messages[0] (fails, or renders no prefix, on zero messages): the
        // common prefix with the probes' renderings.
        let indexing =
            t("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ messages[0].content }}{% else %}[sys:default]{% endif %}\
             {% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}");
        let u = upto(&indexing);
        assert_eq!(opening_added(&indexing, &u), Ok("Hi.</>"));
        let not_prefix = t("{% if not messages %}[empty]{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}\
             {% if add_generation_prompt %}<assistant>{% endif %}");
        assert_eq!(opening_added(&not_prefix, &upto(&not_prefix)), Ok("Hi.</>"));
        // Content starting like a probe does not move the start into it.
        assert_eq!(opening_added(&not_prefix, "<assistant>AB</>"), Ok("AB</>"));
        // Neither renders: an error that says what to do, not a panic.
        let refusing = t("{% if messages|length < 2 %}{{ raise_exception('too short') }}{% endif %}{{ messages[0].content }}");
        let e = opening_added(&refusing, "x").unwrap_err();
        assert!(e.contains("too short") && e.contains("--train-on all"), "{e}");
    }

    #[test]
    fn train_on_picks_messages() {
        let c = Sample::Chat(Conversation {
            messages: vec![
                super::super::Message::new(Role::User, "a"),
                super::super::Message::new(Role::Assistant, "b"),
                super::super::Message::new(Role::User, "c"),
                super::super::Message::new(Role::Assistant, "d"),
            ],
            prompt_len: 2,
        });
        let Sample::Chat(conv) = &c else { unreachable!() };
        assert_eq!(trained_messages(conv, TrainOn::Assistant), [3]);
        let conv = Conversation { prompt_len: 0, ..conv.clone() };
        assert_eq!(trained_messages(&conv, TrainOn::Assistant), [1, 3]);
        assert_eq!(trained_messages(&conv, TrainOn::Last), [3]);
        assert_eq!("last".parse::<TrainOn>(), Ok(TrainOn::Last));
    }
}

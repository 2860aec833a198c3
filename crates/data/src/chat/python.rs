//! Values written the way Python writes them, so MiniJinja's output matches Jinja2's under
//! transformers: `{{ x }}` is Python's `str(x)` (`None`, `True`, `1.0`, `[{'a': 1}]`), and
//! `tojson` is transformers' own filter, `json.dumps(x, ensure_ascii=False, indent=None,
//! separators=None, sort_keys=False)`.
//!
//! Known gap: the string repr of a character Python deems unprintable follows the common cases
//! (controls, the space separators and format characters below), not Unicode's whole table.

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Python's `str(v)`.
pub fn py_str(v: &Value) -> Result<String, Error> {
    match v.kind() {
        ValueKind::String => Ok(v.as_str().unwrap_or_default().to_string()),
        ValueKind::Undefined => Ok(String::new()),
        _ => py_repr(v),
    }
}

/// Python's `repr(v)` (what `str` gives for containers).
pub fn py_repr(v: &Value) -> Result<String, Error> {
    let mut out = String::new();
    write_repr(&mut out, v, 0)?;
    Ok(out)
}

const MAX_DEPTH: usize = 128;

fn too_deep() -> Error {
    Error::new(ErrorKind::InvalidOperation, "value nested too deeply to print")
}

fn write_repr(out: &mut String, v: &Value, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(too_deep());
    }
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&py_number(v)),
        ValueKind::String => repr_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Bytes => {
            out.push('b');
            repr_str(out, &String::from_utf8_lossy(v.as_bytes().unwrap_or_default()));
        }
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
            let map = v.kind() == ValueKind::Map;
            out.push(if map { '{' } else { '[' });
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item, depth + 1)?;
                if map {
                    out.push_str(": ");
                    write_repr(out, &v.get_item(&item)?, depth + 1)?;
                }
            }
            out.push(if map { '}' } else { ']' });
        }
        _ => out.push_str(&v.to_string()),
    }
    Ok(())
}

/// An int as Python prints it, a float as `float.__repr__` does.
fn py_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(x) => py_float(x),
        Err(_) => v.to_string(),
    }
}

/// `repr(x)` of a Python float: the shortest digits that round-trip, in fixed notation when the
/// decimal exponent is in -4..16, else as `1e-05` / `1.5e+20`.
pub fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    // Rust's `{:e}` prints the shortest round-trip digits: "-1.25e-7", "1e16", "0e0".
    let s = format!("{x:e}");
    let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mant) = mant.strip_prefix('-').map_or(("", mant), |m| ("-", m));
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let frac = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{frac}e{esign}{:02}", exp.abs())
    }
}

/// Characters Python's `str.isprintable()` refuses, beyond the control characters: the
/// separators other than the ASCII space, and the common format characters.
fn py_unprintable(c: char) -> bool {
    c.is_control()
        || matches!(c as u32,
            0xA0 | 0xAD | 0x1680 | 0x2000..=0x200F | 0x2028..=0x202F | 0x205F..=0x2064 | 0x3000 | 0xFEFF | 0xFFF9..=0xFFFB)
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
fn repr_str(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if py_unprintable(c) => {
                let n = c as u32;
                if n < 0x100 {
                    out.push_str(&format!("\\x{n:02x}"));
                } else if n < 0x10000 {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// The options of transformers' `tojson` filter.
pub struct JsonOptions {
    pub ensure_ascii: bool,
    /// `None`: one line; `Some(s)`: one item a line, indented by `s` a level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl JsonOptions {
    /// Python's defaults for `indent` (separators `", "` and `": "` on one line, `","` and `": "`
    /// when indented).
    pub fn new(indent: Option<String>) -> Self {
        let item_sep = if indent.is_some() { "," } else { ", " };
        JsonOptions { ensure_ascii: false, indent, item_sep: item_sep.into(), key_sep: ": ".into(), sort_keys: false }
    }
}

/// `json.dumps(v, ...)` with `opts`.
pub fn py_json(v: &Value, opts: &JsonOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, v, opts, 0)?;
    Ok(out)
}

fn newline(out: &mut String, opts: &JsonOptions, depth: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOptions, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(too_deep());
    }
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let s = py_number(v);
            out.push_str(match s.as_str() {
                "nan" => "NaN",
                "inf" => "Infinity",
                "-inf" => "-Infinity",
                _ => &s,
            });
        }
        ValueKind::String => json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, depth + 1);
                write_json(out, item, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in v.try_iter()? {
                let name = json_key(&key)?;
                entries.push((name, v.get_item(&key)?));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, depth + 1);
                json_str(out, k, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, item, opts, depth + 1)?;
            }
            newline(out, opts, depth);
            out.push('}');
        }
        kind => {
            return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: a value of type {kind} is not JSON serializable")));
        }
    }
    Ok(())
}

/// A dict key as `json.dumps` writes it: strings as they are, numbers, booleans and None
/// converted, anything else refused.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number => Ok(py_number(key)),
        kind => Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: keys must be str, int, float, bool or None, not {kind}"))),
    }
}

/// A JSON string as Python's encoder writes it.
fn json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7E) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::json::Json;

    #[test]
    fn floats_print_as_python_does() {
        for (x, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e300, "1.5e+300"),
            (123.456, "123.456"),
            (0.0, "0.0"),
        ] {
            assert_eq!(py_float(x), s, "{x}");
        }
    }

    #[test]
    fn containers_print_as_python_reprs() {
        let v = Json::parse(r#"[{"text": "it's", "type": "text"}, null, true, 2]"#).unwrap().to_value();
        assert_eq!(py_str(&v).unwrap(), r#"[{'text': "it's", 'type': 'text'}, None, True, 2]"#);
    }

    #[test]
    fn json_matches_python_dumps() {
        let v = Json::parse(r#"{"a": [1, 2.0, "é\n<"], "b": {}}"#).unwrap().to_value();
        assert_eq!(py_json(&v, &JsonOptions::new(None)).unwrap(), r#"{"a": [1, 2.0, "é\n<"], "b": {}}"#);
        let indented = py_json(&v, &JsonOptions::new(Some("  ".into()))).unwrap();
        assert_eq!(indented, "{\n  \"a\": [\n    1,\n    2.0,\n    \"é\\n<\"\n  ],\n  \"b\": {}\n}");
        let mut ascii = JsonOptions::new(None);
        ascii.ensure_ascii = true;
        assert_eq!(py_json(&minijinja::Value::from("é😀"), &ascii).unwrap(), r#""\u00e9\ud83d\ude00""#);
    }
}

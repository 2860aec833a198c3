//! A reader of kernels/ for build.rs: the kernels' signatures, the structs they take by value and
//! the shared constants, read from the sources themselves, so that a machine without a C++
//! compiler still gets the typed launchers. It knows the C that kernels/ is written in: line
//! continuations, comments, function-like macros that declare kernels (expanded, with `##`),
//! `extern "C" __global__ [__launch_bounds__(..)] void name(params)`, plain structs of numbers,
//! and, in constants.cuh, `#define NAME <integer>` and enums. Anything else it meets where it
//! expects one of these is an error naming the file, so a kernel is never silently missed.

/// One kernel: `name(params)` declared in `file`.
pub struct Kernel {
    pub name: String,
    pub file: String,
    pub params: Vec<Decl>,
}

/// A parameter or a struct field: its C type as written (spaces normalised), its name, and for
/// an array field the length expression.
pub struct Decl {
    pub c_type: String,
    pub name: String,
    pub array_len: Option<String>,
}

/// A struct some kernel takes by value.
pub struct Struct {
    pub name: String,
    pub file: String,
    pub fields: Vec<Decl>,
}

/// A shared constant: a `#define` (a size: usize in Rust) or an enumerator (an op code: i32).
pub struct Constant {
    pub name: String,
    pub value: i64,
    pub enumerator: bool,
}

/// Source text as the compiler sees it after phases 2 and 3: continuation lines spliced, comments
/// replaced by a space (string literals kept).
pub fn clean(src: &str) -> String {
    let spliced = src.replace("\\\r\n", " ").replace("\\\n", " ");
    let mut out = String::with_capacity(spliced.len());
    let mut it = spliced.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            '"' => {
                out.push(c);
                while let Some(s) = it.next() {
                    out.push(s);
                    if s == '\\' {
                        out.extend(it.next());
                    } else if s == '"' {
                        break;
                    }
                }
            }
            '/' if it.peek() == Some(&'/') => {
                while it.peek().is_some_and(|&n| n != '\n') {
                    it.next();
                }
                out.push(' ');
            }
            '/' if it.peek() == Some(&'*') => {
                it.next();
                let mut prev = ' ';
                for n in it.by_ref() {
                    if prev == '*' && n == '/' {
                        break;
                    }
                    prev = n;
                }
                out.push(' ');
            }
            _ => out.push(c),
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The identifier starting at byte `at` (empty if none) and the byte after it.
fn ident_at(s: &str, at: usize) -> (&str, usize) {
    let end = s[at..].find(|c: char| !is_ident(c)).map_or(s.len(), |e| at + e);
    (&s[at..end], end)
}

fn skip_ws(s: &str, at: usize) -> usize {
    s[at..].find(|c: char| !c.is_whitespace()).map_or(s.len(), |e| at + e)
}

/// The text between the parenthesis at byte `open` and its match, and the byte after the match.
fn balanced<'a>(s: &'a str, open: usize, file: &str) -> Result<(&'a str, usize), String> {
    let mut depth = 0;
    for (i, c) in s[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Ok((&s[open + 1..open + i], open + i + 1));
                }
            }
            _ => {}
        }
    }
    Err(format!("{file}: unbalanced parenthesis"))
}

/// Splits at the commas outside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(s[start..].trim());
    parts
}

/// `const float* x` -> (`const float*`, `x`); `i64 shape[N]` -> (`i64`, `shape`, `N`).
fn decl(text: &str, file: &str) -> Result<Decl, String> {
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let (text, array_len) = match text.split_once('[') {
        Some((head, len)) => (head.trim().to_string(), Some(len.trim_end_matches(']').trim().to_string())),
        None => (text, None),
    };
    let start = text.rfind(|c: char| !is_ident(c)).map_or(0, |i| i + 1);
    let (c_type, name) = (text[..start].trim().replace(" *", "*"), text[start..].to_string());
    if c_type.is_empty() || name.is_empty() {
        return Err(format!("{file}: cannot read the declaration `{text}`"));
    }
    Ok(Decl { c_type, name, array_len })
}

struct Macro {
    params: Vec<String>,
    body: String,
}

/// The function-like macros of `text` (a cleaned source) and the text without directive lines.
fn directives(text: &str) -> (Vec<(String, Macro)>, String) {
    let (mut macros, mut code) = (Vec::new(), String::new());
    for line in text.lines() {
        let t = line.trim_start();
        let Some(rest) = t.strip_prefix('#') else {
            code.push_str(line);
            code.push('\n');
            continue;
        };
        code.push('\n');
        let Some(def) = rest.trim_start().strip_prefix("define") else { continue };
        let def = def.trim_start();
        let (name, after) = ident_at(def, 0);
        if def[after..].starts_with('(') {
            if let Some(close) = def[after..].find(')') {
                let params = def[after + 1..after + close].split(',').map(|p| p.trim().to_string()).collect();
                macros.push((name.to_string(), Macro { params, body: def[after + close + 1..].trim().to_string() }));
            }
        }
    }
    (macros, code)
}

/// `m`'s body with its parameters replaced by `args` and `##` pasted.
fn substitute(m: &Macro, args: &[&str]) -> String {
    let mut out = String::new();
    let body = &m.body;
    let mut i = 0;
    while i < body.len() {
        let c = body[i..].chars().next().unwrap();
        if is_ident(c) {
            let (word, end) = ident_at(body, i);
            match m.params.iter().position(|p| p == word) {
                Some(k) => out.push_str(args.get(k).copied().unwrap_or("")),
                None => out.push_str(word),
            }
            i = end;
        } else {
            out.push(c);
            i += c.len_utf8();
        }
    }
    while let Some(at) = out.find("##") {
        let before = out[..at].trim_end().len();
        let after = skip_ws(&out, at + 2);
        out.replace_range(before..after, "");
    }
    out
}

/// `code` with every invocation of a kernel-declaring macro expanded.
fn expand(code: &str, macros: &[(String, Macro)], file: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut i = 0;
    while i < code.len() {
        let c = code[i..].chars().next().unwrap();
        if !is_ident(c) {
            out.push(c);
            i += c.len_utf8();
            continue;
        }
        let (word, end) = ident_at(code, i);
        let open = skip_ws(code, end);
        match macros.iter().find(|(n, _)| n == word) {
            Some((_, m)) if code[open..].starts_with('(') => {
                let (args, next) = balanced(code, open, file)?;
                out.push_str(&substitute(m, &split_top(args)));
                i = next;
            }
            _ => {
                out.push_str(word);
                i = end;
            }
        }
    }
    Ok(out)
}

/// Every kernel of `files` ((file name, text), in order), as declared.
pub fn kernels(files: &[(String, String)]) -> Result<Vec<Kernel>, String> {
    let mut all_macros = Vec::new();
    let mut codes = Vec::new();
    for (file, text) in files {
        let (macros, code) = directives(&clean(text));
        all_macros.extend(macros.into_iter().filter(|(_, m)| m.body.contains("__global__")));
        codes.push((file, code));
    }
    let mut out: Vec<Kernel> = Vec::new();
    for (file, code) in codes {
        let code = expand(&code, &all_macros, file)?;
        let mut from = 0;
        while let Some(found) = code[from..].find("__global__") {
            let at = from + found;
            from = at + "__global__".len();
            if !code[..at].trim_end().ends_with("extern \"C\"") {
                return Err(format!("{file}: a __global__ kernel is not declared extern \"C\" (its name must not be mangled)"));
            }
            // `void`, the name, and `__launch_bounds__(..)` anywhere before the name.
            let mut words = Vec::new();
            let mut p = skip_ws(&code, from);
            loop {
                let (word, end) = ident_at(&code, p);
                if word.is_empty() || words.len() > 2 {
                    return Err(format!("{file}: cannot read the kernel declared after `__global__`"));
                }
                p = skip_ws(&code, end);
                if word == "__launch_bounds__" {
                    p = skip_ws(&code, balanced(&code, p, file)?.1);
                } else {
                    words.push(word);
                }
                if code[p..].starts_with('(') {
                    break;
                }
            }
            let (name, open) = match words[..] {
                ["void", name] => (name, p),
                _ => return Err(format!("{file}: expected `void name(` after __global__, found `{}`", words.join(" "))),
            };
            let (params, next) = balanced(&code, open, file)?;
            let params = match params.trim() {
                "" | "void" => Vec::new(),
                p => split_top(p).into_iter().map(|d| decl(d, file)).collect::<Result<_, _>>()?,
            };
            if out.iter().any(|k| k.name == name) {
                return Err(format!("{file}: kernel {name} is declared twice"));
            }
            out.push(Kernel { name: name.to_string(), file: file.clone(), params });
            from = next;
        }
    }
    Ok(out)
}

/// The struct `name` as defined in one of `files`.
pub fn find_struct(files: &[(String, String)], name: &str) -> Result<Struct, String> {
    for (file, text) in files {
        let code = clean(text);
        let key = format!("struct {name}");
        let mut from = 0;
        while let Some(found) = code[from..].find(&key) {
            let at = from + found + key.len();
            from = at;
            let open = skip_ws(&code, at);
            if ident_at(&code, at).0.is_empty() && code[open..].starts_with('{') {
                let close = code[open..].find('}').ok_or_else(|| format!("{file}: struct {name} is not closed"))? + open;
                let fields = code[open + 1..close]
                    .split(';')
                    .map(str::trim)
                    .filter(|f| !f.is_empty())
                    .map(|f| decl(f, file))
                    .collect::<Result<_, _>>()?;
                return Ok(Struct { name: name.to_string(), file: file.clone(), fields });
            }
        }
    }
    Err(format!("struct {name}, taken by value by a kernel, is not defined in kernels/"))
}

/// The constants of the shared header: `#define NAME <integer>` and enumerators.
pub fn constants(file: &str, text: &str) -> Result<Vec<Constant>, String> {
    let mut out = Vec::new();
    let code = clean(text);
    let int = |v: &str| v.trim().parse::<i64>().map_err(|_| format!("{file}: `{v}` is not an integer literal"));
    for line in code.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line == "#pragma once" {
            continue;
        }
        if let Some(def) = line.strip_prefix("#define ") {
            let (name, value) = def.trim().split_once(char::is_whitespace).ok_or_else(|| format!("{file}: `{line}` defines no value"))?;
            out.push(Constant { name: name.to_string(), value: int(value)?, enumerator: false });
        } else if let Some(body) = line.strip_prefix("enum").and_then(|r| r.split_once('{')).and_then(|(_, r)| r.split_once('}')) {
            let mut next = 0;
            for e in body.0.split(',').map(str::trim).filter(|e| !e.is_empty()) {
                let (name, value) = match e.split_once('=') {
                    Some((n, v)) => (n.trim(), int(v)?),
                    None => (e, next),
                };
                out.push(Constant { name: name.to_string(), value, enumerator: true });
                next = value + 1;
            }
        } else {
            return Err(format!("{file}: `{line}`: only `#define NAME <integer>` and one-line enums belong in this header"));
        }
    }
    Ok(out)
}

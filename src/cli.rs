//! A tiny `--flag value` parser shared by the examples: unknown flags and bad values are
//! errors that print the usage, never panics.
use crate::AnyResult;
use std::collections::HashMap;
use std::str::FromStr;

pub struct Flags {
    usage: &'static str,
    values: HashMap<String, String>,
    switches: Vec<String>,
}

impl Flags {
    /// Parses the process arguments. `valued` and `switches` list the accepted flags
    /// (without `--`); `--help` prints `usage` and exits.
    pub fn parse(usage: &'static str, valued: &[&str], switches: &[&str]) -> AnyResult<Flags> {
        Self::parse_from(std::env::args().skip(1), usage, valued, switches)
    }

    pub fn parse_from(args: impl Iterator<Item = String>, usage: &'static str, valued: &[&str], switches: &[&str]) -> AnyResult<Flags> {
        let mut f = Flags { usage, values: HashMap::new(), switches: Vec::new() };
        let mut it = args;
        while let Some(a) = it.next() {
            if a == "--help" || a == "-h" {
                println!("{usage}");
                std::process::exit(0);
            }
            let name = a.strip_prefix("--").ok_or_else(|| format!("unexpected argument {a:?}\n{usage}"))?;
            if switches.contains(&name) {
                f.switches.push(name.to_string());
            } else if valued.contains(&name) {
                let v = it.next().ok_or_else(|| format!("--{name} needs a value\n{usage}"))?;
                f.values.insert(name.to_string(), v);
            } else {
                return Err(format!("unknown flag --{name}\n{usage}").into());
            }
        }
        Ok(f)
    }

    pub fn str(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    pub fn required(&self, name: &str) -> AnyResult<&str> {
        self.str(name).ok_or_else(|| format!("--{name} is required\n{}", self.usage).into())
    }

    /// The parsed value of `--name`, or `default` when absent.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> AnyResult<T> {
        match self.str(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("--{name}: cannot parse {v:?}").into()),
        }
    }

    pub fn switch(&self, name: &str) -> bool {
        self.switches.iter().any(|s| s == name)
    }
}

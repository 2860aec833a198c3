//! A JSON value that keeps the order of object keys, as Python's `json.loads` does.
//!
//! Chat templates see records the way transformers hands them over: Python dicts, whose
//! `.items()` and `tojson` follow the file's key order. `serde_json::Value` sorts keys (its
//! `preserve_order` feature would change every crate of the workspace), so records are parsed
//! into this tree instead and handed to MiniJinja as insertion-ordered maps.

use std::fmt;

use indexmap::IndexMap;
use minijinja::Value;
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A JSON value; objects keep their keys in file order (a repeated key keeps its first place and
/// its last value, as Python's `dict` does).
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Parses one JSON document; the error is serde_json's (line and column).
    pub fn parse(text: &str) -> Result<Json, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(text);
        let v = Json::deserialize(&mut de)?;
        de.end()?;
        Ok(v)
    }

    /// "a string", "an array", ...: the type, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Json::Null => "null",
            Json::Bool(_) => "a boolean",
            Json::Number(_) => "a number",
            Json::String(_) => "a string",
            Json::Array(_) => "an array",
            Json::Object(_) => "an object",
        }
    }

    /// The value under `key` of an object (`None` for other values and missing keys).
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(fields) => fields.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    /// The keys of an object, in order (empty for other values).
    pub fn keys(&self) -> Vec<&str> {
        match self {
            Json::Object(fields) => fields.iter().map(|(k, _)| k.as_str()).collect(),
            _ => Vec::new(),
        }
    }

    /// The value as MiniJinja sees it: numbers keep Python's int/float distinction (`1` and
    /// `1.0`), objects their key order.
    pub fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::from(()),
            Json::Bool(b) => Value::from(*b),
            Json::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Value::from(i)
                } else if let Some(u) = n.as_u64() {
                    Value::from(u)
                } else {
                    Value::from(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            Json::String(s) => Value::from(s.as_str()),
            Json::Array(items) => Value::from(items.iter().map(Json::to_value).collect::<Vec<_>>()),
            Json::Object(fields) => {
                let map: IndexMap<Value, Value> = fields.iter().map(|(k, v)| (Value::from(k.as_str()), v.to_value())).collect();
                Value::from(map)
            }
        }
    }

    /// Bytes of the value written as JSON, roughly (for the record size limit).
    pub fn approx_bytes(&self) -> usize {
        match self {
            Json::Null | Json::Bool(_) => 5,
            Json::Number(_) => 24,
            Json::String(s) => s.len() + 2,
            Json::Array(items) => 2 + items.iter().map(|v| v.approx_bytes() + 1).sum::<usize>(),
            Json::Object(fields) => 2 + fields.iter().map(|(k, v)| k.len() + 4 + v.approx_bytes()).sum::<usize>(),
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(Json::Number(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Json, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Json::Null, Json::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::String(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(v) = seq.next_element::<Json>()? {
            items.push(v);
        }
        Ok(Json::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut fields: Vec<(String, Json)> = Vec::new();
        let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value::<Json>()?;
            match index.get(&k) {
                Some(&i) => fields[i].1 = v,
                None => {
                    index.insert(k.clone(), fields.len());
                    fields.push((k, v));
                }
            }
        }
        Ok(Json::Object(fields))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_key_order_and_python_dict_semantics() {
        let v = Json::parse(r#"{"b": 1, "a": [true, null, 1.0], "b": "x"}"#).unwrap();
        assert_eq!(v.keys(), vec!["b", "a"]);
        assert_eq!(v.get("b"), Some(&Json::String("x".into())));
        let mv = v.to_value();
        let keys: Vec<String> = mv.try_iter().unwrap().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["b", "a"]);
        assert!(!mv.get_attr("a").unwrap().get_item(&Value::from(2)).unwrap().is_integer());
        assert!(Json::parse("{} x").is_err());
    }
}

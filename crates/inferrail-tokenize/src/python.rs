//! Python's printing of values, as chat templates rendered by transformers see it.
//!
//! Jinja2 prints a value with Python's `str()`: `True`, `None`, `['a', 1]`,
//! `{'k': 'v'}`; and transformers' `tojson` filter is `json.dumps` with
//! `ensure_ascii=False`, whose separators put a space after `,` and `:`.
//! Templates print both into prompts, so the tokens depend on every byte.

use std::fmt::Write;

use minijinja::Value;
use minijinja::value::ValueKind;

/// Options of Python's `json.dumps` that templates pass to `tojson`.
#[derive(Debug, Clone)]
pub struct JsonStyle {
    /// Spaces per nesting level; `None` writes one line.
    pub indent: Option<usize>,
    /// Between items (`", "` on one line, `","` when indented).
    pub item_sep: String,
    /// Between a key and its value.
    pub key_sep: String,
    /// Sort object keys.
    pub sort_keys: bool,
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
}

impl JsonStyle {
    /// `json.dumps` defaults for the given indent, with transformers' `ensure_ascii=False`.
    pub fn new(indent: Option<usize>) -> Self {
        let item_sep = if indent.is_some() { "," } else { ", " };
        JsonStyle { indent, item_sep: item_sep.into(), key_sep: ": ".into(), sort_keys: false, ensure_ascii: false }
    }
}

/// `json.dumps(value, ...)`.
pub fn json_dumps(value: &Value, style: &JsonStyle) -> Result<String, minijinja::Error> {
    let mut out = String::new();
    write_json(&mut out, value, style, 0)?;
    Ok(out)
}

fn write_json(out: &mut String, value: &Value, style: &JsonStyle, depth: usize) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value, ["NaN", "Infinity", "-Infinity"]),
        ValueKind::String | ValueKind::Plain => write_json_str(out, &value.to_string(), style.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            let items = keys.into_iter().map(|k| {
                let v = value.get_item(&k).unwrap_or_default();
                (k, v)
            });
            write_container(out, ('{', '}'), items, style, depth, |out, (k, v), style, depth| {
                let key = if k.kind() == ValueKind::String { k.to_string() } else { json_dumps(&k, style)? };
                write_json_str(out, &key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, &v, style, depth)
            })?;
        }
        ValueKind::Seq | ValueKind::Iterable => {
            write_container(out, ('[', ']'), value.try_iter()?, style, depth, |out, v, style, depth| write_json(out, &v, style, depth))?;
        }
        _ => {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("Object of type {} is not JSON serializable", value.kind()),
            ));
        }
    }
    Ok(())
}

fn write_container<T>(
    out: &mut String,
    (open, close): (char, char),
    items: impl Iterator<Item = T>,
    style: &JsonStyle,
    depth: usize,
    mut write_item: impl FnMut(&mut String, T, &JsonStyle, usize) -> Result<(), minijinja::Error>,
) -> Result<(), minijinja::Error> {
    out.push(open);
    let mut empty = true;
    for (i, item) in items.enumerate() {
        empty = false;
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(n) = style.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * (depth + 1)));
        }
        write_item(out, item, style, depth + 1)?;
    }
    if let (Some(n), false) = (style.indent, empty) {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
    out.push(close);
    Ok(())
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
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
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// An integer as digits, a float as Python's `repr(float)`; `special` names
/// NaN and the infinities (`json.dumps` and `repr` spell them differently).
fn write_number(out: &mut String, value: &Value, [nan, inf, neg_inf]: [&str; 3]) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    match f64::try_from(value.clone()).unwrap_or(f64::NAN) {
        f if f.is_nan() => out.push_str(nan),
        f if f.is_infinite() => out.push_str(if f > 0.0 { inf } else { neg_inf }),
        f => out.push_str(&float_repr(f)),
    }
}

/// Python's `repr(float)` of a finite float: shortest round-trip digits, exponent form below 1e-4 and from 1e16.
fn float_repr(f: f64) -> String {
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Rust's `{:e}` gives the shortest digits: `1e-5`, `1.5e16`; Python pads the exponent to two digits and signs it.
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    format!("{f:?}")
}

/// Python's `str(value)`, as Jinja2 prints `{{ value }}`.
pub fn py_str(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::String | ValueKind::Plain => out.push_str(&value.to_string()),
        _ => py_repr(out, value),
    }
}

/// Python's `repr(value)`: what a list or dict prints for its items.
pub fn py_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, value, ["nan", "inf", "-inf"]),
        ValueKind::String => repr_str(out, &value.to_string()),
        ValueKind::Map => {
            out.push('{');
            for (i, k) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &k);
                out.push_str(": ");
                py_repr(out, &value.get_item(&k).unwrap_or_default());
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let (open, close) = if value.is_tuple() { ('(', ')') } else { ('[', ']') };
            out.push(open);
            let items: Vec<Value> = value.try_iter().into_iter().flatten().collect();
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, v);
            }
            if value.is_tuple() && items.len() == 1 {
                out.push(',');
            }
            out.push(close);
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text holds one and no double quote.
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
            c if !printable(c) => {
                let n = c as u32;
                let _ = match n {
                    0..=0xff => write!(out, "\\x{n:02x}"),
                    0x100..=0xffff => write!(out, "\\u{n:04x}"),
                    _ => write!(out, "\\U{n:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for one character, for the characters prompts hold:
/// controls, separators other than the space, and format characters are not.
fn printable(c: char) -> bool {
    !matches!(c,
        '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{a0}' | '\u{ad}' | '\u{1680}' | '\u{2000}'..='\u{200f}' | '\u{2028}'..='\u{202f}'
        | '\u{205f}'..='\u{2064}' | '\u{2066}'..='\u{206f}' | '\u{3000}' | '\u{feff}' | '\u{fff9}'..='\u{fffb}'
        | '\u{e000}'..='\u{f8ff}')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(json: &str) -> Value {
        crate::template::value(&serde_json::from_str::<serde_json::Value>(json).unwrap())
    }

    #[test]
    fn json_dumps_matches_python() {
        let x = v(r#"{"name": "get", "args": {"q": "é\n\"x\"", "n": [1, 2.5, true, null]}, "e": {}, "l": []}"#);
        assert_eq!(
            json_dumps(&x, &JsonStyle::new(None)).unwrap(),
            r#"{"name": "get", "args": {"q": "é\n\"x\"", "n": [1, 2.5, true, null]}, "e": {}, "l": []}"#
        );
        assert_eq!(
            json_dumps(&x, &JsonStyle::new(Some(2))).unwrap(),
            "{\n  \"name\": \"get\",\n  \"args\": {\n    \"q\": \"é\\n\\\"x\\\"\",\n    \"n\": [\n      1,\n      2.5,\n      true,\n      null\n    ]\n  },\n  \"e\": {},\n  \"l\": []\n}"
        );
        let ascii = JsonStyle { ensure_ascii: true, ..JsonStyle::new(None) };
        assert_eq!(json_dumps(&v(r#""é😀""#), &ascii).unwrap(), r#""\u00e9\ud83d\ude00""#);
    }

    #[test]
    fn floats_print_as_python() {
        for (f, s) in
            [(1.0, "1.0"), (0.1, "0.1"), (1e-5, "1e-05"), (1e16, "1e+16"), (1.5e300, "1.5e+300"), (123.456, "123.456"), (0.0001, "0.0001")]
        {
            assert_eq!(float_repr(f), s);
        }
    }

    #[test]
    fn values_print_as_python() {
        let mut out = String::new();
        py_str(&mut out, &v(r#"[{"a": "it's", "b": null, "c": true}, "x\ty", 3]"#));
        assert_eq!(out, r#"[{'a': "it's", 'b': None, 'c': True}, 'x\ty', 3]"#);
        out.clear();
        py_str(&mut out, &v(r#""plain""#));
        assert_eq!(out, "plain");
    }
}

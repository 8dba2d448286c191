//! Python's semantics where chat templates reach for them and minijinja's differ: jinja2
//! runs on Python strings and dicts, and transformers adds its own `tojson`.
//! - Whitespace and line breaks as `str.isspace` and `str.splitlines` have them (`trim`,
//!   `.strip()`, `.split()`, `.splitlines()`), and `.rsplit()`, which minijinja lacks.
//! - Floats written as Python writes them (`{{ 1e20 }}` is `1e+20`).
//! - `tojson` as transformers defines it for chat templates: `json.dumps(x,
//!   ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, with Python's
//!   separators, string escapes and float repr (minijinja's escapes HTML characters, sorts
//!   nothing and indents differently).
//!
//! Reference: transformers `utils/chat_template_utils.py` (`_compile_jinja_template`).

use minijinja::value::{from_args, Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};

/// Whitespace as Python's `str.isspace` has it: Rust's `char::is_whitespace` plus the ASCII
/// separators 0x1c-0x1f.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// `s.strip(chars)` / `.lstrip` / `.rstrip` (`left`, `right`): `chars` or Python's whitespace.
pub fn trim(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let strip = |c: char| chars.map_or_else(|| py_space(c), |set| set.contains(c));
    let s = if left { s.trim_start_matches(strip) } else { s };
    let s = if right { s.trim_end_matches(strip) } else { s };
    s.to_string()
}

/// minijinja-contrib's Python string methods, with Python's whitespace and line boundaries
/// where they differ from Rust's: `strip`/`lstrip`/`rstrip` without arguments, `split()`
/// without a separator, `splitlines` (which also breaks at \r, \v, \f, 0x1c-0x1e, 0x85,
/// U+2028 and U+2029, where Rust's `lines` breaks at \n only), and `rsplit`.
pub fn string_methods(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let Some(s) = value.as_str() else {
        return minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args);
    };
    let max_splits = |m: Option<i64>| m.filter(|&m| m >= 0).map(|m| m as usize);
    match method {
        "strip" | "lstrip" | "rstrip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            Ok(trim(s, chars, method != "rstrip", method != "lstrip").into())
        }
        "split" if args.first().is_none_or(|a| a.is_none()) => {
            let (_, max): (Option<Value>, Option<i64>) = from_args(args)?;
            Ok(strings(split_whitespace(s, max_splits(max))))
        }
        "rsplit" => {
            let (sep, max): (Option<Value>, Option<i64>) = from_args(args)?;
            let max = max_splits(max);
            match sep.filter(|v| !v.is_none()) {
                None => {
                    // Python's rsplit() on whitespace: split_whitespace of the reversed string.
                    let rev: String = s.chars().rev().collect();
                    let mut parts: Vec<String> = split_whitespace(&rev, max).into_iter().map(|p| p.chars().rev().collect()).collect();
                    parts.reverse();
                    Ok(strings(parts))
                }
                Some(sep) => {
                    let sep = sep.as_str().ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "rsplit: the separator must be a string"))?;
                    if sep.is_empty() {
                        return Err(Error::new(ErrorKind::InvalidOperation, "rsplit: empty separator"));
                    }
                    let mut parts: Vec<String> = match max {
                        Some(m) => s.rsplitn(m + 1, sep).map(str::to_string).collect(),
                        None => s.rsplit(sep).map(str::to_string).collect(),
                    };
                    parts.reverse();
                    Ok(strings(parts))
                }
            }
        }
        "splitlines" => {
            let (keepends,): (Option<bool>,) = from_args(args)?;
            Ok(strings(splitlines(s, keepends.unwrap_or(false))))
        }
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

fn strings(v: Vec<String>) -> Value {
    v.into_iter().map(Value::from).collect()
}

/// Python's `s.split(None, max)`: runs of whitespace separate, none at the ends.
fn split_whitespace(s: &str, max: Option<usize>) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s.trim_start_matches(py_space);
    while !rest.is_empty() {
        if max.is_some_and(|m| out.len() == m) {
            out.push(rest.to_string());
            break;
        }
        let end = rest.find(py_space).unwrap_or(rest.len());
        out.push(rest[..end].to_string());
        rest = rest[end..].trim_start_matches(py_space);
    }
    out
}

/// Python's `s.splitlines(keepends)`.
fn splitlines(s: &str, keepends: bool) -> Vec<String> {
    let boundary = |c: char| matches!(c, '\n' | '\r' | '\x0b' | '\x0c' | '\x1c' | '\x1d' | '\x1e' | '\u{85}' | '\u{2028}' | '\u{2029}');
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(i) = rest.find(boundary) {
        let end = if rest[i..].starts_with("\r\n") { i + 2 } else { i + rest[i..].chars().next().map_or(1, char::len_utf8) };
        out.push(rest[..if keepends { end } else { i }].to_string());
        rest = &rest[end..];
    }
    if !rest.is_empty() {
        out.push(rest.to_string());
    }
    out
}

/// Output of `{{ value }}` as jinja2 writes it: a float as Python's `str(float)` (minijinja
/// writes `1e20` as `100000000000000000000.0`), anything else as minijinja does.
pub fn formatter(out: &mut minijinja::Output, state: &mut State, value: &Value) -> Result<(), Error> {
    if value.kind() == ValueKind::Number && !value.is_integer() {
        if let Ok(x) = f64::try_from(value.clone()) {
            return out.write_str(&float_repr(x, false)).map_err(Error::from);
        }
    }
    minijinja::escape_formatter(out, state, value)
}

/// transformers' `tojson` filter: `json.dumps(value, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, each also a keyword argument (ensure_ascii also the
/// first positional one).
pub fn tojson(value: &Value, ensure_ascii: Option<bool>, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.or(ensure_ascii).unwrap_or(false);
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (_, Some(s)) => Some(s.to_string()),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: indent must be an integer or a string, got {v}"))),
        },
    };
    let (item, key) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let pair: Vec<Value> = v.try_iter()?.collect();
            match (pair.first().and_then(Value::as_str), pair.get(1).and_then(Value::as_str), pair.len()) {
                (Some(a), Some(b), 2) => (a.to_string(), b.to_string()),
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings (item, key)")),
            }
        }
        // Python's defaults: ", " between items unless indenting (then ","), ": " after keys.
        _ => ((if indent.is_some() { "," } else { ", " }).to_string(), ": ".to_string()),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let style = Style { ensure_ascii, indent, item, key, sort_keys };
    let mut out = String::new();
    dump(value, &style, 0, &mut out)?;
    Ok(Value::from(out))
}

struct Style {
    ensure_ascii: bool,
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
}

fn dump(v: &Value, st: &Style, depth: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&float_repr(f64::try_from(v.clone())?, true)),
        ValueKind::String => quote(v.as_str().unwrap_or_default(), st.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            container(out, st, depth, '[', ']', items.len(), |i, out| dump(&items[i], st, depth + 1, out))?;
        }
        ValueKind::Map => {
            let mut pairs: Vec<(String, Value)> = v.try_iter()?.map(|k| Ok((key_text(&k)?, v.get_item(&k)?))).collect::<Result<_, Error>>()?;
            if st.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            container(out, st, depth, '{', '}', pairs.len(), |i, out| {
                quote(&pairs[i].0, st.ensure_ascii, out);
                out.push_str(&st.key);
                dump(&pairs[i].1, st, depth + 1, out)
            })?;
        }
        other => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: a value of kind {other} is not JSON serializable"))),
    }
    Ok(())
}

/// `open` items `close`, each item on its own indented line when indenting (Python's layout;
/// an empty container stays `[]` / `{}`).
fn container(out: &mut String, st: &Style, depth: usize, open: char, close: char, n: usize, mut item: impl FnMut(usize, &mut String) -> Result<(), Error>) -> Result<(), Error> {
    out.push(open);
    if n > 0 {
        let line = |out: &mut String, d: usize| {
            if let Some(ind) = &st.indent {
                out.push('\n');
                (0..d).for_each(|_| out.push_str(ind));
            }
        };
        for i in 0..n {
            if i > 0 {
                out.push_str(&st.item);
            }
            line(out, depth + 1);
            item(i, out)?;
        }
        line(out, depth);
    }
    out.push(close);
    Ok(())
}

/// A dict key as json.dumps writes it: strings as they are; numbers, booleans and None as
/// their JSON text.
fn key_text(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).into(),
        ValueKind::Number if k.is_integer() => k.to_string(),
        ValueKind::Number => float_repr(f64::try_from(k.clone())?, false),
        other => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: keys must be str, int, float, bool or None, not {other}"))),
    })
}

/// A JSON string as Python's json module writes it.
fn quote(s: &str, ensure_ascii: bool, out: &mut String) {
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
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` (what json.dumps writes; `nan`/`inf` as JSON's NaN/Infinity when
/// `json`): the shortest digits that read back, fixed between 1e-4 and 1e16, else exponent.
fn float_repr(x: f64, json: bool) -> String {
    if x.is_nan() {
        return (if json { "NaN" } else { "nan" }).into();
    }
    if x.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if x < 0.0 { format!("-{s}") } else { s.into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits as d.ddde±x.
    let e = format!("{x:e}");
    let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let frac = if digits.len() > 1 { format!(".{}", &digits[1..]) } else { String::new() };
        format!("{sign}{}{frac}e{}{:02}", &digits[..1], if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr_prints_them() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123456789.125, "123456789.125"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (0.0, "0.0"),
        ] {
            assert_eq!(float_repr(x, true), want, "{x}");
        }
        assert_eq!(float_repr(f64::NAN, true), "NaN");
        assert_eq!(float_repr(f64::NEG_INFINITY, true), "-Infinity");
    }
}

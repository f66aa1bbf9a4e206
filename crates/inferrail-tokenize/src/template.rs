//! Chat templates rendered the way transformers renders them.
//!
//! transformers compiles a model's template in a Jinja2 sandbox with
//! `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` filter that is
//! `json.dumps(ensure_ascii=False)`, and the globals `raise_exception` and
//! `strftime_now`. Templates also call Python string and dict methods and print
//! Python values. This module sets minijinja up to behave the same; every
//! difference would change a prompt's tokens.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, State, Value};

use crate::python::{JsonStyle, json_dumps, py_str};

/// A compiled chat template.
pub struct Template {
    env: Environment<'static>,
    /// Whether the template loops over a message's content, so vLLM hands it
    /// content as a list of `{type, text}` parts rather than one string.
    pub openai_content: bool,
    /// Whether the text names the `developer` role (else vLLM turns developer messages into system ones).
    pub names_developer: bool,
    /// Whether the text mentions `content` (`continue_final_message` needs it).
    pub mentions_content: bool,
}

/// Work one rendering may do before it is stopped (minijinja fuel units), so a
/// pathological template cannot loop for long.
const FUEL: u64 = 5_000_000;

impl Template {
    /// Compiles `source` as transformers would.
    pub fn new(source: &str) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_syntax(SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build()?);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            if let Some(s) = value.as_str() {
                // A string prints as itself: no copy on the way.
                return out.write_str(s).map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()));
            }
            let mut s = String::new();
            py_str(&mut s, value);
            out.write_str(&s).map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
        });
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_owned())?;
        Ok(Template {
            env,
            openai_content: loops_over_content(source),
            names_developer: source.contains("\"developer\"") || source.contains("'developer'"),
            mentions_content: source.contains("content"),
        })
    }

    /// Renders the template with `ctx` as its variables.
    pub fn render(&self, ctx: Value) -> Result<String, Error> {
        self.env.get_template("chat")?.render(ctx)
    }
}

/// vLLM's content-format detection: does some `{% for %}` iterate over a
/// message's `content` (directly, through filters or slices, or through a
/// variable set from it), where a message is a loop variable over `messages`
/// (or over a variable set from it)? A loop outside macros over a plain
/// `content`, or a macro looping over a parameter it is called with a
/// message's content for, counts too. vLLM walks Jinja2's syntax tree; this
/// reads the statements' text, which is enough for the templates models ship
/// (the golden corpus checks four families and per-request templates).
fn loops_over_content(source: &str) -> bool {
    let statements: Vec<&str> = source
        .split("{%")
        .skip(1)
        .filter_map(|s| s.split("%}").next())
        .map(|s| s.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace()))
        .collect();
    // The expression a statement works on, without filters, tests and slices.
    let base = |expr: &str| -> String {
        let expr = expr.split(['|', ' ']).next().unwrap_or_default();
        let expr = match expr.rfind('[') {
            Some(i) if expr.ends_with(']') && expr[i..].contains(':') => &expr[..i],
            _ => expr,
        };
        expr.replace('"', "'")
    };
    let mut lists = vec!["messages".to_owned()];
    let mut messages: Vec<String> = Vec::new();
    let mut contents: Vec<String> = Vec::new();
    let is_content = |e: &str, messages: &[String], contents: &[String]| {
        contents.iter().any(|c| c == e) || messages.iter().any(|m| e == format!("{m}['content']") || e == format!("{m}.content"))
    };
    // Macros with a loop over one of their parameters: (name, parameter position, parameter name).
    let mut looping_macros: Vec<(String, usize, String)> = Vec::new();
    // Twice: a statement can name a variable that a later one (in the text) defines.
    for _ in 0..2 {
        let mut current_macro: Option<(String, Vec<String>)> = None;
        for st in &statements {
            if let Some(rest) = st.strip_prefix("macro ") {
                let (name, params) = rest.split_once('(').unwrap_or((rest, ""));
                let params =
                    params.trim_end_matches(')').split(',').map(|p| p.split('=').next().unwrap_or_default().trim().to_owned()).collect();
                current_macro = Some((name.trim().to_owned(), params));
            } else if st.starts_with("endmacro") {
                current_macro = None;
            } else if let Some(rest) = st.strip_prefix("set ")
                && let Some((var, expr)) = rest.split_once('=')
            {
                let (var, expr) = (var.trim().to_owned(), base(expr.trim()));
                if lists.contains(&expr) {
                    lists.push(var);
                } else if is_content(&expr, &messages, &contents) {
                    contents.push(var);
                }
            } else if let Some(rest) = st.strip_prefix("for ")
                && let Some((var, expr)) = rest.split_once(" in ")
            {
                let (var, expr) = (var.trim().to_owned(), base(expr.trim()));
                if lists.contains(&expr) {
                    messages.push(var);
                } else if is_content(&expr, &messages, &contents) || (current_macro.is_none() && expr == "content") {
                    return true;
                } else if let Some((name, params)) = &current_macro
                    && let Some(i) = params.iter().position(|p| *p == expr)
                {
                    looping_macros.push((name.clone(), i, expr));
                }
            }
        }
    }
    // A looping macro called with a message's content, by position or by keyword.
    let compact: String = source.chars().filter(|c| !c.is_whitespace()).collect::<String>().replace('"', "'");
    looping_macros.iter().any(|(name, i, param)| {
        messages.iter().any(|m| {
            [format!("{m}.content"), format!("{m}['content']")].iter().any(|arg| {
                let positional = if *i == 0 { format!("{name}({arg}") } else { format!(",{arg}") };
                compact.contains(&positional) && (*i == 0 || compact.contains(&format!("{name}(")))
                    || compact.contains(&format!("{param}={arg}"))
            })
        })
    })
}

/// A JSON value as a template variable, object keys in their order.
pub fn value(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => n
            .as_i64()
            .map(Value::from)
            .or_else(|| n.as_u64().map(Value::from))
            .unwrap_or_else(|| Value::from(n.as_f64().unwrap_or(f64::NAN))),
        J::String(s) => Value::from(s.as_str()),
        J::Array(a) => Value::from(a.iter().map(value).collect::<Vec<_>>()),
        J::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (Value::from(k.as_str()), value(v)))),
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let mut style = JsonStyle::new(indent);
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        let mut it = seps.try_iter()?;
        if let (Some(item), Some(key)) = (it.next(), it.next()) {
            style.item_sep = item.to_string();
            style.key_sep = key.to_string();
        }
    }
    style.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    style.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    json_dumps(value, &style).map(Value::from)
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current time (UTC) formatted as Python's `strftime` would.
fn strftime_now(_state: &State, format: String) -> Result<Value, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Utc::now().format(&format)).map_err(|_| Error::new(ErrorKind::InvalidOperation, "bad strftime format"))?;
    Ok(Value::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::context;

    fn render(src: &str, ctx: Value) -> String {
        Template::new(src).unwrap().render(ctx).unwrap()
    }

    #[test]
    fn blocks_trim_like_transformers() {
        let src = "{% for m in messages %}\n    {{ m }}\n{% endfor %}\n";
        assert_eq!(render(src, context! { messages => vec!["a", "b"] }), "    a\n    b\n");
    }

    #[test]
    fn python_methods_loop_controls_and_namespaces() {
        let src = "{% set ns = namespace(n=0) %}{% for w in text.split(' ') %}{% if w.startswith('x') %}{% continue %}{% endif %}\
                   {% set ns.n = ns.n + 1 %}{{ w.upper() }}{% endfor %}|{{ ns.n }}|{{ '  t '.strip() }}|{{ d.items() | list | length }}";
        assert_eq!(render(src, context! { text => "a xb c", d => context!{ k => 1 } }), "AC|2|t|1");
    }

    #[test]
    fn values_print_as_python_and_tojson_is_json_dumps() {
        let src = "{{ flag }} {{ nothing }} {{ items }} {{ tool | tojson }} {{ tool | tojson(indent=2) }}";
        let tool = serde_json::json!({"name": "f", "ok": false});
        let out = render(src, context! { flag => true, nothing => (), items => vec!["a"], tool => value(&tool) });
        assert_eq!(out, "True None ['a'] {\"name\": \"f\", \"ok\": false} {\n  \"name\": \"f\",\n  \"ok\": false\n}");
    }

    #[test]
    fn content_format_is_detected_like_vllm() {
        assert!(!loops_over_content("{% for message in messages %}{{ message['content'] }}{% endfor %}"));
        assert!(loops_over_content(
            "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
        ));
        assert!(loops_over_content(
            "{% set loop_messages = messages[1:] %}{%- for m in loop_messages -%}{% set c = m.content %}{%- for item in c | list -%}{% endfor %}{% endfor %}"
        ));
        assert!(!loops_over_content("{% for tool in tools %}{% for p in tool.content %}{% endfor %}{% endfor %}"));
        assert!(loops_over_content(
            "{% macro r(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.content) }}{% endfor %}"
        ));
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let err = Template::new("{{ raise_exception('roles must alternate') }}").unwrap().render(context! {}).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn runaway_templates_run_out_of_fuel() {
        let err = Template::new("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}")
            .unwrap()
            .render(context! {})
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfFuel);
    }
}

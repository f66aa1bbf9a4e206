use serde_json::json;

use super::*;

fn sim() -> Tokenizer {
    Tokenizer::load("builtin:sim", 0).unwrap()
}

fn body(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

#[test]
fn parts_join_with_newlines_and_null_content_is_empty() {
    let b = body(json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": null}
    ], "add_generation_prompt": false}));
    assert_eq!(
        render(&sim(), &b, RequestTemplates::Render).unwrap(),
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    );
}

#[test]
fn continue_final_message_stops_after_its_text() {
    let b = body(json!({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}
    ], "add_generation_prompt": false, "continue_final_message": true}));
    assert_eq!(render(&sim(), &b, RequestTemplates::Render).unwrap(), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure, ");
    let both = body(json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}));
    assert!(matches!(render(&sim(), &both, RequestTemplates::Render), Err(Declined::Invalid(_))));
}

#[test]
fn tool_arguments_are_parsed_and_tools_dumped_like_pydantic() {
    let src = "{% for t in tools %}{{ t | tojson }}{% endfor %}|{% for m in messages %}{{ m.tool_calls[0].function.arguments.city if m.tool_calls }}{% endfor %}";
    let b = body(json!({
        "chat_template": src,
        "tools": [{"type": "function", "function": {"name": "weather"}}],
        "messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]}]
    }));
    assert_eq!(
        render(&sim(), &b, RequestTemplates::Render).unwrap(),
        "{\"type\": \"function\", \"function\": {\"name\": \"weather\", \"description\": null, \"parameters\": null}}|Oslo"
    );
    assert_eq!(render(&sim(), &b, RequestTemplates::Decline), Err(Declined::RequestTemplate));
}

#[test]
fn what_cannot_be_predicted_is_declined_with_a_reason() {
    let image = body(json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}));
    assert_eq!(prompt_ids(&sim(), Endpoint::Chat, &image, RequestTemplates::Decline).unwrap_err().reason(), "not_text");
    let batch = body(json!({"prompt": ["a", "b"]}));
    assert_eq!(prompt_ids(&sim(), Endpoint::Completions, &batch, RequestTemplates::Decline).unwrap_err().reason(), "batch");
    let refused = body(json!({"chat_template": "{{ raise_exception('no') }}", "messages": [{"role": "user", "content": "x"}]}));
    assert_eq!(prompt_ids(&sim(), Endpoint::Chat, &refused, RequestTemplates::Render), Err(Declined::Template("no".into())));
}

#[test]
fn completions_take_strings_and_token_ids() {
    let tok = sim();
    assert_eq!(
        prompt_ids(&tok, Endpoint::Completions, &body(json!({"prompt": "Hello there"})), RequestTemplates::Decline).unwrap(),
        crate::sim::encode("Hello there")
    );
    assert_eq!(
        prompt_ids(&tok, Endpoint::Completions, &body(json!({"prompt": [[5, 6, 7]]})), RequestTemplates::Decline).unwrap(),
        vec![5, 6, 7]
    );
    assert!(prompt_ids(&tok, Endpoint::Completions, &body(json!({"prompt": [-1]})), RequestTemplates::Decline).is_err());
}

mod hostile {
    //! Arbitrary bodies never panic or hang the preparation: every one gives ids or a reason.

    use std::sync::LazyLock;

    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    use super::super::*;
    use crate::tokenizer::tests::{FAMILIES, family_dir};

    static TOKENIZERS: LazyLock<Vec<Tokenizer>> = LazyLock::new(|| {
        let mut all = vec![Tokenizer::load("builtin:sim", 0).unwrap()];
        all.extend(FAMILIES.map(|f| Tokenizer::load(family_dir(f).to_str().unwrap(), 4_096).unwrap()));
        all
    });

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            "\\PC{0,12}",
            Just("<|im_start|>".to_owned()),
            Just("</think>".to_owned()),
            Just("<tool_response>".to_owned()),
            Just("x-anthropic-billing-header: a\nrest".to_owned()),
            Just("{{ 1 }}{% if %}".to_owned()),
        ]
    }

    fn scalar() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(|f| json!(f)),
            text().prop_map(Value::from),
        ]
    }

    /// Any JSON, its object keys drawn from the ones the preparation reads.
    fn value() -> impl Strategy<Value = Value> {
        let keys = prop::sample::select(vec![
            "role",
            "content",
            "type",
            "text",
            "refusal",
            "image_url",
            "tool_calls",
            "function",
            "name",
            "arguments",
            "parameters",
            "description",
            "reasoning",
            "tool_call_id",
            "enable_thinking",
            "x",
        ]);
        scalar().prop_recursive(3, 24, 4, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec((keys.clone(), inner), 0..4)
                    .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())),
            ]
        })
    }

    fn message() -> impl Strategy<Value = Value> {
        let role = prop::sample::select(vec!["system", "developer", "user", "assistant", "tool", "other"]);
        let content = prop_oneof![
            4 => text().prop_map(Value::from),
            2 => prop::collection::vec(
                (prop::sample::select(vec!["text", "refusal", "thinking", "image_url", "input_text"]), text())
                    .prop_map(|(kind, t)| json!({"type": kind, "text": t, "refusal": t})),
                0..3
            )
            .prop_map(Value::Array),
            1 => value(),
        ];
        (role, content, proptest::option::weighted(0.2, value())).prop_map(|(role, content, calls)| {
            let mut m = json!({"role": role, "content": content});
            if let Some(calls) = calls {
                m["tool_calls"] = calls;
            }
            m
        })
    }

    fn body() -> impl Strategy<Value = Map<String, Value>> {
        let template = prop_oneof![
            Just("{% for m in messages %}{{ m.content }}{% endfor %}"),
            Just("{{ raise_exception('no') }}"),
            Just("{% for i in range(100000000) %}x{% endfor %}"),
            Just("{% for m in messages %"),
        ];
        (
            prop::collection::vec(message(), 0..5),
            proptest::option::of(text()),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "tools",
                        "chat_template_kwargs",
                        "documents",
                        "prompt",
                        "add_generation_prompt",
                        "continue_final_message",
                        "add_special_tokens",
                        "reasoning_effort",
                    ]),
                    value(),
                ),
                0..4,
            ),
            proptest::option::of(template),
        )
            .prop_map(|(messages, prompt, fields, template)| {
                let mut b = Map::new();
                b.insert("messages".into(), Value::Array(messages));
                if let Some(p) = prompt {
                    b.insert("prompt".into(), Value::from(p));
                }
                b.extend(fields.into_iter().map(|(k, v)| (k.to_owned(), v)));
                if let Some(t) = template {
                    b.insert("chat_template".into(), Value::from(t));
                }
                b
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_body_gives_ids_or_a_reason(body in body()) {
            for tok in TOKENIZERS.iter() {
                for endpoint in [Endpoint::Chat, Endpoint::Completions] {
                    for templates in [RequestTemplates::Render, RequestTemplates::Decline] {
                        if let Ok(ids) = prompt_ids(tok, endpoint, &body, templates) {
                            prop_assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()), "ids stay in the vocabulary");
                        }
                    }
                }
            }
        }
    }
}

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

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};

use super::*;

fn record(attributes: &[(&str, &str)], started_ns: u64) -> LogRecord {
    LogRecord {
        time_unix_nano: started_ns,
        attributes: attributes
            .iter()
            .map(|(k, v)| KeyValue { key: k.to_string(), value: Some(AnyValue { value: Some(Value::StringValue(v.to_string())) }) })
            .collect(),
        ..Default::default()
    }
}

#[test]
fn a_record_reads_as_the_request_its_decider_and_first_body_byte() {
    let r = record(
        &[(attribute::REQUEST_ID, "req-1"), (attribute::ROUTER, "00000000000000ff"), (attribute::FIRST_BODY_US, "11488")],
        1_000_000_000,
    );
    let e = Entry::read(&r).unwrap();
    assert_eq!(e.request_id, "req-1");
    assert_eq!(e.decider, Some(255));
    assert_eq!(e.first_byte, Some(UNIX_EPOCH + Duration::from_micros(1_011_488)));
}

#[test]
fn envoys_dash_for_a_missing_value_is_missing_and_a_record_no_router_decided_is_left_out() {
    let e = Entry::read(&record(&[(attribute::REQUEST_ID, "r"), (attribute::FIRST_BODY_US, "-"), (attribute::ROUTER, "")], 5)).unwrap();
    assert_eq!((e.decider, e.first_byte), (None, None));
    assert_eq!(Entry::read(&record(&[(attribute::REQUEST_ID, "-"), (attribute::FIRST_BODY_US, "10")], 5)), None);
    assert_eq!(Entry::read(&record(&[(attribute::FIRST_BODY_US, "10")], 5)), None);
}

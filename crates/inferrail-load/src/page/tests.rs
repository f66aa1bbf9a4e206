//! The parser on real recorded vLLM pages, synthetic multi-rank and SGLang pages, and garbage.

use super::*;

const VLLM_IDLE: &str = include_str!("../../tests/fixtures/vllm-0.32.0-idle.txt");
const VLLM_LOADED: &str = include_str!("../../../../sim/tests/fixtures/vllm-0.32.0/metrics-under-load.txt");

#[test]
fn a_recorded_vllm_page_under_load() {
    let load = parse(VLLM_LOADED).unwrap();
    assert_eq!(
        load,
        EngineLoad {
            engine: Engine::Vllm,
            running: 4,
            waiting: 0,
            deferred: 0,
            kv_usage: 0.0016174810022278052,
            prefix_queries: Some(9249),
            prefix_hits: Some(3808),
            cache: Some(CacheInfo { block_size: 32, blocks: 32768 }),
            lora: None,
        }
    );
}

#[test]
fn a_recorded_idle_vllm_page() {
    let load = parse(VLLM_IDLE).unwrap();
    assert_eq!((load.running, load.waiting, load.kv_usage), (0, 0, 0.0));
    assert_eq!((load.prefix_queries, load.prefix_hits), (Some(10475), Some(4384)));
    assert_eq!(load.cache, Some(CacheInfo { block_size: 32, blocks: 32768 }));
}

const TWO_RANKS: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 3.0e+03
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 200.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
"#;

/// `vllm:lora_requests_info` as vLLM 0.32.0 (CPU, `--enable-lora --max-loras 1`)
/// wrote it after requests for adapters `ada`, then `adb`, then the base
/// model: one series per combination, the newest (largest value) idle.
const LORA_SERIES: &str = r#"# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="ada",waiting_lora_adapters="ada"} 1.7965977510017333e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 1.796597752769435e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="adb",waiting_lora_adapters="adb"} 1.7965977516016312e+09
"#;

#[test]
fn the_newest_lora_series_names_the_running_and_waiting_adapters() {
    let idle = parse(&format!("{TWO_RANKS}{LORA_SERIES}")).unwrap();
    assert_eq!(idle.lora.as_deref(), Some(&LoraReport { max_loras: 1, running: vec![], waiting: vec![] }));
    let busy = LORA_SERIES.replace("adb\"} 1.7965977516016312e+09", "adb,ada\"} 1.8e+09").replace("=\"adb\",w", "=\"adb,sql\",w");
    let load = parse(&format!("{TWO_RANKS}{busy}")).unwrap();
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(load.lora.as_deref(), Some(&LoraReport { max_loras: 1, running: names(&["adb", "sql"]), waiting: names(&["adb", "ada"]) }));
    assert_eq!(parse(TWO_RANKS).unwrap().lora, None, "no series, no adapters");
    assert_eq!(load.deferred, 0);
    let by_reason = "vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"capacity\"} 1.0\n\
        vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"deferred\"} 1.0\n\
        vllm:num_requests_waiting_by_reason{engine=\"1\",model_name=\"m\",reason=\"deferred\"} 0.0\n";
    assert_eq!(parse(&format!("{TWO_RANKS}{by_reason}")).unwrap().deferred, 1, "deferred, summed over ranks");
}

#[test]
fn data_parallel_ranks_sum_counts_and_average_kv_usage() {
    let load = parse(TWO_RANKS).unwrap();
    assert_eq!((load.running, load.waiting), (8, 2));
    assert_eq!(load.kv_usage, 0.5);
    assert_eq!((load.prefix_queries, load.prefix_hits), (Some(4000), Some(300)));
    assert_eq!(load.cache, Some(CacheInfo { block_size: 16, blocks: 2000 }));
}

/// Written from the names in SGLang's `python/sglang/srt/metrics/collector.py`
/// and the labels its scheduler sets, with two DP ranks.
const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 7.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 1.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 4.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 0.6
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 0.2
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{dp_rank="0",engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 0.31
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="qwen"} 3.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="qwen"} 5.0
sglang:time_to_first_token_seconds_sum{model_name="qwen"} NaN
"#;

#[test]
fn an_sglang_page() {
    let load = parse(SGLANG).unwrap();
    assert_eq!(load.engine, Engine::Sglang);
    assert_eq!((load.running, load.waiting), (8, 4));
    assert!((load.kv_usage - 0.4).abs() < 1e-12);
    assert_eq!((load.prefix_queries, load.prefix_hits, load.cache), (None, None, None));
}

#[test]
fn a_missing_family_is_an_error_never_an_idle_engine() {
    let without = |family: &str| -> String { VLLM_LOADED.lines().filter(|l| !l.starts_with(family)).map(|l| format!("{l}\n")).collect() };
    for family in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"] {
        // `vllm:num_requests_waiting_by_reason` shares the prefix; drop the family itself only.
        let page = without(&format!("{family}{{"));
        assert_eq!(parse(&page), Err(PageError::Missing(family)), "{family}");
    }
    let sglang: String = SGLANG.lines().filter(|l| !l.starts_with("sglang:num_queue_reqs")).collect::<Vec<_>>().join("\n");
    assert_eq!(parse(&sglang), Err(PageError::Missing("sglang:num_queue_reqs")));
    // Counters are optional: a page without them still reads.
    assert_eq!(parse(&without("vllm:prefix_cache_")).unwrap().prefix_queries, None);
}

#[test]
fn pages_of_other_things_are_errors() {
    assert_eq!(parse(""), Err(PageError::UnknownEngine));
    assert_eq!(parse("# HELP x\nprocess_cpu_seconds_total 1.5\n"), Err(PageError::UnknownEngine));
    let garbage = [
        "<html><body>502 Bad Gateway</body></html>",
        "vllm:num_requests_running{engine=\"0\" 1.0",
        "vllm:num_requests_running{engine=0} 1.0",
        "vllm:num_requests_running{engine=\"0\"} one",
        "vllm:num_requests_running{engine=\"0\"} 1.0 12:00",
        "vllm:num_requests_running{engine=\"0\"} 1.0 123 extra",
        "vllm:num_requests_running",
        "vllm:num_requests_running{engine=\"0\\\"}",
        "{\"object\": \"error\"}",
        "vllm:num_requests_running{engine=\"0\"} inf",
    ];
    for text in garbage {
        assert!(matches!(parse(text), Err(PageError::Malformed { line: 1, .. })), "{text:?}: {:?}", parse(text));
    }
}

#[test]
fn only_the_families_read_are_checked_past_their_name() {
    // A bucket routing never reads is skipped past its name, whatever follows it...
    let odd_bucket = format!("{VLLM_LOADED}vllm:request_prompt_tokens_bucket{{le=\"1.0\" one\n");
    assert_eq!(parse(&odd_bucket).unwrap().running, 4);
    // ...but every line's name is still checked, so garbage anywhere is an error.
    let garbage_after = format!("{VLLM_LOADED}<html><body>502 Bad Gateway</body></html>\n");
    let last = garbage_after.lines().count();
    assert!(matches!(parse(&garbage_after), Err(PageError::Malformed { line, what: "bad metric name" }) if line == last));
    let family_read = format!("{VLLM_LOADED}vllm:num_requests_running{{engine=\"1\"}} one\n");
    assert!(matches!(parse(&family_read), Err(PageError::Malformed { what: "bad value", .. })));
}

#[test]
fn impossible_values_are_errors() {
    let page = TWO_RANKS.replace("} 5.0", "} -5.0");
    assert!(matches!(parse(&page), Err(PageError::BadValue { family: "vllm:num_requests_running", .. })));
    let page = TWO_RANKS.replace("} 0.75", "} NaN");
    assert!(matches!(parse(&page), Err(PageError::BadValue { family: "vllm:kv_cache_usage_perc", .. })));
}

#[test]
fn escaped_label_values_and_timestamps_are_read() {
    let page = "vllm:num_requests_running{model_name=\"a \\\"b\\\", c\"} 2 1700000000000\n\
                vllm:num_requests_waiting{} 1\n\
                vllm:kv_cache_usage_perc 1.0000001\n";
    let load = parse(page).unwrap();
    assert_eq!((load.running, load.waiting, load.kv_usage), (2, 1, 1.0));
}

#[test]
fn random_bytes_never_panic() {
    // A cheap deterministic fuzz: slices and splices of a real page.
    let bytes = VLLM_LOADED.as_bytes();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..2000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let a = (x as usize) % bytes.len();
        let b = a + ((x >> 32) as usize) % (bytes.len() - a);
        let mut page = bytes[a..b].to_vec();
        if !page.is_empty() {
            let i = (x as usize >> 7) % page.len();
            page[i] = (x >> 56) as u8;
        }
        let _ = parse(&String::from_utf8_lossy(&page));
    }
}

proptest::proptest! {
    /// Any text is a load or an error, never a panic: a recorded page with
    /// any line replaced by a hostile one, and text of any shape.
    #[test]
    fn any_page_is_a_load_or_an_error_never_a_panic(
        line in 0usize..400,
        hostile in proptest::sample::select(vec![
            "vllm:num_requests_running{model_name=\"m\"} NaN",
            "vllm:num_requests_running{model_name=\"m\"} -1e309",
            "vllm:num_requests_waiting 18446744073709551616",
            "vllm:kv_cache_usage_perc{model_name=\"m\" 0.5",
            "vllm:kv_cache_usage_perc{model_name=\"m\"} inf",
            "# TYPE vllm:num_requests_running histogram",
            "vllm:cache_config_info{block_size=\"-16\",num_gpu_blocks=\"x\"} 1",
            "vllm:prefix_cache_queries_total{model_name=\"m\"} 1e400",
            "\u{0}\u{ffff}",
            "",
        ]),
        text in ".{0,300}",
    ) {
        for page in [VLLM_IDLE, VLLM_LOADED] {
            let mut lines: Vec<&str> = page.lines().collect();
            let at = line % lines.len();
            lines[at] = hostile;
            let _ = parse(&lines.join("\n"));
        }
        let _ = parse(&text);
    }
}

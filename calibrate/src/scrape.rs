//! The few numbers calibration reads from an engine's Prometheus page.
//!
//! Each is summed over every sample of its name, whatever the labels, so an
//! engine with several data-parallel ranks (`engine="0"`, `engine="1"`) counts
//! as one. A metric the page does not carry is `None`, never zero: the
//! caller picks another source instead of fitting on a made-up number.

/// A histogram's running sum and count.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Histogram {
    /// `_sum`: seconds observed so far.
    pub sum: f64,
    /// `_count`: observations so far.
    pub count: f64,
}

/// What one scrape of `/metrics` says.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Counters {
    /// `vllm:request_prefill_time_seconds`.
    pub prefill: Option<Histogram>,
    /// `vllm:time_to_first_token_seconds` (or SGLang's).
    pub ttft: Option<Histogram>,
    /// `vllm:prefix_cache_hits_total`: prompt tokens found cached.
    pub cache_hits: Option<f64>,
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up.
    pub cache_queries: Option<f64>,
    /// Requests running plus waiting, when the page says.
    pub in_flight: Option<f64>,
}

impl Counters {
    /// Reads a Prometheus text page.
    pub fn parse(page: &str) -> Self {
        let samples: Vec<(&str, f64)> = page.lines().filter_map(sample).collect();
        let total = |names: &[&str]| -> Option<f64> {
            let mut found = None;
            for (name, value) in &samples {
                if names.contains(name) {
                    *found.get_or_insert(0.0) += value;
                }
            }
            found
        };
        let histogram = |base: &[&str]| -> Option<Histogram> {
            let sums: Vec<String> = base.iter().map(|b| format!("{b}_sum")).collect();
            let counts: Vec<String> = base.iter().map(|b| format!("{b}_count")).collect();
            let sum = total(&sums.iter().map(String::as_str).collect::<Vec<_>>())?;
            let count = total(&counts.iter().map(String::as_str).collect::<Vec<_>>())?;
            Some(Histogram { sum, count })
        };
        let running = total(&["vllm:num_requests_running", "sglang:num_running_reqs"]);
        let waiting = total(&["vllm:num_requests_waiting", "sglang:num_queue_reqs"]);
        Self {
            prefill: histogram(&["vllm:request_prefill_time_seconds"]),
            ttft: histogram(&["vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"]),
            cache_hits: total(&["vllm:prefix_cache_hits_total"]),
            cache_queries: total(&["vllm:prefix_cache_queries_total"]),
            in_flight: match (running, waiting) {
                (None, None) => None,
                (r, w) => Some(r.unwrap_or(0.0) + w.unwrap_or(0.0)),
            },
        }
    }
}

/// A sample line's metric name and value; `None` for comments and anything unreadable.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' ', '\t'])?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    if rest.starts_with('{') {
        rest = &rest[labels_end(rest)?..];
    }
    let value = rest.split_whitespace().next()?;
    let value: f64 = value.parse().ok()?;
    Some((name, value))
}

/// Byte offset just past the label set's closing brace, honouring quoted values.
fn labels_end(s: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, ch) in s.char_indices() {
        match ch {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i + 1),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_recorded_vllm_page() {
        let page = "\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\",model_name=\"m\"} 0.0
vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 3.0
vllm:time_to_first_token_seconds_sum{engine=\"0\",model_name=\"m\"} 0.25
vllm:time_to_first_token_seconds_count{engine=\"1\",model_name=\"m\"} 1.0
vllm:time_to_first_token_seconds_sum{engine=\"1\",model_name=\"m\"} 0.5
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"a } b\"} 4384.0
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 1.0475e4
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1.0
";
        let c = Counters::parse(page);
        assert_eq!(c.ttft, Some(Histogram { sum: 0.75, count: 4.0 }));
        assert_eq!(c.prefill, None);
        assert_eq!(c.cache_hits, Some(4384.0));
        assert_eq!(c.cache_queries, Some(10475.0));
        assert_eq!(c.in_flight, Some(1.0));
    }

    #[test]
    fn an_empty_page_knows_nothing() {
        assert_eq!(Counters::parse("# nothing\n\ngarbage line\n"), Counters::default());
    }

    #[test]
    fn reads_the_reference_page() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/reference/vllm-0.32.0/metrics.txt");
        let Ok(page) = std::fs::read_to_string(path) else { return };
        let c = Counters::parse(&page);
        assert!(c.prefill.is_some() && c.ttft.is_some() && c.cache_hits.is_some() && c.in_flight.is_some(), "{c:?}");
    }
}

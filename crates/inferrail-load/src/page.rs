//! Reading an engine's Prometheus text page into an [`EngineLoad`].
//!
//! A hand-written line scanner for the text exposition format (0.0.4). Every
//! sample line's metric name is checked, so a page that is not a metrics page
//! is an error rather than an idle engine; the lines of the few families
//! routing reads are checked whole (labels, value, timestamp), and the rest
//! (most of a vLLM page: histogram buckets) are skipped past their name.
//! The page cannot be asked for less: vLLM 0.32.0 answers
//! `/metrics?name[]=...` with its whole page (50,633 bytes either way on a
//! CPU server), since the instrumentator's `/metrics` route comes before
//! `prometheus_client`'s app that would filter by name.
//!
//! The engine is recognized by the prefix of its families (`vllm:` or
//! `sglang:`). Data-parallel ranks publish one series per rank: counts are
//! summed over series, KV usage is their mean.

use std::sync::Arc;

#[cfg(test)]
mod tests;

/// The engine that served a metrics page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Engine {
    /// vLLM (families `vllm:*`).
    Vllm,
    /// SGLang (families `sglang:*`).
    Sglang,
}

impl Engine {
    /// The engine's name as operators write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }
}

/// The KV cache's geometry, from `vllm:cache_config_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheInfo {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks on the GPU, summed over data-parallel ranks.
    pub blocks: usize,
}

/// The LoRA adapters an engine runs and has waiting, from the newest series
/// of `vllm:lora_requests_info` (its value is the time it was set; vLLM
/// keeps every combination it ever wrote, so the largest value is now).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoraReport {
    /// Adapters one engine step runs (`max_lora`).
    pub max_loras: u32,
    /// Adapters of the running requests.
    pub running: Vec<String>,
    /// Adapters of the waiting requests.
    pub waiting: Vec<String>,
}

/// What an engine says about its own load at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineLoad {
    /// Which engine said it.
    pub engine: Engine,
    /// Requests running, summed over ranks.
    pub running: u32,
    /// Requests waiting for a slot, summed over ranks.
    pub waiting: u32,
    /// Of those, the ones passed over until a LoRA adapter slot (or a KV
    /// transfer) frees: `vllm:num_requests_waiting_by_reason{reason="deferred"}`, summed; 0 where absent.
    pub deferred: u32,
    /// Share of the KV cache in use (0.0 to 1.0), the mean over ranks.
    pub kv_usage: f64,
    /// Prompt tokens looked up in the prefix cache since start
    /// (`vllm:prefix_cache_queries_total`), summed; going backwards means the engine restarted.
    pub prefix_queries: Option<u64>,
    /// Prompt tokens found in the prefix cache since start (`vllm:prefix_cache_hits_total`).
    pub prefix_hits: Option<u64>,
    /// KV cache geometry, where the engine publishes it.
    pub cache: Option<CacheInfo>,
    /// LoRA adapters, where the engine serves them (vLLM with `--enable-lora`);
    /// shared, so that a snapshot stays cheap to copy out of the load table.
    pub lora: Option<Arc<LoraReport>>,
}

/// Why a page could not be read as an engine's load.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PageError {
    /// The page is not UTF-8 text.
    #[error("the page is not UTF-8 text")]
    NotUtf8,
    /// No `vllm:` or `sglang:` sample on the page.
    #[error("no vllm: or sglang: metrics on the page")]
    UnknownEngine,
    /// A family routing needs is absent.
    #[error("metric family {0} is missing")]
    Missing(&'static str),
    /// A line is not a valid sample line.
    #[error("line {line}: {what}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        what: &'static str,
    },
    /// A sample of a family routing needs has a value that makes no sense for it.
    #[error("{family} has the impossible value {value}")]
    BadValue {
        /// The family.
        family: &'static str,
        /// The value as parsed.
        value: f64,
    },
}

/// The families read for one engine.
struct Families {
    engine: Engine,
    running: &'static str,
    waiting: &'static str,
    kv_usage: &'static [&'static str],
    prefix_queries: Option<&'static str>,
    prefix_hits: Option<&'static str>,
    cache_info: Option<&'static str>,
    lora_info: Option<&'static str>,
    waiting_by_reason: Option<&'static str>,
}

const VLLM: Families = Families {
    engine: Engine::Vllm,
    running: "vllm:num_requests_running",
    waiting: "vllm:num_requests_waiting",
    // `gpu_cache_usage_perc` is the name before vLLM 0.10.
    kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    prefix_queries: Some("vllm:prefix_cache_queries_total"),
    prefix_hits: Some("vllm:prefix_cache_hits_total"),
    cache_info: Some("vllm:cache_config_info"),
    lora_info: Some("vllm:lora_requests_info"),
    waiting_by_reason: Some("vllm:num_requests_waiting_by_reason"),
};

const SGLANG: Families = Families {
    engine: Engine::Sglang,
    running: "sglang:num_running_reqs",
    waiting: "sglang:num_queue_reqs",
    kv_usage: &["sglang:token_usage"],
    prefix_queries: None,
    prefix_hits: None,
    cache_info: None,
    lora_info: None,
    waiting_by_reason: None,
};

/// Which of the families routing reads a sample belongs to.
#[derive(Clone, Copy)]
enum Read {
    Running,
    Waiting,
    /// The KV usage name at this index of [`Families::kv_usage`].
    KvUsage(usize),
    PrefixQueries,
    PrefixHits,
    CacheInfo,
    LoraInfo,
    WaitingByReason,
}

impl Families {
    /// The family routing reads for sample name `name`, if any.
    fn read(&self, name: &str) -> Option<Read> {
        let is = |family: Option<&str>| family == Some(name);
        if name == self.running {
            Some(Read::Running)
        } else if name == self.waiting {
            Some(Read::Waiting)
        } else if let Some(k) = self.kv_usage.iter().position(|n| *n == name) {
            Some(Read::KvUsage(k))
        } else if is(self.prefix_queries) {
            Some(Read::PrefixQueries)
        } else if is(self.prefix_hits) {
            Some(Read::PrefixHits)
        } else if is(self.cache_info) {
            Some(Read::CacheInfo)
        } else if is(self.lora_info) {
            Some(Read::LoraInfo)
        } else if is(self.waiting_by_reason) {
            Some(Read::WaitingByReason)
        } else {
            None
        }
    }
}

/// Sum and count of one family's series.
#[derive(Default, Clone, Copy)]
struct Acc {
    sum: f64,
    series: u32,
}

impl Acc {
    fn add(&mut self, v: f64) {
        self.sum += v;
        self.series += 1;
    }
    fn get(self) -> Option<Self> {
        (self.series > 0).then_some(self)
    }
}

/// Parses a Prometheus text page from vLLM or SGLang.
pub fn parse(page: &str) -> Result<EngineLoad, PageError> {
    let mut engine: Option<&Families> = None;
    let (mut running, mut waiting, mut prefix_q, mut prefix_h) = (Acc::default(), Acc::default(), Acc::default(), Acc::default());
    // One accumulator per accepted KV usage name; the first name present wins.
    let mut kv = [Acc::default(); 2];
    let mut block_size: Option<usize> = None;
    let mut blocks: Option<usize> = Some(0);
    let mut cache_series = 0u32;
    // The newest lora_requests_info series: its value and labels.
    let mut lora: Option<(f64, &str)> = None;
    let mut deferred = Acc::default();

    for (i, line) in page.lines().enumerate() {
        let line_no = i + 1;
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let malformed = |what| PageError::Malformed { line: line_no, what };
        let name = metric_name(line).map_err(malformed)?;
        let fams = match engine {
            Some(f) => f,
            None if name.starts_with("vllm:") => engine.insert(&VLLM),
            None if name.starts_with("sglang:") => engine.insert(&SGLANG),
            None => continue,
        };
        let Some(read) = fams.read(name) else { continue };
        let sample = sample(&line[name.len()..]).map_err(malformed)?;
        match read {
            Read::Running => running.add(sample.value),
            Read::Waiting => waiting.add(sample.value),
            Read::KvUsage(k) => kv[k].add(sample.value),
            Read::PrefixQueries => prefix_q.add(sample.value),
            Read::PrefixHits => prefix_h.add(sample.value),
            Read::CacheInfo => {
                cache_series += 1;
                let size = label(sample.labels, "block_size").and_then(|v| v.parse::<usize>().ok());
                let n = label(sample.labels, "num_gpu_blocks").and_then(|v| v.parse::<usize>().ok());
                // Ranks share one block size; a rank without a number makes the total unknown.
                block_size = block_size.or(size);
                blocks = match (blocks, n) {
                    (Some(total), Some(n)) => Some(total.saturating_add(n)),
                    _ => None,
                };
            }
            Read::WaitingByReason => {
                if label(sample.labels, "reason") == Some("deferred") {
                    deferred.add(sample.value);
                }
            }
            Read::LoraInfo => {
                if lora.is_none_or(|(newest, _)| sample.value > newest) {
                    lora = Some((sample.value, sample.labels));
                }
            }
        }
    }

    let fams = engine.ok_or(PageError::UnknownEngine)?;
    let running = running.get().ok_or(PageError::Missing(fams.running))?;
    let waiting = waiting.get().ok_or(PageError::Missing(fams.waiting))?;
    let (kv_name, kv) =
        fams.kv_usage.iter().zip(kv).find_map(|(n, acc)| acc.get().map(|a| (*n, a))).ok_or(PageError::Missing(fams.kv_usage[0]))?;
    let kv_usage = kv.sum / f64::from(kv.series);
    if !(kv_usage.is_finite() && kv_usage >= 0.0) {
        return Err(PageError::BadValue { family: kv_name, value: kv_usage });
    }
    let cache = match (block_size, blocks) {
        (Some(block_size), Some(blocks)) if cache_series > 0 => Some(CacheInfo { block_size, blocks }),
        _ => None,
    };
    Ok(EngineLoad {
        engine: fams.engine,
        running: count(fams.running, running.sum)?,
        waiting: count(fams.waiting, waiting.sum)?,
        deferred: deferred.get().map_or(Ok(0), |d| count("vllm:num_requests_waiting_by_reason", d.sum))?,
        // Engines report usage a hair over 1.0 at times; the share is what routing needs.
        kv_usage: kv_usage.min(1.0),
        prefix_queries: total(fams.prefix_queries, prefix_q)?,
        prefix_hits: total(fams.prefix_hits, prefix_h)?,
        cache,
        lora: lora.map(|(_, labels)| Arc::new(lora_report(labels))),
    })
}

/// A `vllm:lora_requests_info` series' labels: `max_lora` and the
/// comma-joined adapter names of the running and the waiting requests.
fn lora_report(labels: &str) -> LoraReport {
    let names = |key| label(labels, key).map_or_else(Vec::new, |v| v.split(',').filter(|n| !n.is_empty()).map(str::to_owned).collect());
    LoraReport {
        max_loras: label(labels, "max_lora").and_then(|v| v.parse().ok()).unwrap_or(0),
        running: names("running_lora_adapters"),
        waiting: names("waiting_lora_adapters"),
    }
}

/// A gauge of requests as a whole number.
fn count(family: &'static str, v: f64) -> Result<u32, PageError> {
    if (0.0..=f64::from(u32::MAX)).contains(&v) {
        // Gauges are whole numbers written as floats (`4.0`).
        Ok(v.round() as u32)
    } else {
        Err(PageError::BadValue { family, value: v })
    }
}

/// A counter of tokens, if the engine publishes it.
fn total(family: Option<&'static str>, acc: Acc) -> Result<Option<u64>, PageError> {
    let (Some(family), Some(acc)) = (family, acc.get()) else { return Ok(None) };
    // 2^53: past it an f64 no longer holds every whole number.
    if (0.0..=9_007_199_254_740_992.0).contains(&acc.sum) {
        Ok(Some(acc.sum.round() as u64))
    } else {
        Err(PageError::BadValue { family, value: acc.sum })
    }
}

/// One sample line's labels and value, borrowed from the page.
struct Sample<'a> {
    /// The text between the braces, checked.
    labels: &'a str,
    value: f64,
}

/// The checked metric name a sample line starts with: `[a-zA-Z_:][a-zA-Z0-9_:]*`
/// up to the labels or the value, in one pass (it runs on every line).
fn metric_name(line: &str) -> Result<&str, &'static str> {
    let bytes = line.as_bytes();
    let mut end = 0;
    loop {
        match bytes.get(end) {
            None => return Err("no value"),
            Some(b'{') => break,
            Some(b) if b.is_ascii_whitespace() => break,
            Some(b'a'..=b'z' | b'A'..=b'Z' | b'_' | b':') => end += 1,
            Some(b'0'..=b'9') if end > 0 => end += 1,
            Some(_) => return Err("bad metric name"),
        }
    }
    if end == 0 { Err("bad metric name") } else { Ok(&line[..end]) }
}

/// Checks what follows a sample's name, `{labels} value [timestamp]`, and splits off the labels and value.
fn sample(mut rest: &str) -> Result<Sample<'_>, &'static str> {
    let mut labels = "";
    if let Some(after) = rest.strip_prefix('{') {
        let len = label_set_len(after)?;
        labels = &after[..len];
        rest = &after[len + 1..];
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = fields.next().ok_or("no value")?;
    let value = parse_value(value).ok_or("bad value")?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|_| "bad timestamp")?;
    }
    if fields.next().is_some() {
        return Err("trailing text");
    }
    Ok(Sample { labels, value })
}

/// Prometheus values: floats, `NaN`, `+Inf`, `-Inf`.
fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        // Rust also accepts "inf" and "nan" spelled other ways; Prometheus does not.
        _ if v.bytes().any(|b| b.is_ascii_alphabetic() && b != b'e' && b != b'E') => None,
        _ => v.parse().ok(),
    }
}

/// The length of `k="v",k2="v2"` up to (not including) the closing brace.
fn label_set_len(s: &str) -> Result<usize, &'static str> {
    let bytes = s.as_bytes();
    let mut i = 0;
    loop {
        while bytes.get(i).is_some_and(|b| *b == b' ') {
            i += 1;
        }
        match bytes.get(i) {
            Some(b'}') => return Ok(i),
            None => return Err("unclosed labels"),
            _ => {}
        }
        let key_start = i;
        while bytes.get(i).is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_') {
            i += 1;
        }
        if i == key_start || bytes[key_start].is_ascii_digit() {
            return Err("bad label name");
        }
        if bytes.get(i) != Some(&b'=') || bytes.get(i + 1) != Some(&b'"') {
            return Err("bad label");
        }
        i += 2;
        loop {
            match bytes.get(i) {
                None => return Err("unclosed label value"),
                Some(b'\\') => i += 2,
                Some(b'"') => break,
                Some(_) => i += 1,
            }
        }
        i += 1;
        match bytes.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => return Ok(i),
            _ => return Err("bad label separator"),
        }
    }
}

/// A label's raw value in a checked label set (escapes left as written).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        let eq = rest.find("=\"")?;
        let k = &rest[..eq];
        let v_start = eq + 2;
        let bytes = rest.as_bytes();
        let mut i = v_start;
        while i < bytes.len() && bytes[i] != b'"' {
            i += if bytes[i] == b'\\' { 2 } else { 1 };
        }
        let v = rest.get(v_start..i)?;
        if k == key {
            return Some(v);
        }
        rest = rest.get(i + 1..)?;
    }
}

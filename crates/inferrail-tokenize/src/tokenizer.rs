//! A model's tokenizer: its vocabulary, special tokens and chat template.
//!
//! A tokenizer is named by a spec: `builtin:sim` (the simulator's), a local
//! directory holding `tokenizer.json` and `tokenizer_config.json`, or
//! `hf:<org>/<name>`, an entry already in the local Hugging Face cache (never
//! downloaded). Text is encoded in chunks that start at special tokens; a
//! special token splits the text for the Hugging Face tokenizer anyway, so the
//! chunks encode independently, and long ones (a system prompt, earlier turns)
//! are kept, up to a token budget, so a repeated piece is encoded once. A
//! long chunk (one long message) is cut further, where its words are cut
//! anyway and at places its text chooses, so the same passage is cut the
//! same way whatever comes before it, and its pieces are kept too ([`pieces`]).

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;
use xxhash_rust::xxh3::xxh3_128;

use crate::sim;
use crate::template::Template;
use bpe::Bpe;

/// A chunk shorter than this is encoded every time rather than cached.
const MIN_CACHED_BYTES: usize = 256;
/// A chunk longer than this is cut into pieces cached on their own.
const PIECES_ABOVE_BYTES: usize = 4 << 10;
/// One in this many places a chunk may be cut at is a cut: pieces of about
/// 1.5 KB of English.
const CUT_ONE_IN: u64 = 256;

/// Why a tokenizer could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// `tokenizer.json` or `tokenizer_config.json` is not what a tokenizer holds.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The model is not in the local Hugging Face cache.
    #[error("{0} is not in the Hugging Face cache (looked in {1}); inferrail never downloads models")]
    NotCached(String, PathBuf),
}

/// Special tokens a chat template sees as variables (`bos_token`, `eos_token`, ...).
#[derive(Debug, Clone, Default)]
pub struct SpecialTokens {
    /// `(name, text)` pairs, e.g. `("bos_token", "<s>")`.
    pub named: Vec<(String, String)>,
}

/// Turns text into the ids one engine's model sees.
pub struct Tokenizer {
    encoder: Encoder,
    /// The model's default chat template, if it has one.
    pub template: Option<Template>,
    /// Special tokens passed to templates.
    pub special: SpecialTokens,
    /// Ids an engine adds around a completion prompt (`add_special_tokens`).
    added: (Vec<u32>, Vec<u32>),
    /// The special tokens' ids, sorted.
    special_ids: Vec<u32>,
    cache: Option<Mutex<ChunkCache>>,
}

enum Encoder {
    Sim,
    Hf { tok: Box<tokenizers::Tokenizer>, cuts: Option<AhoCorasick>, fast: Option<Box<Bpe>> },
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.encoder {
            Encoder::Sim => "builtin:sim",
            Encoder::Hf { .. } => "huggingface",
        };
        f.debug_struct("Tokenizer").field("kind", &kind).field("template", &self.template.is_some()).finish()
    }
}

impl Tokenizer {
    /// Loads the tokenizer a spec names; `cache_tokens` bounds the chunk cache (0 turns it off).
    pub fn load(spec: &str, cache_tokens: usize) -> Result<Self, LoadError> {
        let mut tok = if spec == "builtin:sim" {
            Tokenizer {
                encoder: Encoder::Sim,
                template: Template::new(sim::CHAT_TEMPLATE).ok(),
                special: SpecialTokens::default(),
                added: (Vec::new(), Vec::new()),
                special_ids: Vec::new(),
                cache: None,
            }
        } else if let Some(repo) = spec.strip_prefix("hf:") {
            Self::from_dir(&hf_cache_dir(repo)?)?
        } else {
            Self::from_dir(Path::new(spec))?
        };
        tok.cache = NonZeroUsize::new(cache_tokens).map(|n| Mutex::new(ChunkCache::new(n)));
        Ok(tok)
    }

    /// Loads `tokenizer.json`, `tokenizer_config.json` and, when present, `chat_template.jinja` from `dir`.
    fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let json_path = dir.join("tokenizer.json");
        let invalid = |message: String| LoadError::Invalid { path: json_path.clone(), message };
        let json_text = std::fs::read_to_string(&json_path).map_err(|source| LoadError::Read { path: json_path.clone(), source })?;
        let hf: tokenizers::Tokenizer = json_text.parse().map_err(|e: tokenizers::Error| invalid(e.to_string()))?;
        let json: Value = serde_json::from_str(&json_text).map_err(|e| invalid(e.to_string()))?;
        let fast = Bpe::new(&json, &hf).map(Box::new);
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read(&config_path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|e| LoadError::Invalid { path: config_path.clone(), message: e.to_string() })?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(source) => return Err(LoadError::Read { path: config_path, source }),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => default_template(&config),
            Err(source) => return Err(LoadError::Read { path: jinja_path, source }),
        };
        let template = source
            .map(|s| {
                Template::new(&s).map_err(|e| LoadError::Invalid { path: config_path.clone(), message: format!("chat template: {e}") })
            })
            .transpose()?;

        let mut named = Vec::new();
        for name in ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"] {
            if let Some(text) = config.get(name).and_then(token_text) {
                named.push((name.to_owned(), text));
            }
        }
        if let Some(Value::Object(extra)) = config.get("extra_special_tokens") {
            named.extend(extra.iter().filter_map(|(k, v)| Some((k.clone(), token_text(v)?))));
        }
        let added = added_around(&hf);
        let cuts = cut_tokens(&hf);
        let mut special_ids: Vec<u32> = hf.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect();
        special_ids.sort_unstable();
        Ok(Tokenizer {
            encoder: Encoder::Hf { tok: Box::new(hf), cuts, fast },
            template,
            special: SpecialTokens { named },
            added,
            special_ids,
            cache: None,
        })
    }

    /// The ids of `text`; with `add_special_tokens`, the ones the engine adds
    /// around a completion prompt (a leading BOS for many models) too.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 3 + self.added.0.len() + self.added.1.len());
        if add_special_tokens {
            ids.extend_from_slice(&self.added.0);
        }
        match &self.encoder {
            Encoder::Sim => ids.extend(sim::encode(text)),
            Encoder::Hf { tok, cuts, fast } => {
                let mut start = 0;
                if let Some(cuts) = cuts {
                    for m in cuts.find_iter(text) {
                        if m.start() > start {
                            self.encode_chunk(tok, fast.as_deref(), &text[start..m.start()], &mut ids);
                        }
                        start = m.start();
                    }
                }
                if start < text.len() {
                    self.encode_chunk(tok, fast.as_deref(), &text[start..], &mut ids);
                }
            }
        }
        if add_special_tokens {
            ids.extend_from_slice(&self.added.1);
        }
        ids
    }

    fn encode_chunk(&self, tok: &tokenizers::Tokenizer, fast: Option<&Bpe>, chunk: &str, out: &mut Vec<u32>) {
        match fast.filter(|f| chunk.len() > PIECES_ABOVE_BYTES && self.cache.is_some() && f.cuts_at_spaces()) {
            Some(_) => pieces(chunk, CUT_ONE_IN).for_each(|piece| self.encode_piece(tok, fast, piece, out)),
            None => self.encode_piece(tok, fast, chunk, out),
        }
    }

    fn encode_piece(&self, tok: &tokenizers::Tokenizer, fast: Option<&Bpe>, chunk: &str, out: &mut Vec<u32>) {
        let cache = self.cache.as_ref().filter(|_| chunk.len() >= MIN_CACHED_BYTES);
        let key = cache.map(|_| xxh3_128(chunk.as_bytes()));
        if let (Some(cache), Some(key)) = (cache, key)
            && let Some(ids) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(key)
        {
            out.extend_from_slice(&ids);
            return;
        }
        let start = out.len();
        match fast {
            Some(fast) => fast.encode(chunk, out),
            // Encoding without added special tokens cannot fail for a valid tokenizer; an error yields no ids.
            None => out.extend_from_slice(tok.encode_fast(chunk, false).as_ref().map_or(&[][..], |e| e.get_ids())),
        }
        if let (Some(cache), Some(key)) = (cache, key) {
            cache.lock().unwrap_or_else(|p| p.into_inner()).put(key, out[start..].into());
        }
    }

    /// Where in `ids` the special tokens are (a chat template's turn
    /// markers). The simulator's tokenizer has none: its chat format's
    /// markers (`<|im_end|>`) start with a piece `<` followed by a piece `|`.
    pub fn special_positions(&self, ids: &[u32]) -> Vec<usize> {
        match self.encoder {
            Encoder::Sim => {
                let marker = [sim::piece_id("<"), sim::piece_id("|")];
                ids.windows(2).enumerate().filter(|(_, w)| *w == marker).map(|(at, _)| at).collect()
            }
            Encoder::Hf { .. } => {
                ids.iter().enumerate().filter(|(_, id)| self.special_ids.binary_search(id).is_ok()).map(|(at, _)| at).collect()
            }
        }
    }

    /// The text of one id, or `None` for an id outside the vocabulary.
    pub fn decode(&self, id: u32) -> Option<String> {
        match &self.encoder {
            Encoder::Sim => sim::decode(id).map(str::to_owned),
            Encoder::Hf { tok, .. } => tok.decode(&[id], false).ok(),
        }
    }

    /// Ids a mock engine may generate: each a whole word that decodes alone and encodes back to itself.
    pub fn generation_ids(&self) -> Vec<u32> {
        match &self.encoder {
            Encoder::Sim => sim::GENERATION_WORDS.iter().map(|w| sim::piece_id(w)).collect(),
            Encoder::Hf { tok, .. } => {
                let mut ids: Vec<u32> = sim::GENERATION_WORDS
                    .iter()
                    .flat_map(|w| [format!(" {}", w.trim_end()), w.trim_end().to_owned()])
                    .filter_map(|w| match tok.encode_fast(w.as_str(), false).map(|e| e.get_ids().to_vec()) {
                        Ok(ids) if ids.len() == 1 && tok.decode(&ids, false).is_ok_and(|d| d == w) => Some(ids[0]),
                        _ => None,
                    })
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                if ids.is_empty() {
                    // A vocabulary without whole-word tokens: any ids will do.
                    ids = tok.encode_fast("the river", false).map(|e| e.get_ids().to_vec()).unwrap_or_default();
                }
                ids
            }
        }
    }

    /// Size of the id space: ids at or above it are not tokens.
    pub fn vocab_size(&self) -> usize {
        match &self.encoder {
            Encoder::Sim => sim::VOCAB_SIZE as usize,
            Encoder::Hf { tok, .. } => tok.get_vocab_size(true),
        }
    }

    /// Tokens held by the chunk cache now.
    pub fn cached_tokens(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.lock().unwrap_or_else(|p| p.into_inner()).tokens)
    }
}

/// The text of a special token in `tokenizer_config.json`: a string or an `AddedToken` object.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// The template transformers uses when none is named: `chat_template` as a
/// string, or the entry named `default` of a list of named templates.
fn default_template(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

/// What `add_special_tokens` puts before and after a prompt: the tokenizer's
/// post-processor decides (transformers 5 ignores `add_bos_token` in
/// `tokenizer_config.json` when `tokenizer.json` exists).
fn added_around(tok: &tokenizers::Tokenizer) -> (Vec<u32>, Vec<u32>) {
    let ids = |text: &str, special: bool| tok.encode_fast(text, special).map(|e| e.get_ids().to_vec()).unwrap_or_default();
    let (with, without) = (ids("a", true), ids("a", false));
    match with.windows(without.len().max(1)).position(|w| w == without.as_slice()) {
        Some(at) if !without.is_empty() => (with[..at].to_vec(), with[at + without.len()..].to_vec()),
        _ => (Vec::new(), Vec::new()),
    }
}

/// Added tokens a chunk may start at: they split the text on their own and
/// take no whitespace from the text before them.
fn cut_tokens(tok: &tokenizers::Tokenizer) -> Option<AhoCorasick> {
    let mut patterns: Vec<String> = tok
        .get_added_tokens_decoder()
        .into_values()
        .filter(|t| t.special && !t.normalized && !t.lstrip && !t.single_word && !t.content.is_empty())
        .map(|t| t.content)
        .collect();
    patterns.sort();
    AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(patterns).ok()
}

/// `text` cut before some of the spaces that stand between two ASCII
/// letters, where the byte-level families end one word and start the next
/// (`" word"`), so the pieces encode to the ids of the whole. Which of those
/// spaces is a cut depends only on the (up to) eight bytes before it, about
/// one in `one_in`: a passage is cut the same way wherever it appears, and
/// its pieces hit the cache after a prefix the cache has never seen.
fn pieces(text: &str, one_in: u64) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    let cut = move |p: usize| {
        if p == 0 || !(bytes[p - 1].is_ascii_alphabetic() && bytes.get(p + 1).is_some_and(u8::is_ascii_alphabetic)) {
            return false;
        }
        let word = match bytes[..p].last_chunk::<8>() {
            Some(window) => u64::from_be_bytes(*window),
            None => bytes[..p].iter().fold(0u64, |w, &b| (w << 8) | u64::from(b)),
        };
        // SplitMix64's finalizer: every bit of the result depends on every
        // byte of the window. (One multiply's bits 32-39 saw only the last
        // five bytes: a text of 64 distinct words was never cut.)
        let mut z = (word ^ (word >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % one_in == 0
    };
    let mut start = 0;
    let mut cuts = memchr::memchr_iter(b' ', bytes).filter(move |&p| cut(p)).chain(std::iter::once(bytes.len()));
    std::iter::from_fn(move || {
        let end = cuts.next()?;
        // Cuts stand before ASCII spaces: char boundaries.
        let piece = &text[start..end];
        start = end;
        Some(piece)
    })
}

/// Resolves `org/name` to its snapshot in the local Hugging Face cache.
fn hf_cache_dir(repo: &str) -> Result<PathBuf, LoadError> {
    let env = |k: &str| std::env::var_os(k).map(PathBuf::from);
    let hub = env("HF_HUB_CACHE")
        .or_else(|| env("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| env("XDG_CACHE_HOME").map(|h| h.join("huggingface/hub")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/huggingface/hub")))
        .unwrap_or_default();
    let model = hub.join(format!("models--{}", repo.replace('/', "--")));
    let revision = std::fs::read_to_string(model.join("refs/main")).map_err(|_| LoadError::NotCached(repo.into(), hub.clone()))?;
    let dir = model.join("snapshots").join(revision.trim());
    if dir.join("tokenizer.json").is_file() { Ok(dir) } else { Err(LoadError::NotCached(repo.into(), hub)) }
}

/// Encoded chunks by the hash of their text, least recently used dropped first
/// once their tokens exceed the budget.
struct ChunkCache {
    map: lru::LruCache<u128, Arc<[u32]>>,
    tokens: usize,
    budget: usize,
}

impl ChunkCache {
    fn new(budget: NonZeroUsize) -> Self {
        ChunkCache { map: lru::LruCache::unbounded(), tokens: 0, budget: budget.get() }
    }

    fn get(&mut self, key: u128) -> Option<Arc<[u32]>> {
        self.map.get(&key).cloned()
    }

    fn put(&mut self, key: u128, ids: Arc<[u32]>) {
        if ids.len() > self.budget {
            return;
        }
        self.tokens += ids.len();
        if let Some(old) = self.map.put(key, ids) {
            self.tokens -= old.len();
        }
        while self.tokens > self.budget {
            match self.map.pop_lru() {
                Some((_, old)) => self.tokens -= old.len(),
                None => break,
            }
        }
    }
}

mod bpe;
#[cfg(test)]
pub(crate) mod tests;

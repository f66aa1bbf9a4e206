//! A fast BPE encoder for the tokenizer families whose pipeline it
//! reproduces, giving the ids the Hugging Face pipeline gives: the byte-level
//! tokenizers of Qwen 2/3, Llama 3 and DeepSeek V3, and the SentencePiece-style
//! tokenizer of Gemma 3.
//!
//! The Hugging Face pipeline spends most of an encode in bookkeeping this
//! router does not need (offsets, alignments), in the regexes that split text
//! into words, and (for Gemma, which splits nothing) in merging whole texts.
//! Here [`split`] cuts words without a regex; a word is merged from its bytes
//! or characters by a loop over the model's merge ranks, and its ids are kept
//! in a concurrent cache, so it is merged once. Tokenizers of any other shape
//! keep the Hugging Face pipeline; the property tests compare the two on
//! adversarial text.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::{Value, json};
use split::Split;
use unicode_normalization_alignments::{IsNormalized, UnicodeNormalization, is_nfc_quick};

/// Words kept before the cache starts over.
const WORD_CACHE: usize = 1 << 17;
/// Longer words (runs of symbols, blobs) are merged each time rather than kept.
const MAX_CACHED_WORD: usize = 64;

mod split;

/// Encodes text the way one of the BPE tokenizers in the module doc does.
pub(super) struct Bpe {
    normalizer: Normalizer,
    split: Split,
    /// Added tokens matched on the raw text, then (in what is left) those
    /// matched on normalized text, as the Hugging Face pipeline finds them.
    added: [AddedTokens; 2],
    /// What words are merged from.
    alphabet: Alphabet,
    /// Each merge by the pair of ids it joins: its rank (lower merges first) and the id it makes.
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// With `ignore_merges`, whole words found in the vocabulary (by their bytes) are one token.
    whole_words: Option<HashMap<Box<[u8]>, u32>>,
    /// Ids of words already encoded.
    words: papaya::HashMap<Box<str>, Box<[u32]>, foldhash::fast::RandomState>,
}

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// What happens to text before it is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Normalizer {
    None,
    Nfc,
    /// Spaces become `▁` (SentencePiece's metaspace).
    Metaspace,
}

/// The symbols a word starts as, before any merge.
enum Alphabet {
    /// Byte-level: each byte is a token (written in GPT-2's printable characters).
    Bytes([u32; 256]),
    /// Each character in the vocabulary is a token; any other falls back to its UTF-8 bytes' `<0xXX>` tokens.
    Chars { ids: HashMap<char, u32>, bytes: [u32; 256] },
}

/// Added tokens, found leftmost-longest, and their ids by pattern index.
type AddedTokens = Option<(AhoCorasick, Vec<u32>)>;

impl Bpe {
    /// The fast encoder for `tok`, or `None` when its pipeline is not one this module reproduces.
    pub(super) fn new(json: &Value, tok: &tokenizers::Tokenizer) -> Option<Self> {
        let plain = |v: &Value| v.is_null() || v == "";
        let model = &json["model"];
        let bpe_ok = model["type"] == "BPE"
            && model["dropout"].is_null()
            && plain(&model["continuing_subword_prefix"])
            && plain(&model["end_of_word_suffix"]);
        let metaspace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
        let (normalizer, split, alphabet) = match &json["normalizer"] {
            // Gemma: spaces become ▁, its split on spaces then finds none, and the model falls back to bytes.
            n if *n == metaspace => {
                let no_split = json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false});
                let pre_ok = json["pre_tokenizer"].is_null() || json["pre_tokenizer"] == no_split;
                if !pre_ok || model["byte_fallback"] != true || model["ignore_merges"] == true {
                    return None;
                }
                let (alphabet, glued) = chars(model)?;
                (Normalizer::Metaspace, Split::Metaspace { glued }, alphabet)
            }
            n => {
                let normalizer = match n {
                    Value::Null => Normalizer::None,
                    n if *n == json!({"type": "Sequence", "normalizers": []}) => Normalizer::None,
                    n if *n == json!({"type": "NFC"}) => Normalizer::Nfc,
                    _ => return None,
                };
                let [splits @ .., byte_level] = json["pre_tokenizer"]["pretokenizers"].as_array()?.as_slice() else { return None };
                let byte_level_ok = json["pre_tokenizer"]["type"] == "Sequence"
                    && byte_level["type"] == "ByteLevel"
                    && byte_level["add_prefix_space"] == false
                    && byte_level["use_regex"] == false
                    && model["byte_fallback"] != true;
                if !byte_level_ok {
                    return None;
                }
                (normalizer, Split::of(splits)?, Alphabet::Bytes(byte_ids(model)?))
            }
        };
        // Added tokens that strip whitespace or match whole words only, or
        // that match normalized text (when normalizing changes it), are left to the full pipeline.
        let tokens = tok.get_added_tokens_decoder();
        let odd = |t: &tokenizers::AddedToken| {
            (normalizer != Normalizer::None && t.normalized) || t.lstrip || t.rstrip || t.single_word || t.content.is_empty()
        };
        if !bpe_ok || tokens.values().any(odd) {
            return None;
        }
        let merges = merges(model)?;
        let whole_words = if model["ignore_merges"] == true { Some(whole_words(model)?) } else { None };
        let finder = |normalized: bool| -> Option<AddedTokens> {
            // In id order, so text two tokens share always gives the same (lowest) id.
            let mut found: Vec<(u32, String)> =
                tokens.iter().filter(|(_, t)| t.normalized == normalized).map(|(&id, t)| (id, t.content.clone())).collect();
            found.sort_unstable();
            let (ids, patterns): (Vec<u32>, Vec<String>) = found.into_iter().unzip();
            if patterns.is_empty() {
                return Some(None);
            }
            Some(Some((AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(&patterns).ok()?, ids)))
        };
        let added = [finder(false)?, finder(true)?];
        let words =
            papaya::HashMap::builder().hasher(Default::default()).capacity(WORD_CACHE).resize_mode(papaya::ResizeMode::Blocking).build();
        Some(Bpe { normalizer, split, added, alphabet, merges, whole_words, words })
    }

    /// Whether text may be cut before a space between two ASCII letters and
    /// its pieces encoded apart (see [`super::pieces`]): true for the
    /// byte-level families, whose split ends a word at a space and starts the
    /// next with it, and whose normalizer (none, or NFC) composes nothing
    /// across a space. Gemma's metaspace merges whole texts: never.
    pub(super) fn cuts_at_spaces(&self) -> bool {
        self.normalizer != Normalizer::Metaspace
    }

    /// Appends the ids of `text`, encoded without added special tokens.
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let words = self.words.pin();
        let encode_words = |segment: &str, out: &mut Vec<u32>| {
            let normalized;
            let segment = match self.normalizer {
                Normalizer::Nfc if !segment.is_ascii() && is_nfc_quick(segment.chars()) != IsNormalized::Yes => {
                    normalized = segment.nfc().map(|(c, _)| c).collect::<String>();
                    normalized.as_str()
                }
                Normalizer::Metaspace if segment.contains(' ') => {
                    normalized = segment.replace(' ', "\u{2581}");
                    normalized.as_str()
                }
                _ => segment,
            };
            self.split.words(segment, |word| {
                if let Some(ids) = words.get(word) {
                    out.extend_from_slice(ids);
                    return;
                }
                let ids = self.merge(word);
                out.extend_from_slice(&ids);
                if word.len() <= MAX_CACHED_WORD {
                    if words.len() >= WORD_CACHE {
                        words.clear();
                    }
                    words.insert(word.into(), ids);
                }
            });
        };
        let [raw, normalized] = &self.added;
        with_added(raw, text, out, &mut |gap, out| with_added(normalized, gap, out, &mut |gap, out| encode_words(gap, out)));
    }

    /// The ids of one word: its bytes, merged pair by pair, the lowest-ranked
    /// pair first and the leftmost of equals first, as the BPE model merges.
    /// Candidate merges wait in a heap, so a long word costs n log n, not n².
    fn merge(&self, word: &str) -> Box<[u32]> {
        if let Some(&id) = self.whole_words.as_ref().and_then(|w| w.get(word.as_bytes())) {
            return Box::new([id]);
        }
        let mut first: Vec<u32> = Vec::with_capacity(word.len());
        match &self.alphabet {
            Alphabet::Bytes(ids) => first.extend(word.bytes().map(|b| ids[usize::from(b)])),
            Alphabet::Chars { ids, bytes } => {
                for c in word.chars() {
                    match ids.get(&c) {
                        Some(&id) => first.push(id),
                        None => first.extend(c.encode_utf8(&mut [0; 4]).bytes().map(|b| bytes[usize::from(b)])),
                    }
                }
            }
        }
        // The symbols as a linked list (index, not pointer); a merged-away symbol's id is GONE.
        const GONE: u32 = u32::MAX;
        let mut syms: Vec<Sym> = first.iter().enumerate().map(|(i, &id)| Sym { id, prev: i.wrapping_sub(1), next: i + 1 }).collect();
        let id_at = |syms: &[Sym], i: usize| syms.get(i).map(|s| s.id).filter(|&id| id != GONE);
        let pair = |syms: &[Sym], left: usize| self.merges.get(&(id_at(syms, left)?, id_at(syms, syms[left].next)?)).copied();
        let mut heap = BinaryHeap::with_capacity(syms.len());
        for left in 0..syms.len().saturating_sub(1) {
            if let Some((rank, joined)) = pair(&syms, left) {
                heap.push(Reverse((rank, left, joined)));
            }
        }
        while let Some(Reverse((rank, left, joined))) = heap.pop() {
            // A candidate is stale when either symbol has changed since it was pushed.
            if id_at(&syms, left).is_none() || pair(&syms, left) != Some((rank, joined)) {
                continue;
            }
            let right = syms[left].next;
            let after = syms[right].next;
            syms[left].id = joined;
            syms[right].id = GONE;
            syms[left].next = after;
            if let Some(after) = syms.get_mut(after) {
                after.prev = left;
            }
            for l in [syms[left].prev, left] {
                if l < syms.len()
                    && let Some((rank, joined)) = pair(&syms, l)
                {
                    heap.push(Reverse((rank, l, joined)));
                }
            }
        }
        syms.iter().map(|s| s.id).filter(|&id| id != GONE).collect()
    }
}

/// One symbol of a word being merged.
struct Sym {
    id: u32,
    prev: usize,
    next: usize,
}

fn token_id(model: &Value, token: &str) -> Option<u32> {
    model["vocab"].get(token)?.as_u64().and_then(|id| u32::try_from(id).ok())
}

/// The id of each byte in a byte-level vocabulary.
fn byte_ids(model: &Value) -> Option<[u32; 256]> {
    let mut ids = [0; 256];
    for (id, c) in ids.iter_mut().zip(byte_chars()) {
        *id = token_id(model, c.encode_utf8(&mut [0; 4]))?;
    }
    Some(ids)
}

/// With `ignore_merges`, a byte-level word found whole in the vocabulary is one token: the vocabulary by bytes.
fn whole_words(model: &Value) -> Option<HashMap<Box<[u8]>, u32>> {
    let byte_of: HashMap<char, u8> = byte_chars().iter().zip(0..=255u8).map(|(&c, b)| (c, b)).collect();
    let words = model["vocab"].as_object()?.iter().filter_map(|(token, id)| {
        let bytes: Option<Box<[u8]>> = token.chars().map(|c| byte_of.get(&c).copied()).collect();
        Some((bytes?, u32::try_from(id.as_u64()?).ok()?))
    });
    Some(words.collect())
}

/// A SentencePiece-style vocabulary's characters and byte-fallback tokens,
/// and the characters some token has right before a `▁` (a word boundary
/// after one of them may be merged across).
fn chars(model: &Value) -> Option<(Alphabet, Vec<char>)> {
    let mut ids = HashMap::default();
    let mut glued = Vec::new();
    for (token, id) in model["vocab"].as_object()? {
        let mut it = token.chars();
        if let (Some(c), None) = (it.next(), it.next()) {
            ids.insert(c, u32::try_from(id.as_u64()?).ok()?);
        }
        let chars: Vec<char> = token.chars().collect();
        for w in chars.windows(2) {
            if w[1] == '\u{2581}' && w[0] != '\u{2581}' && !glued.contains(&w[0]) {
                glued.push(w[0]);
            }
        }
    }
    let mut bytes = [0; 256];
    for (b, id) in bytes.iter_mut().enumerate() {
        *id = token_id(model, &format!("<0x{b:02X}>"))?;
    }
    Some((Alphabet::Chars { ids, bytes }, glued))
}

/// Each merge by the pair of ids it joins: its rank (lower merges first) and the id it makes.
fn merges(model: &Value) -> Option<HashMap<(u32, u32), (u32, u32)>> {
    let mut merges = HashMap::default();
    for (rank, merge) in model["merges"].as_array()?.iter().enumerate() {
        let (a, b) = match merge {
            Value::String(pair) => pair.split_once(' ')?,
            Value::Array(pair) => (pair.first()?.as_str()?, pair.get(1)?.as_str()?),
            _ => return None,
        };
        let joined = token_id(model, &format!("{a}{b}"))?;
        // A pair listed twice keeps its last rank, as the Hugging Face model builds its map.
        merges.insert((token_id(model, a)?, token_id(model, b)?), (u32::try_from(rank).ok()?, joined));
    }
    Some(merges)
}

/// Appends the ids of `text`: each added token's id, and what `between` makes of the text between them.
fn with_added(added: &AddedTokens, text: &str, out: &mut Vec<u32>, between: &mut impl FnMut(&str, &mut Vec<u32>)) {
    let mut start = 0;
    if let Some((finder, ids)) = added {
        for m in finder.find_iter(text) {
            between(&text[start..m.start()], out);
            out.push(ids[m.pattern().as_usize()]);
            start = m.end();
        }
    }
    between(&text[start..], out);
}

/// GPT-2's reversible map from bytes to printable characters, which byte-level vocabularies are written in.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for (b, c) in chars.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *c = char::from_u32(code).unwrap_or('\0');
    }
    chars
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_four_families_take_the_fast_path() {
        use crate::tokenizer::tests::{FAMILIES, family_dir};
        for family in FAMILIES {
            let tok = crate::Tokenizer::load(family_dir(family).to_str().unwrap(), 0).unwrap();
            let crate::tokenizer::Encoder::Hf { fast, .. } = &tok.encoder else { panic!() };
            assert!(fast.is_some(), "{family}");
        }
    }
}

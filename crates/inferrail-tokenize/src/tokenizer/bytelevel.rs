//! A fast encoder for the byte-level BPE tokenizers of the Qwen 2/3, Llama 3
//! and DeepSeek V3 families, giving the ids the Hugging Face pipeline gives.
//!
//! The Hugging Face pipeline spends most of an encode in bookkeeping this
//! router does not need (offsets, alignments) and in the regexes that split
//! text into words. Here [`split`] scans for words without a regex; a word is
//! merged from its bytes by a loop over the model's merge ranks, and its ids
//! are kept in a concurrent cache, so it is merged once. Tokenizers of any
//! other shape keep the Hugging Face pipeline; the property tests compare the
//! two on adversarial text.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use aho_corasick::{AhoCorasick, MatchKind};
use split::Split;

mod split;
use serde_json::{Value, json};
use unicode_normalization_alignments::{IsNormalized, UnicodeNormalization, is_nfc_quick};

/// Words kept before the cache starts over.
const WORD_CACHE: usize = 1 << 17;
/// Longer words (runs of symbols, blobs) are merged each time rather than kept.
const MAX_CACHED_WORD: usize = 64;

/// Encodes text the way a byte-level BPE tokenizer with one of [`split`]'s splits does.
pub(super) struct ByteLevel {
    split: Split,
    /// Whether text is NFC-normalized before it is split.
    nfc: bool,
    /// Added tokens matched on the raw text, then (in what is left) those
    /// matched on normalized text, as the Hugging Face pipeline finds them.
    added: [AddedTokens; 2],
    /// The id of each byte alone.
    byte_ids: [u32; 256],
    /// Each merge by the pair of ids it joins: its rank (lower merges first) and the id it makes.
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// With `ignore_merges`, whole words found in the vocabulary (by their bytes) are one token.
    whole_words: Option<HashMap<Box<[u8]>, u32>>,
    /// Ids of words already encoded.
    words: papaya::HashMap<Box<str>, Box<[u32]>, foldhash::fast::RandomState>,
}

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Added tokens, found leftmost-longest, and their ids by pattern index.
type AddedTokens = Option<(AhoCorasick, Vec<u32>)>;

impl ByteLevel {
    /// The fast encoder for `tok`, or `None` when its pipeline is not one this module reproduces.
    pub(super) fn new(json: &Value, tok: &tokenizers::Tokenizer) -> Option<Self> {
        let nfc = match &json["normalizer"] {
            Value::Null => false,
            n if *n == json!({"type": "Sequence", "normalizers": []}) => false,
            n if *n == json!({"type": "NFC"}) => true,
            _ => return None,
        };
        let [splits @ .., byte_level] = json["pre_tokenizer"]["pretokenizers"].as_array()?.as_slice() else { return None };
        let split = Split::of(splits)?;
        let plain = |v: &Value| v.is_null() || v == "";
        let model = &json["model"];
        let shape_ok = json["pre_tokenizer"]["type"] == "Sequence"
            && byte_level["type"] == "ByteLevel"
            && byte_level["add_prefix_space"] == false
            && byte_level["use_regex"] == false
            && model["type"] == "BPE"
            && model["dropout"].is_null()
            && model["byte_fallback"] != true
            && plain(&model["continuing_subword_prefix"])
            && plain(&model["end_of_word_suffix"]);
        // Added tokens that strip whitespace or match whole words only, or
        // that match NFC-normalized text, are left to the full pipeline.
        let tokens = tok.get_added_tokens_decoder();
        if !shape_ok || tokens.values().any(|t| (nfc && t.normalized) || t.lstrip || t.rstrip || t.single_word || t.content.is_empty()) {
            return None;
        }
        let (byte_ids, merges, whole_words) = vocabulary(model)?;
        let finder = |normalized: bool| -> Option<AddedTokens> {
            let (ids, patterns): (Vec<u32>, Vec<String>) =
                tokens.iter().filter(|(_, t)| t.normalized == normalized).map(|(&id, t)| (id, t.content.clone())).unzip();
            if patterns.is_empty() {
                return Some(None);
            }
            Some(Some((AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(&patterns).ok()?, ids)))
        };
        let added = [finder(false)?, finder(true)?];
        let words =
            papaya::HashMap::builder().hasher(Default::default()).capacity(WORD_CACHE).resize_mode(papaya::ResizeMode::Blocking).build();
        Some(ByteLevel { split, nfc, added, byte_ids, merges, whole_words, words })
    }

    /// Appends the ids of `text`, encoded without added special tokens.
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let words = self.words.pin();
        let encode_words = |segment: &str, out: &mut Vec<u32>| {
            let normalized;
            let segment = if self.nfc && !segment.is_ascii() && is_nfc_quick(segment.chars()) != IsNormalized::Yes {
                normalized = segment.nfc().map(|(c, _)| c).collect::<String>();
                normalized.as_str()
            } else {
                segment
            };
            self.split.words(segment, |word| {
                if let Some(ids) = words.get(word) {
                    out.extend_from_slice(ids);
                    return;
                }
                let ids = self.merge(word.as_bytes());
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
    fn merge(&self, word: &[u8]) -> Box<[u32]> {
        if let Some(&id) = self.whole_words.as_ref().and_then(|w| w.get(word)) {
            return Box::new([id]);
        }
        // The symbols as a linked list over the word's bytes (index, not pointer); a merged-away symbol's id is GONE.
        const GONE: u32 = u32::MAX;
        let mut syms: Vec<Sym> =
            (0..word.len()).map(|i| Sym { id: self.byte_ids[usize::from(word[i])], prev: i.wrapping_sub(1), next: i + 1 }).collect();
        let id_at = |syms: &[Sym], i: usize| syms.get(i).map(|s| s.id).filter(|&id| id != GONE);
        let pair = |syms: &[Sym], left: usize| self.merges.get(&(id_at(syms, left)?, id_at(syms, syms[left].next)?)).copied();
        let mut heap = BinaryHeap::with_capacity(word.len());
        for left in 0..word.len().saturating_sub(1) {
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

/// The byte ids, merges and (with `ignore_merges`) whole words of a byte-level BPE model in `tokenizer.json`.
#[allow(clippy::type_complexity)]
fn vocabulary(model: &Value) -> Option<([u32; 256], HashMap<(u32, u32), (u32, u32)>, Option<HashMap<Box<[u8]>, u32>>)> {
    let vocab = model["vocab"].as_object()?;
    let id = |token: &str| vocab.get(token)?.as_u64().and_then(|id| u32::try_from(id).ok());
    let chars = byte_chars();
    let mut byte_ids = [0; 256];
    for (b, c) in byte_ids.iter_mut().zip(chars) {
        *b = id(c.encode_utf8(&mut [0; 4]))?;
    }
    let mut merges = HashMap::default();
    for (rank, merge) in model["merges"].as_array()?.iter().enumerate() {
        let (a, b) = match merge {
            Value::String(pair) => pair.split_once(' ')?,
            Value::Array(pair) => (pair.first()?.as_str()?, pair.get(1)?.as_str()?),
            _ => return None,
        };
        let joined = id(&format!("{a}{b}"))?;
        // A pair listed twice keeps its last rank, as the Hugging Face model builds its map.
        merges.insert((id(a)?, id(b)?), (u32::try_from(rank).ok()?, joined));
    }
    let whole_words = if model["ignore_merges"] == true {
        let byte_of: HashMap<char, u8> = chars.iter().zip(0..=255u8).map(|(&c, b)| (c, b)).collect();
        let words = vocab.iter().filter_map(|(token, id)| {
            let bytes: Option<Box<[u8]>> = token.chars().map(|c| byte_of.get(&c).copied()).collect();
            Some((bytes?, u32::try_from(id.as_u64()?).ok()?))
        });
        Some(words.collect())
    } else {
        None
    };
    Some((byte_ids, merges, whole_words))
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
    fn the_byte_level_families_take_the_fast_path_and_gemma_does_not() {
        for (family, fast) in [("qwen3", true), ("llama3_1", true), ("deepseek_v3", true), ("gemma3", false)] {
            let tok = crate::Tokenizer::load(crate::tokenizer::tests::family_dir(family).to_str().unwrap(), 0).unwrap();
            let crate::tokenizer::Encoder::Hf { fast: found, .. } = &tok.encoder else { panic!() };
            assert_eq!(found.is_some(), fast, "{family}");
        }
    }
}
